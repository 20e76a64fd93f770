"""Parallel DMTD (seed 001): the target fine-tuned to run its first P layers once per cycle of tau tokens.

config.py (params section ``dmtd``), masks.py (visibility rules), layers.py (functional decoder layers),
model.py (teacher-forced training forward), inference.py (cached generation, plain AR decode),
data.py (packing), task.py (``DMTDTask`` for the shared trainer), evaluate.py (perplexity, GSM8K, tokens/s).
"""
