"""Cached Parallel DMTD generation (seed 001 section 二) and the plain AR decode it is compared with.

Caches are static, preallocated ``[layers, B, Hkv, slots, D]`` buffers indexed by position (gpt-fast
style): a step writes its K/V with ``index_copy_`` at tensor positions and attends over the whole
buffer under a mask built from ``masks.visible`` on slot attributes, so every step has fixed shapes
and can be captured as a CUDA graph (optionally torch.compile'd first).

DMTD state (``DMTDDecoder``):
- S cache ``C_S``: one slot per real token, appended once per token, never refilled (all variants).
- P cache ``C_P``:
  * refresh: real K/V only. Slots ``[0, max_len)`` hold refreshed real tokens; ``tau`` extra scratch
    slots after them hold the current shadow block's K/V, which only that forward reads (discarded:
    the next cycle overwrites them and they never count as history). The steady-state cycle is ONE
    P forward over ``2 tau`` slots ``[previous cycle's real tokens ; head, MASK...]`` with the seed's
    block mask (7.3): real queries causal over real history, shadow queries over all real history
    plus their own block (causal or bidirectional); the real half is appended, the shadow half not.
  * norefresh: every layer's shadow K/V of every cycle is appended and kept; no refill.
- ``shadow`` ``[B, tau, H]``: the P output of the current cycle, read by the S step of each token.

Prompt prefill runs the training layout (``DMTDModel.layout`` with completed cycles) over the prompt:
P layers on the prompt's shadow (and, refresh, real) streams, S layers on the real tokens. Cycles are
by absolute position: the prompt's last cycle starts at ``c0 = tau * ((n-1) // tau)``; its shadow block
``[x_c0, MASK...]`` (through position ``c0 + tau - 1``) is computed in the prefill; refresh caches real
K/V of positions ``< c0`` only (positions ``c0 .. c0+tau-1`` are refreshed by the next cycle's merged
forward, prompt tokens or not). Then generation runs cycles: at every head position p (``p % tau == 0``)
one P forward, then one S step per token. A refresh prompt shorter than tau is the seed's "first cycle":
its P forward holds only the shadow block.

Shape legend: B batch, n prompt tokens, m new tokens, V vocab, H hidden, Hkv K/V heads, D head dim,
M max positions, Nq slots of a cycle step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from dspark_core.dmtd.layers import attend_dense, head_dims, layer_out, layer_qkv, rope
from dspark_core.dmtd.masks import CAUSAL, Slots, dense_mask
from dspark_core.dmtd.model import DMTDModel, StackModel
from dspark_core.decoding.sampling import SamplingParams, select_tokens
from dspark_core.decoding.target_runner import fuse_layer, kernel_head, kernel_layers, model_spec, rope_tables
from dspark_core.decoding.target_runner import kernels_problem as target_kernels_problem
from dspark_core.errors import UserError

GRAPH_MODES = ("none", "cuda_graph", "compile")
S_STEP_GEMM = "fma"  # small-GEMM family of the kernel path's one-token S step and LM head (the faster at n = 1)


class KVBuffers:
    """Static K/V of ``layers`` decoder layers: ``k``, ``v`` ``[layers, B, Hkv, slots, D]``."""

    def __init__(self, layers: int, batch: int, kv_heads: int, slots: int, head_dim: int, device, dtype):
        shape = (layers, batch, kv_heads, slots, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    def write(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [B, Hkv, len(index), D]`` at slots ``index [n]`` of ``layer``."""
        self.k[layer].index_copy_(2, index, k.to(self.k.dtype))
        self.v[layer].index_copy_(2, index, v.to(self.v.dtype))


def decode_layer(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, write_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One decoder layer on new slots ``x [B, Nq, H]``: write their K/V at ``write_index [Nq]`` of the layer's
    cache ``[B, Hkv, slots, D]``, attend over the whole cache under ``mask [1, 1, Nq, slots]``."""
    q, k, v = layer_qkv(layer, x, cos, sin)
    k_cache.index_copy_(2, write_index, k.to(k_cache.dtype))
    v_cache.index_copy_(2, write_index, v.to(v_cache.dtype))
    return layer_out(layer, x, attend_dense(q, k_cache, v_cache, mask, layer.self_attn.scaling))


_compiled_decode_layer = None


def compiled_decode_layer():
    """``decode_layer`` through torch.compile, shared by every layer and decoder (regional compilation: the
    layers' modules are inlined with their weights as inputs, so one compiled graph per slot count serves
    all layers)."""
    global _compiled_decode_layer
    if _compiled_decode_layer is None:
        _compiled_decode_layer = torch.compile(decode_layer, fullgraph=True, dynamic=False)
    return _compiled_decode_layer


class StepRunner:
    """Runs a zero-argument step that reads and writes only static tensors: eagerly, or replayed as one
    captured CUDA graph. Capturing runs the step a few times on whatever the static inputs hold: callers
    point them at slots that are always rewritten before being read."""

    def __init__(self, fn: Callable[[], torch.Tensor | None], capture: bool):
        self.fn = fn
        self.graph = None
        self.out = None
        if capture:
            self._capture()

    @torch.no_grad()
    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.fn()

    def __call__(self):
        if self.graph is None:
            return self.fn()
        self.graph.replay()
        return self.out


def resolve_graph_mode(mode: str, device: torch.device) -> str:
    """``auto`` -> ``cuda_graph`` on GPU, ``none`` on CPU. ``cuda_graph`` needs a GPU; ``compile`` compiles
    the decoder layer (and captures CUDA graphs on a GPU)."""
    if mode == "auto":
        return "cuda_graph" if device.type == "cuda" else "none"
    if mode not in GRAPH_MODES:
        raise ValueError(f"graph mode must be auto or one of {', '.join(GRAPH_MODES)}; got {mode!r}")
    if mode == "cuda_graph" and device.type != "cuda":
        raise UserError(f"dmtd.eval.graph: {mode!r} needs a CUDA device, and the model is on {device}; set it to "
                        "auto or none")
    return mode


@dataclass
class GenerationResult:
    tokens: list[list[int]]           # per row: new tokens, cut after the first stop token
    num_new_tokens: int               # tokens generated per row before stopping (max over rows)
    prefill_s: float
    decode_s: float                   # first sampled token to the last, excluding the prefill

    @property
    def tokens_per_s(self) -> float:
        return self.num_new_tokens / self.decode_s if self.decode_s > 0 else float("nan")


class CachedDecoder:
    """Generation loop shared by DMTD and AR: prefill, then one ``_step`` per token."""

    def __init__(self, model: StackModel, max_len: int, batch_size: int, round_to: int, graph: str):
        p = next(model.parameters())
        self.model, self.device, self.dtype = model, p.device, p.dtype
        self.max_len = -(-max_len // round_to) * round_to
        self.batch = batch_size
        self.hq, self.hkv, self.hd = head_dims(model.config)
        self.tokens = torch.zeros(batch_size, self.max_len, dtype=torch.long, device=self.device)  # [B, M]
        self._pos = torch.zeros(1, dtype=torch.long, device=self.device)           # step position p
        self._tok = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)
        self._slots = torch.arange(self.max_len, device=self.device)               # [M]
        self.graph_mode = resolve_graph_mode(graph, self.device)
        self._layer = compiled_decode_layer() if self.graph_mode == "compile" else decode_layer
        self._capture = self.device.type == "cuda" and self.graph_mode != "none"

    # -- to implement -----------------------------------------------------------------------------
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        """Process ``prompt [B, n]``; return its logits ``[B, n, V]``."""
        raise NotImplementedError

    def _step(self, p: int) -> torch.Tensor:
        """Process the token at position ``p`` (already in ``self.tokens``); logits ``[B, V]`` for p+1."""
        raise NotImplementedError

    # -- shared -----------------------------------------------------------------------------------
    def _check_prompt(self, prompt: torch.Tensor, extra: int) -> int:
        if prompt.dim() != 2 or prompt.shape[0] != self.batch:
            raise ValueError(f"prompt must be [B={self.batch}, n] token ids; got shape {tuple(prompt.shape)}")
        n = prompt.shape[1]
        if n < 1:
            raise ValueError("the prompt must hold at least one token")
        if n + extra > self.max_len:
            raise ValueError(f"prompt ({n}) + new tokens ({extra}) exceed the decoder's max_len={self.max_len}")
        return n

    def _s_input(self, p: int) -> None:
        self._tok.copy_(self.tokens[:, p: p + 1])
        self._pos.fill_(p)

    @torch.no_grad()
    def score(self, prompt: torch.Tensor, continuation: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits ``[B, n+m, V]`` of ``prompt [B, n] + continuation [B, m]`` through the cache."""
        n = self._check_prompt(prompt, continuation.shape[1])
        out = [self.prefill(prompt.to(self.device)).float()]
        self.tokens[:, n: n + continuation.shape[1]] = continuation.to(self.device)
        for j in range(continuation.shape[1]):
            out.append(self._step(n + j).float().clone()[:, None])
        return torch.cat(out, dim=1)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 stop_token_ids: Sequence[int] = (), generator: torch.Generator | None = None,
                 stop_check_every: int = 4) -> GenerationResult:
        """Greedy or sampled generation of up to ``max_new_tokens`` after ``prompt [B, n]``. Stop tokens are
        checked every ``stop_check_every`` tokens (one host sync each), and the rows cut after the first."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
        n = self._check_prompt(prompt, max_new_tokens)
        stops = torch.tensor(list(stop_token_ids), dtype=torch.long, device=self.device)
        t0 = _now(self.device)
        logits = self.prefill(prompt.to(self.device))[:, -1]  # [B, V]
        t1 = _now(self.device)
        p = n
        for i in range(max_new_tokens):
            self.tokens[:, p] = select_tokens(logits.float(), sampling, generator)
            p += 1
            if i == max_new_tokens - 1:
                break
            if stops.numel() and (i + 1) % stop_check_every == 0 and bool(
                    torch.isin(self.tokens[:, n:p], stops).any(1).all()):
                break
            logits = self._step(p - 1)
        t2 = _now(self.device)
        rows = [_cut(r, stop_token_ids) for r in self.tokens[:, n:p].tolist()]
        return GenerationResult(tokens=rows, num_new_tokens=max(len(r) for r in rows), prefill_s=t1 - t0,
                                decode_s=t2 - t1)

    def _decode_layers(self, layers, cache: KVBuffers, x: torch.Tensor, pos: torch.Tensor,
                       write_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """New slots ``x [B, Nq, H]`` at positions ``pos [B, Nq]`` through ``layers``: each layer writes its
        K/V at ``write_index [Nq]`` of its cache, then attends over the whole cache under ``mask``."""
        cos, sin = rope(self.model.lm.model.rotary_emb, x, pos)
        for i, layer in enumerate(layers):
            x = self._layer(layer, x, cos, sin, cache.k[i], cache.v[i], write_index, mask)
        return x

    def _token_mask(self, cache_slots: int) -> torch.Tensor:
        """``[1, 1, 1, cache_slots]``: the real token at position p sees cached real tokens ``<= p``."""
        p = self._pos.view(1, 1)
        q = Slots.make(p, torch.zeros_like(p), False, 1)
        kpos = self._slots[:cache_slots].view(1, -1)
        k = Slots.make(kpos, (kpos <= p).long() - 1, False, 1)  # doc 0 once written, else -1
        return dense_mask(q, k, CAUSAL)


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _cut(row: list[int], stops: Sequence[int]) -> list[int]:
    for i, t in enumerate(row):
        if t in stops:
            return row[: i + 1]
    return row


class DMTDDecoder(CachedDecoder):
    """Cycled DMTD decode: one P forward per cycle of tau tokens, one S step per token."""

    def __init__(self, model: DMTDModel, max_len: int, batch_size: int = 1, graph: str = "auto",
                 kernels: bool | str = "auto", kernel_gemm: tuple[str, str] | None = None):
        tau = model.tau
        super().__init__(model, max(max_len, 2 * tau), batch_size, round_to=tau, graph=graph)
        self.tau, self.rule = tau, model.rule
        self.kernels = resolve_kernels(kernels, model, batch_size)
        align = 16 if self.kernels else 1  # the kernels' caches: a multiple of 16 slots
        scratch = tau if self.rule.refresh else 0
        p_slots, s_slots = _round(self.max_len + scratch, align), _round(self.max_len, align)
        self.p_cache = KVBuffers(model.num_parallel_layers, batch_size, self.hkv, p_slots, self.hd, self.device,
                                 self.dtype)
        self.s_cache = KVBuffers(len(model.sequential_layers), batch_size, self.hkv, s_slots, self.hd, self.device,
                                 self.dtype)
        self.shadow = torch.zeros(batch_size, tau, model.config.hidden_size, device=self.device, dtype=self.dtype)
        width = 2 * tau if self.rule.refresh else tau
        self._block = torch.full((batch_size, width), model.mask_token_id, dtype=torch.long, device=self.device)
        self._arange = torch.arange(2 * tau, device=self.device)
        self._stack = KernelStack(model, p_slots, kernel_gemm) if self.kernels else None
        self._s_out = torch.zeros(batch_size, 1, model.config.hidden_size, device=self.device, dtype=self.dtype)
        # capture on head position tau: every slot it writes is rewritten before it is read
        self._pos.fill_(tau)
        self._cycle_run = StepRunner(self._cycle_step, self._capture)
        self._token_run = StepRunner(self._token_step, self._capture)

    # -- prefill ------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        model, tau = self.model, self.tau
        b, n = prompt.shape
        c0 = tau * ((n - 1) // tau)  # head of the prompt's last cycle
        pos = torch.arange(n, device=self.device).expand(b, n)
        doc = torch.zeros_like(pos)
        lay = model.layout(prompt, pos, doc, complete_cycles=True, tail_multiple=1)
        if self.rule.refresh:  # real slots come first in the stream; keep the refreshed positions < c0
            keep = torch.arange(c0, device=self.device)
        else:                  # every shadow slot (prompt cycles + the last cycle's tail)
            keep = torch.arange(lay.slots.size, device=self.device)
        where = lay.slots.pos[0, keep]
        p_out = model.parallel_hidden(
            lay, kv_sink=lambda i, k, v: self.p_cache.write(i, where, k[:, :, keep], v[:, :, keep]), backend="dense")
        start = lay.shadow_start
        self.shadow.copy_(p_out[:, start + c0: start + c0 + tau])  # slots of positions c0 .. c0+tau-1
        slots = self._slots[:n]
        h = model.sequential_hidden(prompt, pos, doc, p_out[:, start: start + n],
                                    kv_sink=lambda i, k, v: self.s_cache.write(i, slots, k, v), backend="dense")
        self.tokens[:, :n] = prompt
        return model.final_logits(h)

    # -- steps ----------------------------------------------------------------------------------------
    def _step(self, p: int) -> torch.Tensor:
        if p % self.tau == 0:
            self._start_cycle(p)
        self._s_input(p)
        return self._token_run()

    def _start_cycle(self, p: int) -> None:
        tau = self.tau
        if self.rule.refresh:  # [x_{p-tau} .. x_{p-1} | x_p, MASK ...]
            self._block[:, : tau + 1].copy_(self.tokens[:, p - tau: p + 1])
        else:                  # [x_p, MASK ...]
            self._block[:, :1].copy_(self.tokens[:, p: p + 1])
        self._pos.fill_(p)
        self._cycle_run()

    def cycle_layout(self):
        """Query positions ``[Nq]``, cache write slots ``[Nq]`` and mask ``[1, 1, Nq, slots]`` of the cycle
        whose head is at ``self._pos`` (Nq = 2 tau for refresh, tau for norefresh)."""
        tau, p, m = self.tau, self._pos, self.max_len
        if self.rule.refresh:
            q_pos = p - tau + self._arange                            # real p-tau..p-1, shadow p..p+tau-1
            q_shadow = self._arange >= tau
            write = torch.cat([q_pos[:tau], m + self._arange[:tau]])  # real half -> its positions; shadow -> scratch
            k_pos = torch.cat([self._slots, q_pos[tau:]])             # [M + tau]
            k_shadow = torch.cat([self._slots < 0, q_shadow[tau:]])
            k_valid = torch.cat([self._slots < p, q_shadow[tau:]])    # refreshed real tokens, then this block
        else:
            q_pos = p + self._arange[:tau]                            # shadow p..p+tau-1
            q_shadow = q_pos >= 0
            write = q_pos                                             # appended and kept
            k_pos = self._slots
            k_shadow = self._slots >= 0
            k_valid = self._slots < p + tau
        q = Slots.make(q_pos[None], torch.zeros_like(q_pos)[None], q_shadow[None], tau)
        k = Slots.make(k_pos[None], k_valid.long()[None] - 1, k_shadow[None], tau)
        return q_pos, write, dense_mask(q, k, self.rule)

    def kernel_cycle_layout(self) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The cycle at ``self._pos`` in the decode kernels' terms (``target_runner.kernel_layers``): RoPE / write
        positions ``[Nq]``, attention positions ``[Nq]`` (the last logical key a row sees) and the slot remap
        ``(offset, back)`` ``[Nq]``. Refresh: real rows causal at their own slots; shadow rows written ``max_len - p``
        slots further (the scratch slots) and reading their block there (logical keys ``>= p``), the real history
        below ``p`` in place. Bidirectional shadow rows see up to the block's last position ``p + tau - 1``."""
        tau, p = self.tau, self._pos
        if self.rule.refresh:
            rows = self._arange                                        # [2 tau]
            q_pos = p - tau + rows                                     # real p-tau..p-1, shadow p..p+tau-1
            shadow = rows >= tau
            seen = p + tau - 1 + 0 * rows if self.rule.bidirectional else q_pos
            attn_pos = torch.where(shadow, seen, q_pos)
            offset = torch.where(shadow, self.max_len - p + 0 * rows, 0 * rows)
            back = torch.where(shadow, attn_pos - p, 0 * rows)
            return q_pos, attn_pos, (offset, back)
        q_pos = p + self._arange[:tau]                                 # shadow p..p+tau-1, appended and kept
        attn_pos = p + tau - 1 + 0 * q_pos if self.rule.bidirectional else q_pos
        return q_pos, attn_pos, None

    def _cycle_step(self) -> None:
        """One P forward for the cycle whose head is at ``self._pos``; leaves ``self.shadow``."""
        if self._stack is not None:
            q_pos, attn_pos, tree = self.kernel_cycle_layout()
            x = self._stack.parallel(self._block[0], self.p_cache, q_pos, attn_pos, tree)  # [Nq, H]
            self.shadow[0].copy_(x[-self.tau:])
            return
        q_pos, write, mask = self.cycle_layout()
        x = self.model.embed(self._block)  # [B, Nq, H]
        x = self._decode_layers(self.model.parallel_layers, self.p_cache, x, q_pos[None].expand(self.batch, -1),
                                write, mask)
        self.shadow.copy_(x[:, -self.tau:])

    def _s_hidden(self) -> torch.Tensor:
        """S layers on ``embed(x_p) + s_{p mod tau}`` -> pre-norm hidden ``[B, 1, H]``."""
        p = self._pos
        shadow = self.shadow.index_select(1, p % self.tau)  # [B, 1, H]
        if self._stack is not None:
            return self._stack.sequential(self._tok[0], shadow[0], self.s_cache, p)[None]
        x = self.model.embed(self._tok) + shadow  # [B, 1, H]
        pos = p.view(1, 1).expand(self.batch, 1)
        return self._decode_layers(self.model.sequential_layers, self.s_cache, x, pos, p,
                                   self._token_mask(self.max_len))

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head of ``x [B, 1, H]`` -> logits ``[B, V]`` float32."""
        if self._stack is not None:
            return self._stack.head(x[0]).float()
        return self.model.final_logits(x)[:, 0].float()

    def _token_step(self) -> torch.Tensor:
        """The S step of the token at ``self._pos``: logits ``[B, V]`` for position p+1."""
        return self._head(self._s_hidden())

    def pieces(self) -> dict[str, StepRunner]:
        """The decode's pieces as separate steps (CUDA graphs where the decoder captures), for timing each:
        ``p_step`` (one cycle's P forward), ``s_step`` (the S layers of one token) and ``lm_head``. They run on
        whatever the decoder's state holds (head position ``tau`` until a prefill)."""
        return {"p_step": StepRunner(self._cycle_step, self._capture),
                "s_step": StepRunner(lambda: self._s_out.copy_(self._s_hidden()), self._capture),
                "lm_head": StepRunner(lambda: self._head(self._s_out), self._capture)}


def _round(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def resolve_kernels(kernels: bool | str, model: DMTDModel, batch_size: int) -> bool:
    """``auto`` -> the Triton decode kernels on CUDA where they apply; ``True`` -> them (ValueError naming why
    not where they do not apply); ``False`` -> the torch layer path."""
    if kernels not in ("auto", True, False):
        raise ValueError(f"kernels must be auto, True or False; got {kernels!r}")
    device = next(model.parameters()).device
    if kernels is False or (kernels == "auto" and device.type != "cuda"):
        return False
    problem = kernels_problem(model, batch_size)
    if problem and kernels is True:
        raise ValueError(f"DMTD kernels=True does not apply: {problem}")
    return problem is None


def kernels_problem(model: DMTDModel, batch_size: int = 1) -> str | None:
    """Why the decode kernels do not run this DMTD model (None when they do): the target runner's conditions,
    and a cycle step of at most ``kernels.linear.MAX_TOKENS`` rows."""
    from dspark_core.kernels.linear import MAX_TOKENS

    problems = [target_kernels_problem(model.lm)]
    if batch_size != 1:
        problems.append(f"batch_size is {batch_size} (the DMTD kernel stack decodes batch 1)")
    rows = 2 * model.tau if model.rule.refresh else model.tau
    if rows > MAX_TOKENS:
        problems.append(f"the cycle step has {rows} rows (tau {model.tau}); the kernels take at most {MAX_TOKENS}")
    return "; ".join(p for p in problems if p) or None


class KernelStack:
    """The P and S layer groups and the LM head of a DMTD model on the Triton decode kernels (batch 1), through
    the target runner's shared stack (``target_runner.kernel_layers``): fused weights (shared with any target
    runner of the same model), RoPE tables of ``slots`` positions, and the small-GEMM family of each step
    (``gemm = (S step, P step)``; default ``fma`` for the one-token S step and LM head, ``mma`` for the P step
    where tensor cores apply: each the faster of the two at its row count)."""

    def __init__(self, model: DMTDModel, slots: int, gemm: tuple[str, str] | None = None):
        from dspark_core.kernels.linear import SMALL_GEMM_MODES, small_gemm_problem

        lm = model.lm
        device = next(model.parameters()).device
        self.s_gemm, self.p_gemm = gemm or (S_STEP_GEMM, "fma" if small_gemm_problem(device) else "mma")
        for mode in (self.s_gemm, self.p_gemm):
            if mode not in SMALL_GEMM_MODES:
                raise ValueError(f"kernel_gemm modes must be in {SMALL_GEMM_MODES}; got {gemm!r}")
        self.spec = model_spec(lm)
        self.p_layers = [fuse_layer(layer) for layer in model.parallel_layers]
        self.s_layers = [fuse_layer(layer) for layer in model.sequential_layers]
        self.cos, self.sin = rope_tables(lm, slots)  # [M, D]
        self.embed_w, self.norm_w = lm.model.embed_tokens.weight, lm.model.norm.weight
        self.head_w, self.head_b = lm.lm_head.weight, lm.lm_head.bias

    def parallel(self, ids: torch.Tensor, cache: KVBuffers, pos: torch.Tensor, attn_pos: torch.Tensor,
                 tree: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """P layers on the cycle's rows ``ids [Nq]`` -> ``[Nq, H]`` (see ``DMTDDecoder.kernel_cycle_layout``)."""
        from dspark_core.kernels.linear import small_gemm

        with small_gemm(self.p_gemm):
            x = F.embedding(ids, self.embed_w)  # [Nq, H]
            return kernel_layers(x, self.p_layers, cache.k, cache.v, self.cos, self.sin, pos, self.spec,
                                 attn_pos=attn_pos, tree=tree)

    def sequential(self, tok: torch.Tensor, shadow: torch.Tensor, cache: KVBuffers, pos: torch.Tensor
                   ) -> torch.Tensor:
        """S layers on ``embed(tok [1]) + shadow [1, H]`` at position ``pos [1]``, causal -> ``[1, H]``."""
        from dspark_core.kernels.linear import small_gemm

        with small_gemm(self.s_gemm):
            x = F.embedding(tok, self.embed_w) + shadow  # [1, H]
            return kernel_layers(x, self.s_layers, cache.k, cache.v, self.cos, self.sin, pos, self.spec)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head: ``x [1, H]`` -> logits ``[1, V]``."""
        from dspark_core.kernels.linear import small_gemm

        with small_gemm(self.s_gemm):
            return kernel_head(x, self.norm_w, self.head_w, self.head_b, self.spec)
