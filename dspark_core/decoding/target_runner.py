"""Fast target forward with a static KV cache (gpt-fast style), for verification and AR decoding.

``TargetRunner(model, max_len=..., aux_layer_ids=...)`` wraps a Hugging Face Qwen3 / Qwen2 / Llama
``*ForCausalLM``. It reads the HF model's own weight tensors (no copies) and runs a compact
re-implementation of the decoder (RMSNorm, q/k norm for Qwen3, RoPE from the HF rotary module's
table, GQA attention, gated MLP) against a preallocated cache ``[layers, B, Hkv, max_len, D]`` and a
host-side length pointer.

- ``prefill(ids [B, n])``: reset the cache and process the prompt -> ``logits, aux_hidden``.
- ``forward(ids [B, n])``: append ``n`` tokens at the current length -> ``logits [B, n, V]``,
  ``aux_hidden [B, n, K, H]`` (used for verification, n = 1 + proposal, and for AR decoding, n = 1).
- ``truncate(length)``: roll back; stale K/V beyond ``length`` are never read (causal mask on the
  absolute position) and get overwritten by the next ``forward``.
- ``step(ids [B, n], pos [n], tree=...)``: the same forward at device positions, sync-free and without
  moving the host length (what CUDA-graph-captured engines run); ``move_kv(src, dst)`` copies K/V between
  cache slots (a draft tree's accepted path into place); ``commit(length)`` then sets the host length
  to what the device-side steps left in the cache. ``caches`` gives the K / V cache tensors to kernels
  that update them in place (the fused tree accept).

Aux layer ids follow the cache stage: zero-based decoder layer ids, ``-1`` = embedding output; the
final layer is refused (its HF hidden state is the normalised one).

GPU speed: the step is shape-static and sync-free (positions come from a device ``arange`` offset
by a Python int; the mask and RoPE rows are computed on the device), so ``cuda_graph=True`` captures
one CUDA graph per chunk length ``n <= graph_max_tokens`` on first use (the n = 1 decode step and the
fixed-n verify steps) and replays it. ``compile=True`` additionally runs the two halves of the decoder
layer (before / after the attention) and the head through ``torch.compile`` (one compiled graph per
half shared by all layers: weights are arguments), which fuses the element-wise work between the
matmuls. Outputs of a graph replay live in static buffers: they are valid until the next ``forward``.

``kernels=True`` (CUDA) runs every chunk of n <= 16 tokens (batch 1), and every step of several request rows
(``step_rows``, any number of tokens), through the Triton kernels of ``dspark_core.kernels`` instead: 6 kernels per decoder layer (norm fused into the Q/K/V and
gate/up matrix-vector products, SiLU and residual adds in their epilogues, q/k norm + RoPE + cache write
in one kernel, split-KV attention). The Q/K/V and gate/up weights are concatenated once and the HF
module weights re-pointed to views of the concatenation (values unchanged, no second copy).

Measured on one H200 at Qwen3-4B shapes (bf16, batch 1, random weights, ``benchmarks/bench_decode.py``;
weight-read limit 520 tokens/s at the measured 4.2 TB/s copy bandwidth):

| path | n = 1 step | AR tokens/s | of the limit | n = 8 verify |
|---|---|---|---|---|
| compile + CUDA graphs (cuBLAS GEMVs, separate Q/K/V) | 4.94 ms | 197.5 | 37 % | 4.68 ms |
| ``kernels=True`` + CUDA graphs + PDL, ``small_gemm: fma`` | 2.52 ms | 392.3 | 75 % | 10.8 ms |
| ``kernels=True`` + CUDA graphs + PDL, ``small_gemm: mma`` (swap-AB + split-K tiles) | 2.91 ms | 339.7 | 65 % | 3.01 ms |

Both kernel modes are batch-invariant (verify logits bit for bit those of AR steps); ``fma`` is the fast AR
step, ``mma`` (the default where bf16 tensor cores exist) the cheap verify (see ``dspark_core.kernels.linear``).

Shape legend: B batch, n tokens in this call, M cache positions (max_len rounded up to 16), L decoder
layers, Hq / Hkv query / KV heads, D head dim, G = Hq / Hkv, H hidden, F FFN width, K aux layers, V vocab.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from dspark_core.errors import UserError
from dspark_core.ops import apply_rope, rms_norm

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")
_UNSUPPORTED_ROPE = ("dynamic", "longrope")  # their tables depend on the sequence length


@dataclass(frozen=True)
class _Spec:
    """Static (Python) facts of the architecture; the same object for every layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scaling: float
    act: Callable[[torch.Tensor], torch.Tensor]


class LayerWeights(NamedTuple):
    """One decoder layer's weights: references into the HF modules (None where the family has none)."""

    ln1: torch.Tensor
    q_w: torch.Tensor
    q_b: torch.Tensor | None
    k_w: torch.Tensor
    k_b: torch.Tensor | None
    v_w: torch.Tensor
    v_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3 only
    k_norm: torch.Tensor | None
    ln2: torch.Tensor
    gate_w: torch.Tensor
    gate_b: torch.Tensor | None
    up_w: torch.Tensor
    up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None


def _layer_weights(layer: torch.nn.Module) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    return LayerWeights(
        layer.input_layernorm.weight,
        attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight, attn.k_proj.bias,
        attn.v_proj.weight, attn.v_proj.bias, attn.o_proj.weight, attn.o_proj.bias,
        None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
        layer.post_attention_layernorm.weight,
        mlp.gate_proj.weight, mlp.gate_proj.bias, mlp.up_proj.weight, mlp.up_proj.bias,
        mlp.down_proj.weight, mlp.down_proj.bias,
    )


def attention_inputs(x: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, spec: _Spec
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, n, H] -> q [B, Hq, n, D], k / v [B, Hkv, n, D] (input norm, projections, Qwen3 q/k norm, RoPE)."""
    b, n, _ = x.shape
    h = rms_norm(x, w.ln1, spec.eps)
    q = F.linear(h, w.q_w, w.q_b).view(b, n, spec.num_heads, spec.head_dim)  # [B, n, Hq, D]
    k = F.linear(h, w.k_w, w.k_b).view(b, n, spec.num_kv_heads, spec.head_dim)  # [B, n, Hkv, D]
    v = F.linear(h, w.v_w, w.v_b).view(b, n, spec.num_kv_heads, spec.head_dim)  # [B, n, Hkv, D]
    if w.q_norm is not None:
        q = rms_norm(q, w.q_norm, spec.eps)
        k = rms_norm(k, w.k_norm, spec.eps)
    q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, Hq, n, D]
    k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, Hkv, n, D]
    return q, k, v.transpose(1, 2)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, pos: torch.Tensor, bias: torch.Tensor, scaling: float) -> torch.Tensor:
    """Write k / v [B, Hkv, n, D] at ``pos [n]`` of the layer's cache [B, Hkv, M, D], then attend with
    q [B, Hq, n, D] over the whole cache under the additive ``bias [G*n, M]`` (0 = visible, -inf = not).

    The G query heads sharing a KV head are folded into the query length ([B, Hkv, G*n, D]), so the
    cache is read once per KV head and never repeated. CUDA: fused SDPA. CPU: the same arithmetic as
    HF's eager attention (matmul, float32 softmax, matmul), so CPU results match HF bit for bit."""
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)
    return _attend(q, k_cache, v_cache, bias, scaling)


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bias: torch.Tensor, scaling: float
            ) -> torch.Tensor:
    """q [B, Hq, n, D] over caches [B, Hkv, M, D] under ``bias [G*n, M]`` -> [B, Hq, n, D] (see cached_attention)."""
    b, hq, n, d = q.shape
    hkv = k_cache.shape[1]
    qg = q.reshape(b, hkv, (hq // hkv) * n, d)  # [B, Hkv, G*n, D]
    if q.is_cuda:
        out = F.scaled_dot_product_attention(qg, k_cache, v_cache, attn_mask=bias, scale=scaling)
    else:
        scores = torch.matmul(qg, k_cache.transpose(2, 3)) * scaling + bias  # [B, Hkv, G*n, M]
        out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v_cache)
    return out.reshape(b, hq, n, d)


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   pos: torch.Tensor, tree: tuple[torch.Tensor, torch.Tensor], scaling: float) -> torch.Tensor:
    """``cached_attention`` for the rows of a draft tree (``dspark_core.decoding.tree``): k / v are written at
    ``pos + offset``; each row attends, one at a time, to the cache gathered into logical order (keys at
    logical positions >= pos - back read ``offset`` slots further), under its causal mask -- the same
    computation as a one-token step at its position."""
    offset, back = (t.long() for t in tree)
    k_cache.index_copy_(2, pos + offset, k)
    v_cache.index_copy_(2, pos + offset, v)
    group = q.shape[1] // k_cache.shape[1]
    m = k_cache.shape[2]
    keys = torch.arange(m, device=q.device)  # [M] logical key positions
    outs = []
    for t in range(q.shape[2]):
        slots = torch.where(keys >= pos[t] - back[t], keys + offset[t], keys).clamp(max=m - 1)  # [M]
        bias = torch.zeros(1, m, dtype=q.dtype, device=q.device).masked_fill(keys.view(1, m) > pos[t], float("-inf"))
        outs.append(_attend(q[:, :, t : t + 1], k_cache.index_select(2, slots), v_cache.index_select(2, slots),
                            bias.repeat(group, 1), scaling))
    return torch.cat(outs, dim=2)  # [B, Hq, n, D]


def attention_output_and_mlp(x: torch.Tensor, attn: torch.Tensor, w: LayerWeights, spec: _Spec) -> torch.Tensor:
    """Residual stream x [B, n, H] + o_proj(attn [B, Hq, n, D]), then + MLP(post-attention norm)."""
    b, n, _ = x.shape
    x = x + F.linear(attn.transpose(1, 2).reshape(b, n, -1), w.o_w, w.o_b)
    h = rms_norm(x, w.ln2, spec.eps)
    gated = spec.act(F.linear(h, w.gate_w, w.gate_b)) * F.linear(h, w.up_w, w.up_b)  # [B, n, F]
    return x + F.linear(gated, w.down_w, w.down_b)


def make_layer_fn(pre: Callable = attention_inputs, post: Callable = attention_output_and_mlp) -> Callable:
    """One pre-norm decoder layer ``layer(x [B, n, H], w, k_cache, v_cache, cos, sin, pos, bias, spec)``.

    ``pre`` / ``post`` may be torch.compile'd versions of ``attention_inputs`` / ``attention_output_and_mlp``:
    the cache write and the attention stay outside the compiled code (in-place updates of a view of the
    big cache tensor would otherwise be functionalised into copies)."""

    def layer(x, w, k_cache, v_cache, cos, sin, pos, bias, spec):
        q, k, v = pre(x, w, cos, sin, spec)
        attn = cached_attention(q, k, v, k_cache, v_cache, pos, bias, spec.scaling)
        return post(x, attn, w, spec)

    return layer


decoder_layer = make_layer_fn()


def lm_head(x: torch.Tensor, norm_w: torch.Tensor, head_w: torch.Tensor, head_b: torch.Tensor | None,
            spec: _Spec) -> torch.Tensor:
    """Final norm + LM head: x [B, n, H] -> logits [B, n, V]."""
    return F.linear(rms_norm(x, norm_w, spec.eps), head_w, head_b)


def kernel_layers(x: torch.Tensor, layers: Sequence[FusedWeights], k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, spec: _Spec, *,
                  attn_pos: torch.Tensor | None = None, tree: tuple[torch.Tensor, torch.Tensor] | None = None,
                  on_layer: Callable[[int, torch.Tensor], None] | None = None, rows: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """The Triton decode stack (batch 1, n <= 16 rows): ``x [n, H]`` through ``layers``, layer i over the caches
    ``k_cache[i]`` / ``v_cache[i]`` ``[1, Hkv, M, D]`` -> ``[n, H]`` (pre-norm). 6 kernels per layer (module
    docstring). Row t is rotated at ``pos[t]`` and writes its K/V at slot ``pos[t]`` (``+ tree[0][t]``); it attends
    to logical keys ``<= attn_pos[t]`` (default ``pos``), those ``>= attn_pos[t] - tree[1][t]`` read ``tree[0][t]``
    slots further (``kernels.attention.decode_attention``). ``cos`` / ``sin [M, D]`` are the full RoPE tables.
    ``rows [n]``: the tokens of several requests, token t in cache row ``rows[t]`` of caches ``[L, B, Hkv, M, D]``
    (None: row 0). ``on_layer(i, x)`` sees each layer's output."""
    from dspark_core.kernels.attention import decode_attention
    from dspark_core.kernels.linear import fused_linear
    from dspark_core.kernels.rope import qk_norm_rope_cache

    n, eps = x.shape[0], spec.eps
    attn_pos = pos if attn_pos is None else attn_pos
    for i, w in enumerate(layers):
        kc, vc = k_cache[i], v_cache[i]  # [1, Hkv, M, D]
        qkv = fused_linear(x, w.qkv_w, w.qkv_b, norm_weight=w.ln1, eps=eps)  # [n, (Hq + 2 Hkv) D]
        q = qk_norm_rope_cache(qkv, w.q_norm, w.k_norm, cos, sin, pos, kc, vc, spec.num_heads, spec.num_kv_heads,
                               eps, slot_offset=None if tree is None else tree[0], rows=rows)  # [n, Hq, D]
        attn = decode_attention(q, kc, vc, attn_pos, spec.scaling, tree=tree, rows=rows)  # [n, Hq, D]
        x = fused_linear(attn.view(n, -1), w.o_w, w.o_b, residual=x)  # [n, H]
        h = fused_linear(x, w.gate_up_w, w.gate_up_b, norm_weight=w.ln2, eps=eps, gated=True)  # [n, F]
        x = fused_linear(h, w.down_w, w.down_b, residual=x)  # [n, H]
        if on_layer is not None:
            on_layer(i, x)
    return x


def kernel_head(x: torch.Tensor, norm_w: torch.Tensor, head_w: torch.Tensor, head_b: torch.Tensor | None,
                spec: _Spec) -> torch.Tensor:
    """Final norm + LM head in one Triton product: x [n, H] -> logits [n, V]."""
    from dspark_core.kernels.linear import fused_linear

    return fused_linear(x, head_w, head_b, norm_weight=norm_w, eps=spec.eps)


def model_spec(model: torch.nn.Module) -> _Spec:
    """The static facts of an HF Qwen3 / Qwen2 / Llama causal LM's decoder layers."""
    cfg, body = model.config, model.model
    attn0 = body.layers[0].self_attn
    return _Spec(int(cfg.num_attention_heads), int(cfg.num_key_value_heads), int(attn0.head_dim),
                 float(body.norm.variance_epsilon), float(attn0.scaling), body.layers[0].mlp.act_fn)


def rope_tables(model: torch.nn.Module, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[length, D]`` of positions ``0 .. length-1`` in the model dtype, as HF applies them."""
    first = next(model.parameters())
    with torch.no_grad():
        positions = torch.arange(length, device=first.device).unsqueeze(0)  # [1, M]
        probe = torch.zeros(1, dtype=first.dtype, device=first.device)
        cos, sin = model.model.rotary_emb(probe, positions)  # [1, M, D]
    return cos[0].contiguous(), sin[0].contiguous()


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    ids: torch.Tensor  # [B, n] static input
    pos: torch.Tensor  # [n] static input
    logits: torch.Tensor  # [B, n, V] static output
    aux: torch.Tensor  # [B, n, K, H] static output


@dataclass(frozen=True)
class _Path:
    """How a forward is computed: the layer and head functions, eager or compiled, and the layer's two halves
    around the attention (``pre`` / ``post``: what a step of several request rows composes with its own
    attention, :meth:`TargetRunner.step_rows`)."""

    layer_fn: Callable[..., torch.Tensor]
    head_fn: Callable[..., torch.Tensor]
    pre_fn: Callable[..., Any] = attention_inputs
    post_fn: Callable[..., torch.Tensor] = attention_output_and_mlp


class FusedWeights(NamedTuple):
    """One decoder layer for the Triton step: Q/K/V and gate/up concatenated along the output rows."""

    ln1: torch.Tensor
    qkv_w: torch.Tensor  # [(Hq + 2 Hkv) D, H]
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    ln2: torch.Tensor
    gate_up_w: torch.Tensor  # [2F, H]
    gate_up_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None


def _concat_rows(modules: Sequence[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the modules' weights (and biases) along the output rows, then re-point each module's
    parameters to its view of the concatenation (same values; the separate copies are freed)."""
    weight = torch.cat([m.weight.detach() for m in modules])
    has_bias = [m.bias is not None for m in modules]
    if any(has_bias) and not all(has_bias):
        names = ", ".join(type(m).__name__ for m in modules)
        raise ValueError(f"fused projections need biases on all or none of {names}")
    bias = torch.cat([m.bias.detach() for m in modules]) if all(has_bias) else None
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight.data = weight[start : start + rows]
        if bias is not None:
            m.bias.data = bias[start : start + rows]
        start += rows
    return weight, bias


_FUSED: "weakref.WeakKeyDictionary[torch.nn.Module, FusedWeights]" = weakref.WeakKeyDictionary()


def fuse_layer(layer: torch.nn.Module) -> FusedWeights:
    """A decoder layer (HF, or a DSpark draft layer: the same module names) for the Triton step; its Q/K/V and
    gate/up weights are re-pointed to views of the concatenations (``_concat_rows``). A layer fused before whose
    modules still point into the concatenations gets the same ``FusedWeights`` back (no second copy: the AR
    runner and the DMTD decoder of one model share them)."""
    known = _FUSED.get(layer)
    if known is not None and _still_fused(layer, known):
        return known
    _FUSED[layer] = fused = _fuse(layer)
    return fused


def _still_fused(layer: torch.nn.Module, w: FusedWeights) -> bool:
    return (layer.self_attn.q_proj.weight.data_ptr() == w.qkv_w.data_ptr()
            and layer.mlp.gate_proj.weight.data_ptr() == w.gate_up_w.data_ptr())


def _fuse(layer: torch.nn.Module) -> FusedWeights:
    attn, mlp = layer.self_attn, layer.mlp
    qkv_w, qkv_b = _concat_rows([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up_w, gate_up_b = _concat_rows([mlp.gate_proj, mlp.up_proj])
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return FusedWeights(layer.input_layernorm.weight, qkv_w, qkv_b, None if q_norm is None else q_norm.weight,
                        None if k_norm is None else k_norm.weight, attn.o_proj.weight, attn.o_proj.bias,
                        layer.post_attention_layernorm.weight, gate_up_w, gate_up_b, mlp.down_proj.weight,
                        mlp.down_proj.bias)


class TargetRunner:
    """Static-KV-cache forward of an HF Qwen3 / Qwen2 / Llama causal LM (see module docstring)."""

    def __init__(self, model: torch.nn.Module, *, max_len: int, aux_layer_ids: Sequence[int] = (),
                 batch_size: int = 1, compile: bool = False, cuda_graph: bool = False,
                 graph_max_tokens: int = 16, kernels: bool = False) -> None:
        cfg = model.config
        _check_supported(model)
        self.model = model  # keeps the weights alive; never modified
        self.config = cfg
        self.num_layers = int(cfg.num_hidden_layers)
        self.aux_layer_ids = _check_aux_ids(aux_layer_ids, self.num_layers)
        if max_len < 1 or batch_size < 1 or graph_max_tokens < 1:
            raise ValueError(f"max_len, batch_size and graph_max_tokens must be >= 1; got {max_len}, "
                             f"{batch_size}, {graph_max_tokens}")
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        if cuda_graph and self.device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs the model on a CUDA device; it is on {self.device}")
        self.max_len, self.batch_size = int(max_len), int(batch_size)
        self.length = 0
        self.kernels = bool(kernels)
        if self.kernels:
            _check_kernels(model)
            from dspark_core.kernels.linear import resolve_small_gemm

            resolve_small_gemm(next(model.parameters()).device)  # mma where it applies, else fma (says why)
            self._fused = self._fuse_weights(model)  # before _init_weights: it re-points the HF weights
        self._init_weights(model)
        self._init_cache()
        self._eager = _Path(decoder_layer, lm_head)  # the prompt (any length)
        self._fast = self._eager  # decode / verify chunks (graph-captured on CUDA)
        if compile:
            pre, post = _compiled(attention_inputs), _compiled(attention_output_and_mlp)
            self._fast = _Path(make_layer_fn(pre, post), _compiled(lm_head), pre, post)
        self.cuda_graph = cuda_graph
        self.graph_max_tokens = int(graph_max_tokens)
        self._graphs: dict[int, _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if cuda_graph else None

    # -- construction -----------------------------------------------------------------------
    def _init_weights(self, model: torch.nn.Module) -> None:
        body = model.model
        attn0 = body.layers[0].self_attn
        cfg = self.config
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(attn0.head_dim)
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(model.lm_head.weight.shape[0])
        self._spec = model_spec(model)
        self._layers = [_layer_weights(layer) for layer in body.layers]
        self._embed_w = body.embed_tokens.weight  # [V, H]
        self._norm_w = body.norm.weight  # [H]
        self._head_w, self._head_b = model.lm_head.weight, model.lm_head.bias  # [V, H], [V] | None
        # The cache is allocated to a multiple of 16 positions (aligned rows for the fused attention kernels);
        # positions >= max_len are never written and always masked.
        self._alloc_len = -(-self.max_len // 16) * 16
        self._cos, self._sin = rope_tables(model, self._alloc_len)  # [M, D]
        self._key_pos = torch.arange(self._alloc_len, device=self.device)  # [M]

    @staticmethod
    def _fuse_weights(model: torch.nn.Module) -> list[FusedWeights]:
        return [fuse_layer(layer) for layer in model.model.layers]

    def _init_cache(self) -> None:
        shape = (self.num_layers, self.batch_size, self.num_kv_heads, self._alloc_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)  # [L, B, Hkv, M, D]
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)  # [L, B, Hkv, M, D]

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: str | torch.dtype = "float32", device: str = "cpu",
                        **kwargs: Any) -> "TargetRunner":
        """Load a local HF dir (``dspark_core.target.load_target``) and wrap it."""
        from dspark_core.target import load_target

        model, _ = load_target(path, dtype=dtype, device=device)
        return cls(model, **kwargs)

    # -- public API -------------------------------------------------------------------------
    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V caches ``[L, B, Hkv, M, D]``, for kernels that move cache slots in place."""
        return self.k_cache, self.v_cache

    def reset(self) -> None:
        self.length = 0

    def truncate(self, length: int) -> None:
        """Roll the cache back to ``length`` positions (0 <= length <= current length)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate length must be in [0, {self.length}]; got {length}")
        self.length = int(length)

    def commit(self, length: int) -> None:
        """Set the host length to ``length`` (0 <= length <= max_len) after :meth:`step` calls, which write the
        cache at device positions without moving it: positions below ``length`` must hold the committed tokens."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"commit length must be in [0, {self.max_len}]; got {length}")
        self.length = int(length)

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V at cache slots ``src [E]`` to slots ``dst [E]`` (int64 device tensors; all
        sources are gathered before any destination is written, so a slot may be both)."""
        for cache in self.caches:  # [L, B, Hkv, M, D]
            cache.index_copy_(3, dst, cache.index_select(3, src))

    def step(self, ids: torch.Tensor, pos: torch.Tensor, *, tree: tuple[torch.Tensor, torch.Tensor] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward ``ids [B, n]`` at positions ``pos [n]`` (a device tensor) -> ``logits [B, n, V]``,
        ``aux [B, n, K, H]``, with no host sync and no change of the host length (see :meth:`commit`): the
        step CUDA-graph-captured engines replay. ``tree = (offset [n], back [n])``: the rows are a draft
        tree's (``dspark_core.decoding.tree``): row t at logical position pos[t], written to slot
        pos[t] + offset[t], attending to its ancestors only (batch 1)."""
        return self._step(ids, pos, tree=tree)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, *, last_logits_only: bool = False,
                chunk_tokens: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
        """Reset and process the prompt ``ids [B, n]`` (eager, in chunks of ``chunk_tokens``).

        Returns ``logits [B, n, V]`` (``[B, 1, V]`` with ``last_logits_only``) and ``aux [B, n, K, H]``."""
        ids = self._check_ids(ids, reset=True)
        self.reset()
        logits_parts, aux_parts = [], []
        n = ids.shape[1]
        for start in range(0, n, chunk_tokens):
            final = start + chunk_tokens >= n
            head = "last" if (last_logits_only and final) else ("none" if last_logits_only else "all")
            logits, aux = self._run_eager(ids[:, start : start + chunk_tokens], head=head, path=self._eager,
                                          kernels=False)
            if logits is not None:
                logits_parts.append(logits)
            aux_parts.append(aux)
        return torch.cat(logits_parts, dim=1), torch.cat(aux_parts, dim=1)

    @torch.no_grad()
    def prefill_row(self, row: int, ids: torch.Tensor, *, chunk_tokens: int = 2048
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Process the prompt ``ids [1, n]`` into request row ``row`` of the cache (positions 0 .. n-1; the other
        rows untouched, the host length too) -> the last logits ``[1, 1, V]`` and ``aux [1, n, K, H]``.
        Eager, in chunks of ``chunk_tokens``: what a batched engine runs when a request takes a free row."""
        if not 0 <= row < self.batch_size:
            raise ValueError(f"row must be in [0, {self.batch_size}); got {row}")
        if ids.dim() != 2 or ids.shape[0] != 1 or not 1 <= ids.shape[1] <= self.max_len:
            raise ValueError(f"ids must have shape [1, n] with 1 <= n <= max_len={self.max_len}; got {tuple(ids.shape)}")
        ids = ids.to(self.device, torch.long)
        caches = (self.k_cache[:, row : row + 1], self.v_cache[:, row : row + 1])  # [L, 1, Hkv, M, D] views
        n, logits, aux_parts = ids.shape[1], None, []
        for start in range(0, n, chunk_tokens):
            final = start + chunk_tokens >= n
            pos = self._key_pos[start : min(start + chunk_tokens, n)]  # [n_chunk]
            logits, aux = self._step(ids[:, start : start + chunk_tokens], pos, head="last" if final else "none",
                                     path=self._eager, kernels=False, caches=caches)
            aux_parts.append(aux)
        return logits, torch.cat(aux_parts, dim=1)

    def step_rows(self, ids: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, cols: torch.Tensor, width: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward T tokens of several request rows in one step, with no host sync and static shapes (what a
        batched engine captures in a CUDA graph): token t is the ``cols[t]``-th of row ``rows[t]``'s tokens in
        this step (< ``width``, the most any row has), at position ``pos[t]``, attending to that row's cache at
        positions <= ``pos[t]`` (its own K/V written first). ``ids``, ``rows``, ``pos``, ``cols`` are [T] device
        tensors; a token may repeat another's (row, position) with the same id (padding: the same K/V written
        twice). -> ``logits [T, V]``, ``aux [T, K, H]``. One row (``batch_size`` 1) with the Triton kernels runs
        their step; otherwise the torch step (``_rows_torch``)."""
        if self.kernels:
            return self._kernel_rows(ids, rows, pos)
        return self._rows_torch(ids, rows, pos, cols, width)

    def _kernel_rows(self, ids: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``step_rows`` through the Triton decode kernels: every token computed as in a one-token step of its own
        row (batch-invariant mode: the same bits at any concurrency; products of more than 16 tokens in token
        tiles, ``kernels.linear``)."""
        x = F.embedding(ids, self._embed_w)  # [T, H]
        collected: dict[int, torch.Tensor] = {-1: x} if -1 in self.aux_layer_ids else {}

        def keep(layer: int, h: torch.Tensor) -> None:
            if layer in self.aux_layer_ids:
                collected[layer] = h

        one_row = self.batch_size == 1
        x = kernel_layers(x, self._fused, self.k_cache, self.v_cache, self._cos, self._sin, pos, self._spec,
                          on_layer=keep, rows=None if one_row else rows)  # [T, H]
        aux = self._stack_aux({k: v.unsqueeze(0) for k, v in collected.items()}, x.unsqueeze(0))[0]  # [T, K, H]
        return kernel_head(x, self._norm_w, self._head_w, self._head_b, self._spec), aux

    def _rows_torch(self, ids: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, cols: torch.Tensor, width: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``step_rows`` in torch: the products over the flat [T] tokens, the attention in a padded
        [B, width] layout per row (``_rows_attention``)."""
        path, spec = self._fast, self._spec
        x = F.embedding(ids, self._embed_w).unsqueeze(0)  # [1, T, H]
        cos, sin = self._cos.index_select(0, pos), self._sin.index_select(0, pos)  # [T, D]
        slot = rows * width + cols  # [T] place in the padded layout
        bias = self._rows_bias(slot, pos, width, x.dtype)  # [B, 1, G*W, M]
        collected: dict[int, torch.Tensor] = {-1: x} if -1 in self.aux_layer_ids else {}
        for layer, w in enumerate(self._layers):
            q, k, v = path.pre_fn(x, w, cos, sin, spec)  # [1, Hq, T, D], [1, Hkv, T, D] x 2
            attn = self._rows_attention(q[0], k[0], v[0], layer, rows, pos, slot, width, bias)  # [1, Hq, T, D]
            x = path.post_fn(x, attn, w, spec)
            if layer in self.aux_layer_ids:
                collected[layer] = x
        aux = self._stack_aux(collected, x)[0]  # [T, K, H]
        return path.head_fn(x, self._norm_w, self._head_w, self._head_b, spec)[0], aux

    def _rows_bias(self, slot: torch.Tensor, pos: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask ``[B, 1, G*W, M]`` of the padded layout: a token's place sees keys <= its position; an
        empty place sees key 0 only (its output is never read; no row may be fully masked)."""
        m, b = self._alloc_len, self.batch_size
        visible = self._key_pos.unsqueeze(0) <= pos.unsqueeze(1)  # [T, M]
        tok = torch.zeros(visible.shape, dtype=dtype, device=self.device).masked_fill(~visible, float("-inf"))
        bias = torch.full((b * width, m), float("-inf"), dtype=dtype, device=self.device)
        bias[:, 0] = 0.0
        bias.index_copy_(0, slot, tok)  # [B*W, M]
        group = self.num_heads // self.num_kv_heads
        return bias.view(b, width, m).repeat(1, group, 1).unsqueeze(1)  # [B, 1, G*W, M], rows in (g, w) order

    def _rows_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, rows: torch.Tensor,
                        pos: torch.Tensor, slot: torch.Tensor, width: int, bias: torch.Tensor) -> torch.Tensor:
        """q [Hq, T, D], k / v [Hkv, T, D] of the step's tokens: K/V written at (row, position) of the layer's
        cache, then each row's queries in a padded [B, width] layout over its own cache -> [1, Hq, T, D]."""
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]  # [B, Hkv, M, D]
        k_cache[rows, :, pos] = k.transpose(0, 1)  # [T, Hkv, D]
        v_cache[rows, :, pos] = v.transpose(0, 1)
        hq, t, d = q.shape
        b = self.batch_size
        padded = q.new_zeros(b * width, hq, d).index_copy_(0, slot, q.transpose(0, 1))  # [B*W, Hq, D]
        padded = padded.view(b, width, hq, d).transpose(1, 2)  # [B, Hq, W, D]
        out = _attend(padded, k_cache, v_cache, bias, self._spec.scaling)  # [B, Hq, W, D]
        out = out.transpose(1, 2).reshape(b * width, hq, d).index_select(0, slot)  # [T, Hq, D]
        return out.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``ids [B, n]`` at the current length -> ``logits [B, n, V]``, ``aux [B, n, K, H]``."""
        ids = self._check_ids(ids)
        n = ids.shape[1]
        if self.cuda_graph and n <= self.graph_max_tokens:
            graph = self._graphs.get(n) or self._capture(n)
            graph.ids.copy_(ids)
            torch.add(self._key_pos[:n], self.length, out=graph.pos)
            graph.graph.replay()
            self.length += n
            return graph.logits, graph.aux
        return self._run_eager(ids, head="all", path=self._fast, kernels=self.kernels)

    __call__ = forward

    # -- internals ---------------------------------------------------------------------------
    def _check_ids(self, ids: torch.Tensor, reset: bool = False) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[0] != self.batch_size or ids.shape[1] < 1:
            raise ValueError(f"ids must have shape [{self.batch_size}, n >= 1]; got {tuple(ids.shape)}")
        start = 0 if reset else self.length
        if start + ids.shape[1] > self.max_len:
            raise ValueError(f"{start} cached + {ids.shape[1]} new tokens exceed the target cache's "
                             f"max_len={self.max_len}; build the TargetRunner with a larger max_len")
        return ids.to(self.device, torch.long)

    def _run_eager(self, ids: torch.Tensor, *, head: str, path: _Path, kernels: bool
                   ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Run without a CUDA graph (the prompt, or chunks longer than ``graph_max_tokens``)."""
        n = ids.shape[1]
        pos = self._key_pos[self.length : self.length + n]  # [n]
        logits, aux = self._step(ids, pos, head=head, path=path, kernels=kernels)
        self.length += n
        return logits, aux

    def _step(self, ids: torch.Tensor, pos: torch.Tensor, *, head: str = "all", path: _Path | None = None,
              kernels: bool | None = None, tree: tuple[torch.Tensor, torch.Tensor] | None = None,
              caches: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The sync-free forward of ``ids [B, n]`` at positions ``pos [n]`` (a device tensor).

        ``head``: "all" (logits for every position), "last" (only the last) or "none". ``tree = (offset [n],
        back [n])``: the rows are a draft tree's (``dspark_core.decoding.tree``): row t at logical position pos[t],
        written to slot pos[t] + offset[t], attending to its ancestors only (batch 1). ``caches`` (the torch path):
        K / V caches ``[L, B, Hkv, M, D]`` other than the runner's own (a view of one request row's, prefill_row)."""
        kernels = self.kernels if kernels is None else kernels  # graph capture: the runner's choice
        if kernels and ids.shape[1] <= self._kernel_max_tokens():
            return self._kernel_step(ids, pos, head=head, tree=tree)
        if tree is not None:
            return self._tree_step(ids, pos, tree, head)
        path = path or self._fast
        group = self.num_heads // self.num_kv_heads
        x = F.embedding(ids, self._embed_w)  # [B, n, H]
        visible = self._key_pos.unsqueeze(0) <= pos.unsqueeze(1)  # [n, M] causal on absolute positions
        bias = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill(~visible, float("-inf"))
        bias = bias.repeat(group, 1)  # [G*n, M], rows in the folded (group, position) order
        cos, sin = self._cos.index_select(0, pos), self._sin.index_select(0, pos)  # [n, D]
        k_cache, v_cache = caches if caches is not None else self.caches  # [L, B, Hkv, M, D]
        collected: dict[int, torch.Tensor] = {-1: x} if -1 in self.aux_layer_ids else {}
        for layer, w in enumerate(self._layers):
            x = path.layer_fn(x, w, k_cache[layer], v_cache[layer], cos, sin, pos, bias, self._spec)
            if layer in self.aux_layer_ids:
                collected[layer] = x
        aux = self._stack_aux(collected, x)  # [B, n, K, H]
        if head == "none":
            return None, aux
        rows = x[:, -1:] if head == "last" else x
        return path.head_fn(rows, self._norm_w, self._head_w, self._head_b, self._spec), aux

    def _tree_step(self, ids: torch.Tensor, pos: torch.Tensor, tree: tuple[torch.Tensor, torch.Tensor], head: str
                   ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The torch path of a tree step (eager, one attention per row: a reference, not a fast path)."""
        if ids.shape[0] != 1:
            raise ValueError(f"a draft tree step takes batch 1; got ids {tuple(ids.shape)}")
        spec = self._spec
        x = F.embedding(ids, self._embed_w)  # [1, n, H]
        cos, sin = self._cos.index_select(0, pos), self._sin.index_select(0, pos)  # [n, D]
        collected: dict[int, torch.Tensor] = {-1: x} if -1 in self.aux_layer_ids else {}
        for layer, w in enumerate(self._layers):
            q, k, v = attention_inputs(x, w, cos, sin, spec)
            attn = tree_attention(q, k, v, self.k_cache[layer], self.v_cache[layer], pos, tree, spec.scaling)
            x = attention_output_and_mlp(x, attn, w, spec)
            if layer in self.aux_layer_ids:
                collected[layer] = x
        aux = self._stack_aux(collected, x)  # [1, n, K, H]
        if head == "none":
            return None, aux
        rows = x[:, -1:] if head == "last" else x
        return lm_head(rows, self._norm_w, self._head_w, self._head_b, spec), aux

    @staticmethod
    def _kernel_max_tokens() -> int:
        from dspark_core.kernels.linear import MAX_TOKENS

        return MAX_TOKENS

    def _kernel_step(self, ids: torch.Tensor, pos: torch.Tensor, *, head: str = "all",
                     tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The Triton path of :meth:`_step` (batch 1, n <= 16 tokens; see the module docstring)."""
        x = F.embedding(ids[0], self._embed_w)  # [n, H]
        collected: dict[int, torch.Tensor] = {-1: x} if -1 in self.aux_layer_ids else {}

        def keep(layer: int, h: torch.Tensor) -> None:
            if layer in self.aux_layer_ids:
                collected[layer] = h

        x = kernel_layers(x, self._fused, self.k_cache, self.v_cache, self._cos, self._sin, pos, self._spec,
                          tree=tree, on_layer=keep)  # [n, H]
        aux = self._stack_aux({k: v.unsqueeze(0) for k, v in collected.items()}, x.unsqueeze(0))  # [1, n, K, H]
        if head == "none":
            return None, aux
        rows = x[-1:] if head == "last" else x
        logits = kernel_head(rows, self._norm_w, self._head_w, self._head_b, self._spec)  # [n, V]
        return logits.unsqueeze(0), aux

    def _stack_aux(self, collected: dict[int, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if not self.aux_layer_ids:
            return x.new_empty(*x.shape[:2], 0, x.shape[-1])
        return torch.stack([collected[i] for i in self.aux_layer_ids], dim=2)

    def _capture(self, n: int) -> _Graph:
        """Capture the forward of ``n`` tokens as a CUDA graph (warm-up on a side stream first).

        The warm-up writes K/V at positions >= length, which the replay that follows overwrites."""
        ids = torch.zeros(self.batch_size, n, dtype=torch.long, device=self.device)  # [B, n]
        pos = (self._key_pos[:n] + self.length).clone()  # [n]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                self._step(ids, pos)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, aux = self._step(ids, pos)
        self._graphs[n] = _Graph(graph, ids, pos, logits, aux)
        return self._graphs[n]


def _compiled(fn: Callable) -> Callable:
    """``torch.compile`` with static shapes: one graph per chunk length, shared by all layers (weights are inputs)."""
    return torch.compile(fn, dynamic=False, fullgraph=True)


def _check_supported(model: torch.nn.Module) -> None:
    cfg = model.config
    mt = getattr(cfg, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"target model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise UserError(f"target config layer_types {sorted(set(layer_types))}: sliding-window layers are not "
                        "supported by the static-cache runner; choose another target (target.path)")
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type in _UNSUPPORTED_ROPE:
        raise UserError(f"target config rope_type {rope_type!r} is not supported (its table depends on the "
                        "sequence length); choose another target (target.path)")


def kernels_problem(model: torch.nn.Module) -> str | None:
    """Why ``kernels=True`` does not apply to ``model`` (None when it does), at any number of request rows."""
    from dspark_core.kernels import triton_ok

    device = next(model.parameters()).device
    attn0, mlp0 = model.model.layers[0].self_attn, model.model.layers[0].mlp
    head_dim = int(attn0.head_dim)
    act = getattr(model.config, "hidden_act", "silu")
    problems = []
    if not triton_ok(device):
        problems.append(f"Triton cannot run on {device}")
    if head_dim & (head_dim - 1) or head_dim < 16:
        problems.append(f"head_dim {head_dim} is not a power of two >= 16")
    if act not in ("silu", "swish"):
        problems.append(f"hidden_act {act!r} is not SiLU")
    act_fn = getattr(mlp0, "act_fn", None)
    if not isinstance(act_fn, torch.nn.SiLU) and "SiLU" not in type(act_fn).__name__:
        problems.append(f"the MLP's act_fn is {type(act_fn).__name__}, not SiLU")
    return "; ".join(problems) if problems else None


def _check_kernels(model: torch.nn.Module) -> None:
    """Refuse ``kernels=True`` where the Triton step does not apply (with the reason)."""
    problem = kernels_problem(model)
    if problem:
        raise ValueError("TargetRunner(kernels=True) does not apply: " + problem)


def _check_aux_ids(aux_layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    ids = tuple(int(i) for i in aux_layer_ids)
    if len(set(ids)) != len(ids):
        raise ValueError(f"aux_layer_ids has duplicates: {list(ids)}")
    for i in ids:
        if not -1 <= i < num_layers - 1:
            raise ValueError(f"aux_layer_ids: {i} is not in [-1, {num_layers - 2}] (the final layer "
                             f"{num_layers - 1} is refused: its HF hidden state is the normalised one)")
    return ids
