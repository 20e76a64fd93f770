"""Online speculative decoding (batch 1): static-KV-cache target runner, sampling / exact verification,
the propose -> verify -> update engine and the AR baseline on the same code path.

Importing this package needs only torch (transformers for the HF model you pass in)."""

from dspark_core.decoding.ar import ARDecoder
from dspark_core.decoding.engine import SpeculativeDecoder
from dspark_core.decoding.sampling import SamplingParams, logits_to_probs, make_sample_fn, verify_greedy, verify_rejection
from dspark_core.decoding.target_runner import TargetRunner
from dspark_core.decoding.types import CycleInfo, GenerationResult, VerificationResult

__all__ = ["ARDecoder", "CycleInfo", "GenerationResult", "SamplingParams", "SpeculativeDecoder", "TargetRunner",
           "VerificationResult", "logits_to_probs", "make_sample_fn", "verify_greedy", "verify_rejection"]
