"""Split-KV attention of the decode step over the static cache (flash-decoding): ``_attn_split`` sums each
(kv head, split of the keys, token) apart, ``_attn_combine`` merges the splits. One token per program, so the
result of a token does not depend on how many tokens the step has, nor on which other requests' tokens share
it (batch-invariant). The cache holds R request rows; each token reads its own row's keys.

Shape legend: n tokens of the step, Hq / Hkv heads, G = Hq / Hkv, D head dim, R cache rows, M cache positions,
S splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark_core.kernels.pdl import _LAUNCH, PDL, PDL_PREFETCH, gdc_launch_dependents, gdc_wait
from dspark_core.kernels.rope import check_rows


# Splits past a token's keys write nothing and the combine reads only the live ones. The split count follows the
# cache size (static, for CUDA graphs), not the context: at bench_online's max_len 2048 a 300-token context
# leaves 27 of 32 splits empty per (kv head, token). False writes and reads every split: the same bits (the
# kernel tests compare the two).
ATTN_LIVE_SPLITS = True


@triton.jit
def _attn_split(Q, KC, VC, POS, OFF, BACK, CROWS, OP, MP, LP, M_ALLOC, split_len, scale, G: tl.constexpr,
                HKV: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, NS_P: tl.constexpr, BLOCK: tl.constexpr,
                IEEE: tl.constexpr, TREE: tl.constexpr, HAS_ROWS: tl.constexpr, LIVE: tl.constexpr,
                PDL_ON: tl.constexpr, EARLY: tl.constexpr):
    """Program (token t, split s, kv head h): the G query heads of token t over keys
    [s * split_len, +split_len) of cache row CROWS[t] (0 without HAS_ROWS) that t may see (<= its position).
    One token per program: batch-invariant.
    Grid (n, S, Hkv), the token fastest: the tokens of one request (consecutive in the step) that read the same
    (kv head, split) of the same cache row are adjacent program ids, scheduled together, so a verify's tokens read
    those keys from DRAM once and from L2 after; the order never changes what a program sums.
    TREE: the keys are logical positions; those >= POS[t] - BACK[t] are read OFF[t] slots further (a draft
    tree's branch rows, ``dspark_core.decoding.tree``), so the sums run in the same order as without a tree.
    LIVE: a split past the token's keys writes nothing (``ATTN_LIVE_SPLITS``).
    EARLY: the next kernel may launch first thing (``PDL_PREFETCH``)."""
    if PDL_ON and EARLY:
        gdc_launch_dependents()
    if PDL_ON:
        gdc_wait()  # the previous kernel's outputs are complete and visible after this
    t = tl.program_id(0)
    s = tl.program_id(1)
    h = tl.program_id(2)
    g = tl.arange(0, ROWS)  # query head h * G + g
    gvalid = g < G
    last = tl.load(POS + t) + 1  # token t sees keys [0, last)
    d = tl.arange(0, D)
    q = tl.load(Q + ((t * HKV * G + h * G + g) * D)[:, None] + d[None, :], mask=gvalid[:, None], other=0.0)
    start = s * split_len
    end = tl.minimum(start + split_len, last)
    m_i = tl.full([ROWS], -1.0e30, tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    cache_row = 0
    if HAS_ROWS:
        cache_row = tl.load(CROWS + t).to(tl.int64)
    base = (cache_row * HKV + h.to(tl.int64)) * M_ALLOC * D
    if TREE:
        off = tl.load(OFF + t)
        branch = last - 1 - tl.load(BACK + t)  # the first logical key read at + off
    for m0 in range(start, end, BLOCK):
        km = m0 + tl.arange(0, BLOCK)
        kmask = km < end
        slot = km
        if TREE:
            slot = tl.where(km >= branch, km + off, km)
        k = tl.load(KC + base + slot[:, None].to(tl.int64) * D + d[None, :], mask=kmask[:, None], other=0.0)
        if IEEE:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [ROWS, BLOCK]
        else:
            sc = tl.dot(q, tl.trans(k)) * scale
        sc = tl.where(kmask[None, :], sc, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.where(kmask[None, :], tl.exp(sc - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VC + base + slot[:, None].to(tl.int64) * D + d[None, :], mask=kmask[:, None], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if PDL_ON and not EARLY:
        gdc_launch_dependents()  # let the next kernel launch while this one finishes
    idx = ((t * HKV + h) * NS_P + s) * ROWS + g
    write = start < last  # the split holds some of the token's keys
    if not LIVE:
        write = start >= 0  # every split writes its partials (an empty one: m -1e30, l 0, acc 0)
    if write:
        tl.store(MP + idx, m_i)
        tl.store(LP + idx, l_i)
        tl.store(OP + idx[:, None] * D + d[None, :], acc)


@triton.jit
def _attn_combine(OP, MP, LP, POS, OUT, NS, split_len, NS_P: tl.constexpr, G: tl.constexpr, HKV: tl.constexpr,
                  D: tl.constexpr, ROWS: tl.constexpr, LIVE: tl.constexpr, PDL_ON: tl.constexpr, EARLY: tl.constexpr):
    """Program (query head row r = t * G + g, kv head h): merges token t's splits for query head h * G + g.
    LIVE: only the splits holding some of the token's keys are read (``ATTN_LIVE_SPLITS``); a masked-out slot
    reads as what an empty split would have written (m -1e30, l 0, o 0), so the sums are the same bits.
    EARLY: the next kernel (a product, prefetching its weights) may launch first thing (``PDL_PREFETCH``)."""
    if PDL_ON and EARLY:
        gdc_launch_dependents()
    if PDL_ON:
        gdc_wait()  # the previous kernel's outputs are complete and visible after this
    r = tl.program_id(0)
    h = tl.program_id(1)
    t = r // G
    g = r % G
    s = tl.arange(0, NS_P)
    ns = NS
    if LIVE:
        ns = tl.minimum(ns, (tl.load(POS + t) + split_len) // split_len)  # splits with keys <= POS[t]
    smask = s < ns
    idx = ((t * HKV + h) * NS_P + s) * ROWS + g
    m = tl.load(MP + idx, mask=smask, other=-1.0e30)
    l_s = tl.load(LP + idx, mask=smask, other=0.0)
    mx = tl.max(m, 0)
    w = tl.exp(m - mx) * (l_s > 0)
    d = tl.arange(0, D)
    o = tl.load(OP + idx[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)  # [NS_P, D]
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w * l_s, 0)
    tl.store(OUT + (t * HKV * G + h * G + g) * D + d, out.to(OUT.dtype.element_ty))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     scale: float, block: int = 64, tree: tuple[torch.Tensor, torch.Tensor] | None = None,
                     rows: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, Hq, D] at positions ``pos [n]`` (device) over the layer's caches [R, Hkv, M, D] (contiguous) ->
    [n, Hq, D]: token t attends to the keys <= pos[t] of cache row ``rows[t]`` (``rows [n]`` int32 / int64 on the
    device; None: row 0). Split-KV: (n x S x Hkv) programs, then a combine.
    ``tree = (offset [n], back [n])`` int32: token t reads logical keys >= pos[t] - back[t] at + offset[t]."""
    n, hq, d = q.shape
    check_rows(rows, n, k_cache, v_cache)
    hkv, m_alloc = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    heads = max(16, triton.next_power_of_2(g))  # the MMA's query rows (G heads, padded)
    splits = max(1, min(64, triton.cdiv(m_alloc, 64)))  # ~64 keys per program: latency, not bandwidth, rules
    split_len = triton.cdiv(triton.cdiv(m_alloc, splits), block) * block
    splits = triton.cdiv(m_alloc, split_len)
    ns_p = triton.next_power_of_2(splits)
    op = torch.empty(n, hkv, ns_p, heads, d, device=q.device, dtype=torch.float32)
    mp = torch.empty(n, hkv, ns_p, heads, device=q.device, dtype=torch.float32)
    lp = torch.empty_like(mp)
    off, back = tree if tree is not None else (pos, pos)
    # token fastest: a request's tokens reading the same (split, kv head) are adjacent programs (see _attn_split)
    _attn_split[(n, splits, hkv)](q, k_cache, v_cache, pos, off, back, pos if rows is None else rows, op, mp, lp,
                                  m_alloc, split_len, scale, G=g, HKV=hkv, D=d, ROWS=heads, NS_P=ns_p, BLOCK=block,
                                  IEEE=q.dtype == torch.float32, TREE=tree is not None, HAS_ROWS=rows is not None,
                                  LIVE=ATTN_LIVE_SPLITS, PDL_ON=PDL, EARLY=PDL_PREFETCH, num_warps=4, **_LAUNCH)
    out = torch.empty_like(q)
    _attn_combine[(n * g, hkv)](op, mp, lp, pos, out, splits, split_len, NS_P=ns_p, G=g, HKV=hkv, D=d, ROWS=heads,
                                LIVE=ATTN_LIVE_SPLITS, PDL_ON=PDL, EARLY=PDL_PREFETCH, num_warps=1, **_LAUNCH)
    return out
