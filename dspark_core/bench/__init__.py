"""Benchmarks that run as pipeline stages: the online speculative-decoding benchmark (``online``), its peers
(``peers``) and plots (``plots``)."""
