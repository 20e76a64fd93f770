"""Benchmarks that run as pipeline stages: the online speculative-decoding benchmark (``online``), its peers
(``peers``) and plots (``plots``); and the training-step peer of ``benchmarks/bench_train_step.py --peers``
(``train_peers``: speculators' own DSpark step)."""
