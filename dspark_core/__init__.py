"""dspark: speculative-decoding drafts (DSpark, variants, Parallel DMTD) as a DVC pipeline."""
__version__ = "0.1.0"
