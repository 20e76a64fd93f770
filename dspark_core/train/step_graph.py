"""The whole training step -- forward, loss, backward, clip, AdamW -- replayed from a CUDA graph.

A step of the draft launches several hundred kernels, each queued from Python. :class:`CapturedStep` records the
step once per input shape (a *key*) and replays it: one launch a step, so the host's time and the gaps between
launches leave the step; the same kernels on the same addresses, so the numbers are the eager step's to the bit
(``tests/test_step_graph.py``). What that buys is the ``--launch graph`` rows of ``benchmarks/bench_train_step.py``
against its eager rows.

The protocol, for a ``step(key, *tensors) -> outputs`` function (the key is how it finds a call's host values):

- a key seen for the first time runs ``step`` eagerly on the capture stream -- that run *is* the step, its outputs
  are returned -- then records ``step`` on copies of its tensors that the key keeps (recording runs nothing, so no
  update is applied twice);
- a known key copies the call's tensors into its own (``Tensor.copy_``, the same shapes) and replays; the outputs
  are the recorded ones, overwritten by the next replay of that key, so a caller that reads them later takes
  ``clone=True``.

Every key's graph draws on one memory pool: the graphs run one after another on one stream, so they share their
scratch memory. What ``step`` reads besides its tensors (the weights, the optimiser's state, Python values such as
a loss weight) is baked in at recording: the optimiser must update in place on the device (``capturable`` groups,
a tensor ``lr`` to change it between steps) and a host value that differs between calls must be part of the key.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

import torch


class CapturedStep:
    """``step`` recorded once per key and replayed (see the module docstring); ``max_graphs`` keys at most (a key
    past it runs eagerly, counted in ``eager_calls``). ``captures`` counts the recorded keys."""

    def __init__(self, step: Callable[..., Any], device: torch.device, max_graphs: int = 16) -> None:
        if torch.device(device).type != "cuda":
            raise ValueError(f"CapturedStep needs a CUDA device; got {device}")
        self.step, self.device, self.max_graphs = step, torch.device(device), max_graphs
        self.stream = torch.cuda.Stream(self.device)  # eager first runs and recordings
        self.pool = torch.cuda.graph_pool_handle()  # one scratch pool for every key's graph
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], Any]] = {}
        self.captures = self.eager_calls = 0

    def __call__(self, key: Hashable, tensors: Sequence[torch.Tensor], clone: bool = False) -> Any:
        if key in self.graphs:
            return self._replay(key, tensors, clone)
        out = self._on_stream(lambda: self.step(key, *tensors))  # the step itself, eagerly
        if len(self.graphs) < self.max_graphs:
            self._record(key, tuple(t.clone() for t in tensors))  # the key's own inputs, not the caller's
        else:
            self.eager_calls += 1
        return out

    def _replay(self, key: Hashable, tensors: Sequence[torch.Tensor], clone: bool) -> Any:
        graph, static, out = self.graphs[key]
        for mine, new in zip(static, tensors):
            mine.copy_(new)  # [same shape] into the recorded addresses
        graph.replay()
        return torch.utils._pytree.tree_map(lambda t: t.clone() if clone and torch.is_tensor(t) else t, out)

    def _record(self, key: Hashable, static: tuple[torch.Tensor, ...]) -> None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = self.step(key, *static)
        self.graphs[key] = (graph, static, out)
        self.captures += 1

    def _on_stream(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the capture stream, ordered after the work queued so far and before what follows."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = fn()
        current.wait_stream(self.stream)
        for t in torch.utils._pytree.tree_leaves(out):  # read on the caller's stream: not reused before that
            if torch.is_tensor(t) and t.is_cuda:
                t.record_stream(current)
        return out
