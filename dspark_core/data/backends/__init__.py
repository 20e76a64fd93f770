"""Regenerate backends: ``hf`` (transformers), ``vllm`` (offline engine), ``openai`` (HTTP endpoint).

Each module imports its heavy dependency lazily, so ``import dspark_core.data.backends`` is cheap.
"""

from dspark_core.data.backends.base import (Backend, Generation, Request, SamplingSpec, finalize_response,
                                            request_seed)

BACKENDS = ("hf", "vllm", "openai")

__all__ = ["BACKENDS", "Backend", "Generation", "Request", "SamplingSpec", "finalize_response", "request_seed"]
