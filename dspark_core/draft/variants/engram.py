"""The Engram variants of seed 000: a hashed multi-head n-gram table and the three drafts that read it.

Shape legend: B batch, L tokens, A anchors, S slots (block_size), P looked-up positions, G n-gram tokens
(max order), nh hash heads, H draft hidden, Ht target hidden, r Markov rank, V vocab.

The lookup (in the style of DeepSeek's Engram) maps the prefix ending at position t to a raw feature
``e_t [H]``: for every n-gram order n and each of its hash heads k, the n tokens ending at t are hashed
``(sum_j (x_{t-j} + 1) * mult[k, j]) mod prime_k`` into a table of ``prime_k`` rows; the rows of all heads
are concatenated (widths add up to H). An order whose n-gram would start before the sequence reads zeros,
and a position < 0 (no predecessor) reads zeros altogether. Lookup is by token ids only, so training
computes features on the fly from the cached ``input_ids``.

Variants (``draft.kind``), each the baseline plus one hook, nothing of it copied into the baseline:

- ``engram_markov`` (hook ``markov_features``): ``m_i = W1[t_{i-1}] + g_i v_i`` with
  ``q = N(W_Q N(h_i))``, ``k = N(W_K N(e_{i-1}))``, ``v = W_V N(e_{i-1})``, ``s = q.k / sqrt(r)``,
  ``g = sigmoid(sign(s) sqrt(max(|s|, 1e-6)))``; N = RMSNorm without affine; W_V zero-initialised, so the
  initial output is vanilla Markov. ``e_{i-1}`` is the feature of the prefix ending at ``t_{i-1}``:
  the reference token in training, the token actually chosen in the block at inference.
- ``engram_mask_gated`` (hook ``block_inputs``): slot j >= 1 input ``E(MASK) + tanh(theta_j) z_a``,
  ``z_a = N(P e_{a-1})``, theta zero-initialised (initial forward = baseline).
- ``engram_mask_replace`` (hook ``block_inputs``): slots 1..S-1 are ``z_a``; the anchor keeps its embedding.

``extras`` (what the hooks read): ``input_ids [B, L]`` and ``anchors [B, A]`` -- the training batch itself,
or at inference the trailing ``token_history`` tokens through the anchor and the anchor's index in them,
which the engine passes (``DSparkDraft.token_history``); ``propose`` adds ``block_prefix [B, i+1]`` (the
anchor and the tokens chosen so far in the block) for the per-slot Markov lookup.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from dspark_core.draft.config import DraftConfig, EngramConfig
from dspark_core.draft.model import DSparkDraft
from dspark_core.errors import UserError

HASH_MULT_BITS = 20  # multipliers < 2^20 and ids + 1 < 2^20: a G-term sum never overflows int64


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % d for d in range(2, math.isqrt(n) + 1))


def table_primes(cfg: EngramConfig) -> list[int]:
    """Rows of every head, order by order: the ``heads_per_order`` smallest primes >= ``table_rows``
    (distinct within an order, so two heads of one order never share a modulus)."""
    out: list[int] = []
    for _ in cfg.orders:
        n = cfg.table_rows
        for _ in range(cfg.heads_per_order):
            while not is_prime(n):
                n += 1
            out.append(n)
            n += 1
    return out


def head_widths(dim: int, num_heads: int) -> list[int]:
    """Split ``dim`` over the heads (the first ``dim % num_heads`` heads one wider)."""
    if dim < num_heads:
        raise UserError(f"draft.engram: {num_heads} hash heads (heads_per_order x orders) exceed the feature width "
                        f"{dim}; lower draft.engram.heads_per_order or the number of orders")
    return [dim // num_heads + (1 if k < dim % num_heads else 0) for k in range(num_heads)]


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm without affine parameters (the seed's N); zero stays zero."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class EngramTable(nn.Module):
    """The hashed multi-head n-gram table: ``lookup(ids [B, L], positions [B, ...]) -> e [B, ..., dim]``."""

    def __init__(self, cfg: EngramConfig, dim: int) -> None:
        super().__init__()
        self.cfg, self.dim = cfg, dim
        self.head_orders = [n for n in cfg.orders for _ in range(cfg.heads_per_order)]
        self.rows = table_primes(cfg)
        self.widths = head_widths(dim, cfg.num_heads)
        frozen = cfg.source == "frozen"
        self.tables = nn.ModuleList(nn.Embedding(rows, w, sparse=cfg.sparse) for rows, w in zip(self.rows, self.widths))
        for t in self.tables:
            t.weight.requires_grad_(not frozen)
        g = torch.Generator().manual_seed(cfg.hash_seed)
        mult = torch.randint(1, 2 ** HASH_MULT_BITS, (cfg.num_heads, max(cfg.orders)), generator=g)
        self.register_buffer("mult", mult, persistent=False)  # [nh, G], a function of hash_seed
        self.register_buffer("primes", torch.tensor(self.rows), persistent=False)  # [nh]
        self.timing = False  # bench_online: accumulate the lookup's wall time in ``lookup_s``
        self.lookup_s = 0.0

    def reset_parameters(self, std: float) -> None:
        for t in self.tables:
            nn.init.normal_(t.weight, 0.0, std)

    @property
    def num_params(self) -> int:
        return sum(r * w for r, w in zip(self.rows, self.widths))

    def layout(self) -> dict[str, Any]:
        """What a frozen table file must match."""
        return {"orders": list(self.cfg.orders), "heads_per_order": self.cfg.heads_per_order,
                "rows": list(self.rows), "widths": list(self.widths), "hash_seed": self.cfg.hash_seed}

    def buckets(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, L], positions [B, P] -> bucket [B, P, nh] (long) and valid [B, P, nh] (n-gram complete)."""
        if ids.dim() != 2 or positions.dim() != 2 or positions.shape[0] != ids.shape[0]:
            raise ValueError(f"engram lookup: ids [B, L] and positions [B, P] expected; got {tuple(ids.shape)} "
                             f"and {tuple(positions.shape)}")
        g = max(self.cfg.orders)
        back = positions.unsqueeze(-1) - torch.arange(g, device=ids.device)  # [B, P, G] (t, t-1, ...)
        inside = (back >= 0) & (back < ids.shape[1])
        grams = ids.gather(1, back.clamp(0, ids.shape[1] - 1).flatten(1)).view_as(back) + 1  # [B, P, G]
        grams = torch.where(inside, grams, torch.zeros_like(grams))
        orders = torch.tensor(self.head_orders, device=ids.device)  # [nh]
        used = torch.arange(g, device=ids.device) < orders.unsqueeze(-1)  # [nh, G]
        terms = grams.unsqueeze(-2) * (self.mult.to(ids.device) * used)  # [B, P, nh, G]
        bucket = terms.sum(-1) % self.primes.to(ids.device)  # [B, P, nh]
        valid = ((inside.unsqueeze(-2) | ~used).all(-1))  # [B, P, nh]
        return bucket, valid

    def lookup(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids [B, L] (long), positions [B, ...] -> e [B, ..., dim] (zeros where an n-gram is incomplete)."""
        t0 = self._tick()
        flat = positions.reshape(positions.shape[0], -1)  # [B, P]
        bucket, valid = self.buckets(ids.long(), flat.long())
        parts = [table(bucket[..., k]) * valid[..., k:k + 1].to(table.weight.dtype)
                 for k, table in enumerate(self.tables)]  # nh x [B, P, w_k]
        out = torch.cat(parts, dim=-1).view(*positions.shape, self.dim)
        self._tock(t0, out)
        return out

    def _tick(self) -> float:
        return time.perf_counter() if self.timing else 0.0

    def _tock(self, t0: float, out: torch.Tensor) -> None:
        if self.timing:
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            self.lookup_s += time.perf_counter() - t0


class EngramDraft(DSparkDraft):
    """Base of the Engram variants: the baseline plus an :class:`EngramTable` (``engram_table``)."""

    token_history = 0  # set per instance: the trailing tokens the engine passes in extras["input_ids"]

    def __init__(self, cfg: DraftConfig, target_config: Any, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, **kwargs: Any) -> None:
        super().__init__(cfg, target_config, embed_weight, lm_head_weight, **kwargs)
        self.engram_table = EngramTable(cfg.engram, self.hidden_size)
        self.engram_table.reset_parameters(float(getattr(target_config, "initializer_range", 0.02)))
        self.token_history = max(cfg.engram.orders) + 1
        self._build_variant(target_config)

    def _build_variant(self, target_config: Any) -> None:
        raise NotImplementedError

    def load_frozen_sources(self) -> None:
        """Training: fill a ``frozen`` table from ``draft.engram.table_path`` (the engram_build stage's file),
        checked against this draft's layout and target. A trainable table keeps its random init."""
        if self.cfg.engram.source != "frozen":
            return
        weights = read_frozen_table(self.cfg.engram.table_path, self.engram_table.layout(), self.target_fingerprint)
        with torch.no_grad():
            for table, w in zip(self.engram_table.tables, weights):
                table.weight.copy_(w)

    def variant_params(self) -> dict[str, nn.Parameter]:
        """The variant's own draft parameters (the seed's counts; the table is reported on its own)."""
        return {k: p for k, p in self.named_parameters()
                if k.startswith("engram_") and not k.startswith("engram_table.")}

    def variant_timers(self) -> dict[str, float]:
        return {"engram_lookup": self.engram_table.lookup_s}

    def set_variant_timing(self, on: bool) -> None:
        self.engram_table.timing = on
        self.engram_table.lookup_s = 0.0

    def _history(self, extras: Mapping[str, Any] | None) -> torch.Tensor:
        if extras is None or "input_ids" not in extras:
            raise ValueError(f"{type(self).__name__} reads token ids: pass extras with 'input_ids' (and 'anchors') "
                             f"(the training batch, or the engine's token history)")
        return extras["input_ids"]

    def pre_anchor_features(self, anchor_tokens: torch.Tensor, extras: Mapping[str, Any] | None) -> torch.Tensor:
        """e_{a-1} [B, A, H] of every anchor (zeros without a predecessor or for an invalid anchor)."""
        ids = self._history(extras)
        anchors = extras["anchors"].to(ids.device)  # [B, A]
        if anchors.shape != anchor_tokens.shape:
            raise ValueError(f"extras['anchors'] {tuple(anchors.shape)} does not match the anchors "
                             f"{tuple(anchor_tokens.shape)}")
        e = self.engram_table.lookup(ids, anchors - 1)  # [B, A, H]
        if "anchor_valid" in extras:
            e = e * extras["anchor_valid"].to(e.device).unsqueeze(-1).to(e.dtype)
        return e.to(self.compute_dtype)


class EngramMarkovDraft(EngramDraft, kind="engram_markov"):
    """Engram-Markov: ``m_i = W1[t_{i-1}] + g_i v_i`` (module docstring)."""

    def _build_variant(self, target_config: Any) -> None:
        r, hid = self.cfg.markov_rank, self.hidden_size
        self.engram_q = nn.Linear(hid, r, bias=False)  # W_Q [r, H]
        self.engram_k = nn.Linear(hid, r, bias=False)  # W_K [r, H]
        self.engram_v = nn.Linear(hid, r, bias=False)  # W_V [r, H], zero: initial output = vanilla Markov
        std = float(getattr(target_config, "initializer_range", 0.02))
        nn.init.normal_(self.engram_q.weight, 0.0, std)
        nn.init.normal_(self.engram_k.weight, 0.0, std)
        nn.init.zeros_(self.engram_v.weight)

    def prev_features(self, prev_tokens: torch.Tensor, extras: Mapping[str, Any] | None) -> torch.Tensor:
        """e_{i-1} [..., H] of the prefix ending at t_{i-1}: training ``prev_tokens [B, A, S]`` sit at positions
        ``anchor + i``; at inference ``extras['block_prefix']`` holds the anchor and the tokens chosen so far."""
        ids = self._history(extras)
        if "block_prefix" in extras:  # inference: history before the anchor + [anchor, chosen tokens]
            seq = torch.cat([ids[:, :-1].to(extras["block_prefix"].device), extras["block_prefix"]], dim=1)
            seq = seq[:, -max(self.cfg.engram.orders):]  # [B, <=G]
            pos = torch.full((seq.shape[0], 1), seq.shape[1] - 1, device=seq.device)
            return self.engram_table.lookup(seq, pos).view(*prev_tokens.shape, -1)
        slots = torch.arange(prev_tokens.shape[-1], device=ids.device)
        pos = extras["anchors"].to(ids.device).unsqueeze(-1) + slots  # [B, A, S]
        e = self.engram_table.lookup(ids, pos)  # [B, A, S, H]
        return e * (pos < ids.shape[1]).unsqueeze(-1).to(e.dtype)

    def markov_features(self, prev_tokens: torch.Tensor, hidden: torch.Tensor,
                        extras: Mapping[str, Any] | None) -> torch.Tensor:
        base = self.markov.features(prev_tokens)  # [..., r]
        e = rms_norm(self.prev_features(prev_tokens, extras).to(hidden.dtype))  # [..., H]
        q = rms_norm(self.engram_q(rms_norm(hidden)))  # [..., r]
        k = rms_norm(self.engram_k(e))
        v = self.engram_v(e)
        s = (q * k).sum(-1, keepdim=True) / math.sqrt(q.shape[-1])  # [..., 1]
        g = torch.sigmoid(torch.sign(s) * torch.sqrt(s.abs().clamp_min(1e-6)))
        return base + (g * v).to(base.dtype)


class EngramMaskGatedDraft(EngramDraft, kind="engram_mask_gated"):
    """Engram-MASK gated: slot j >= 1 input ``E(MASK) + tanh(theta_j) RMSNorm(P e_{a-1})``."""

    def _build_variant(self, target_config: Any) -> None:
        self.engram_proj = nn.Linear(self.hidden_size, self.target_hidden_size, bias=False)  # P [Ht, H]
        nn.init.normal_(self.engram_proj.weight, 0.0, float(getattr(target_config, "initializer_range", 0.02)))
        self.engram_gate = nn.Parameter(torch.zeros(self.block_size - 1))  # theta [S-1], zero: = baseline

    def block_inputs(self, anchor_tokens: torch.Tensor, extras: Mapping[str, Any] | None) -> torch.Tensor:
        x = super().block_inputs(anchor_tokens, extras)  # [B, A, S, Ht]
        z = rms_norm(self.engram_proj(self.pre_anchor_features(anchor_tokens, extras)))  # [B, A, Ht]
        gate = torch.tanh(self.engram_gate).view(-1, 1)  # [S-1, 1]
        mask = x[:, :, 1:] + gate.to(x.dtype) * z.unsqueeze(2).to(x.dtype)  # [B, A, S-1, Ht]
        return torch.cat([x[:, :, :1], mask], dim=2)


class EngramMaskReplaceDraft(EngramDraft, kind="engram_mask_replace"):
    """Engram-MASK replace: slots 1..S-1 are ``RMSNorm(P e_{a-1})``; the anchor keeps its embedding."""

    def _build_variant(self, target_config: Any) -> None:
        self.engram_proj = nn.Linear(self.hidden_size, self.target_hidden_size, bias=False)  # P [Ht, H]
        nn.init.normal_(self.engram_proj.weight, 0.0, float(getattr(target_config, "initializer_range", 0.02)))

    def block_inputs(self, anchor_tokens: torch.Tensor, extras: Mapping[str, Any] | None) -> torch.Tensor:
        anchor = F.embedding(anchor_tokens, self.embedding_matrix())  # [B, A, Ht]
        z = rms_norm(self.engram_proj(self.pre_anchor_features(anchor_tokens, extras))).to(anchor.dtype)
        return torch.cat([anchor.unsqueeze(2), z.unsqueeze(2).expand(-1, -1, self.block_size - 1, -1)], dim=2)


# -- frozen tables (the engram_build stage) ------------------------------------------------------------------
TABLE_FORMAT = "dspark-engram-table"


@torch.no_grad()
def build_frozen_table(cfg: EngramConfig, dim: int, samples: Any, embed: torch.Tensor) -> list[torch.Tensor]:
    """A table of what followed each n-gram: row = mean target embedding ``E(x_{t+1})`` over the positions t
    whose n-gram hashes there, through a fixed random projection Ht -> the head's width (seeded by
    ``hash_seed``); rows never hit stay zero. ``samples``: iterable of token-id tensors [L]; embed [V, Ht]."""
    table = EngramTable(cfg, dim)
    sums = [torch.zeros(r, embed.shape[1], dtype=torch.float64) for r in table.rows]  # nh x [rows, Ht]
    counts = [torch.zeros(r, dtype=torch.float64) for r in table.rows]
    seen = 0
    for ids in samples:
        ids = torch.as_tensor(ids, dtype=torch.long).view(1, -1)  # [1, L]
        if ids.shape[1] < 2:
            continue
        pos = torch.arange(ids.shape[1] - 1).view(1, -1)  # positions with a next token
        bucket, valid = table.buckets(ids, pos)  # [1, P, nh]
        nxt = embed[ids[0, 1:]].double()  # [P, Ht]
        for k in range(len(table.rows)):
            keep = valid[0, :, k]
            sums[k].index_add_(0, bucket[0, keep, k], nxt[keep])
            counts[k].index_add_(0, bucket[0, keep, k], torch.ones(int(keep.sum()), dtype=torch.float64))
        seen += 1
    if seen == 0:
        raise ValueError("engram_build: no sample with at least 2 tokens to build the table from")
    g = torch.Generator().manual_seed(cfg.hash_seed + 1)
    out = []
    for s_k, c_k, w in zip(sums, counts, table.widths):
        proj = torch.randn(embed.shape[1], w, generator=g, dtype=torch.float64) / math.sqrt(embed.shape[1])
        out.append(((s_k / c_k.clamp_min(1).unsqueeze(-1)) @ proj).float())  # [rows, w]
    return out


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (any dtype; recorded per table in the file's metadata)."""
    import hashlib

    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def write_frozen_table(path: str, weights: list[torch.Tensor], layout: dict[str, Any], fingerprint: str | None,
                       stats: dict[str, Any]) -> None:
    """Atomic safetensors file: ``table_k`` tensors + metadata (format, layout, target fingerprint, stats, and
    each table's SHA-256, checked on read)."""
    import json
    from pathlib import Path

    from dspark_core.io import atomic_path, save_safetensors

    meta = {"format": TABLE_FORMAT, "layout": json.dumps(layout), "target_fingerprint": fingerprint or "",
            "stats": json.dumps(stats), "sha256": json.dumps([tensor_sha256(w) for w in weights])}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(Path(path), ".safetensors") as tmp:
        save_safetensors({f"table_{k}": w.contiguous() for k, w in enumerate(weights)}, tmp, metadata=meta)


def read_frozen_table(path: str, layout: dict[str, Any], fingerprint: str | None) -> list[torch.Tensor]:
    """The tables of a file written by ``write_frozen_table``, refused when built for another layout or target,
    or when a table's bytes differ from the SHA-256 recorded beside it (a damaged file)."""
    import json
    from pathlib import Path

    from safetensors import SafetensorError, safe_open

    f = Path(path)
    rebuild = "rerun `dvc repro -f engram_build`"
    if not f.is_file():
        raise UserError(f"draft.engram.table_path {path}: no such file; run `dvc repro engram_build` "
                        f"(or set draft.engram.source: trainable)")
    try:
        with safe_open(str(f), "pt") as fh:
            meta = fh.metadata() or {}
            _check_table_meta(path, meta, layout, fingerprint)
            tables = [fh.get_tensor(f"table_{k}") for k in range(len(layout["rows"]))]
    except SafetensorError as e:
        raise UserError(f"{path}: not a readable safetensors file ({str(e)[:120]}); {rebuild}") from None
    sums = json.loads(meta.get("sha256", "null"))  # tables written before the checksums: nothing to compare
    for k, (t, want) in enumerate(zip(tables, sums or [])):
        if tensor_sha256(t) != want:
            raise UserError(f"{path}: table_{k} differs from the SHA-256 recorded beside it (the file is damaged); "
                            f"{rebuild}")
    return tables


def _check_table_meta(path: str, meta: dict[str, str], layout: dict[str, Any], fingerprint: str | None) -> None:
    import json

    if meta.get("format") != TABLE_FORMAT:
        raise UserError(f"{path}: not an Engram table (format {meta.get('format')!r})")
    have = json.loads(meta.get("layout", "{}"))
    if have != layout:
        diff = sorted(k for k in set(have) | set(layout) if have.get(k) != layout.get(k))
        raise UserError(f"{path}: table built for another draft.engram layout ({', '.join(diff)} differ: "
                        f"file {[have.get(k) for k in diff]}, params {[layout.get(k) for k in diff]}); "
                        f"rerun engram_build")
    stored = meta.get("target_fingerprint") or None
    if fingerprint is not None and stored is not None and stored != fingerprint:
        raise UserError(f"{path}: table built on another target (fingerprint {stored}; the draft's target "
                        f"is {fingerprint}); rerun engram_build")

