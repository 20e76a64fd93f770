"""The DSpark draft's greedy propose and context update as static-shape, sync-free device code.

``draft.propose`` / ``draft.extend_context`` (``dspark_core.draft.inference``) are the reference: clear,
any hook, any sampling, but eager, with host-side lengths and ~100 small launches per block. This module
computes the same thing for the baseline architecture with every length and position in device tensors,
so a whole speculative cycle can be captured as one CUDA graph (``dspark_core.decoding.static_engine``):

- the context K/V live in a static cache ``[nl, 1, nkv, M, d]``; the block attends to *all* M cached
  positions under a mask ``key < p`` (p, the anchor position, is a device tensor) plus its own S keys, which
  equals attending to the first p positions;
- ``extend(aux, pos)`` writes the projected context of positions ``pos`` (device) into the cache; the engine
  writes all S+1 verified positions every cycle and only the accepted ones count (the rest are beyond the
  new length: never visible, overwritten later);
- the Markov slots pick tokens sequentially on the device (greedy, or drawn: ``propose_sampled``), each reading
  the previous token there.

``kernels=True`` (Triton on CUDA, or its interpreter in tests) runs the draft layers through the same
fused kernels as the target's decode step (``dspark_core.kernels``: norm folded into the Q/K/V and
gate/up products, q/k norm + RoPE + cache write, split-KV attention; the block's own K/V are written at
positions p..p+S-1 of the cache and every block query sees keys <= p+S-1, i.e. bidirectional within the
block) and each Markov slot through one kernel (``dspark_core.kernels.markov``; a sampled slot too at a plain
temperature, plus one launch that normalises the block's q). A gated / rnn Markov head's W2 input is computed
by its torch step from the block's states and fed to the same kernel; a draft tree's branches with such a head
take the torch slots. A reduced draft vocabulary (``draft.vocab_size``): the block's LM head and the Markov W2
cover the Vd draft rows only (the head's rows gathered once), the slots pick draft ids and write target ids
(``d2t``), and a sampled block's q is scattered into the target vocabulary, zero outside the Vd tokens (the
rejection step's q). The prompt's context
(any length) always goes through the torch path. Like ``TargetRunner(kernels=True)`` it concatenates each
layer's Q/K/V and gate/up weights once and re-points the draft's modules to views of them (same values).

Shape legend: S block size, V vocab (Vd a reduced draft vocabulary), K aux layers, Ht target hidden, H draft
hidden, nl draft layers, nq / nkv heads, d head dim, M cache positions (max_len rounded up to 16), n positions of
an extend.
"""

from __future__ import annotations

import torch

from dspark_core.draft.attention import AttentionMask
from dspark_core.draft.model import DSparkDraft
from dspark_core.decoding.target_runner import fuse_layer
from dspark_core.decoding.tree import top2_reference

HOOKS = ("block_inputs", "markov_features", "extra_kv", "score_candidates")
SAMPLE_KERNEL = True  # False: the torch path even where the kernel applies (see StaticDraft._sample_kernel_applies)


def static_draft_problem(draft: DSparkDraft) -> str | None:
    """Why the static path does not apply to ``draft`` (None when it does)."""
    problems = []
    for hook in HOOKS:
        if getattr(type(draft), hook) is not getattr(DSparkDraft, hook):
            problems.append(f"{type(draft).__name__} overrides the variant hook {hook}()")
    return "; ".join(problems) if problems else None


def draft_kernels_problem(draft: DSparkDraft) -> str | None:
    """Why the Triton path does not apply to the draft's layers (None when it does)."""
    from dspark_core.kernels import triton_ok

    problems = []
    if not triton_ok(draft.fc.weight.device):
        problems.append(f"Triton cannot run on {draft.fc.weight.device}")
    d = draft.hf_config.head_dim
    if d & (d - 1) or d < 16:
        problems.append(f"draft head_dim {d} is not a power of two >= 16")
    mlp = draft.layers[0].mlp
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        problems.append(f"the draft MLP {type(mlp).__name__} is not a gated MLP")
    act = getattr(mlp, "act_fn", None)
    if not isinstance(act, torch.nn.SiLU) and "SiLU" not in type(act).__name__:
        problems.append(f"the draft MLP's act_fn is {type(act).__name__}, not SiLU")
    if draft.block_size + 1 > 16:
        problems.append(f"block_size {draft.block_size} + 1 exceeds the kernels' 16 tokens")
    return "; ".join(problems) if problems else None


class StaticDraft:
    """Static context cache + greedy propose of a baseline ``DSparkDraft`` (see the module docstring)."""

    def __init__(self, draft: DSparkDraft, max_len: int, *, kernels: bool = False, rows: int = 1,
                 hooks: bool = False) -> None:
        problem = static_draft_problem(draft)
        if problem and not hooks:
            raise ValueError(f"the static draft path does not apply: {problem} (use the reference engine)")
        if problem and kernels:
            raise ValueError(f"StaticDraft(kernels=True) does not apply: {problem}")
        if rows < 1:
            raise ValueError(f"rows must be >= 1; got {rows}")
        if kernels:
            problem = draft_kernels_problem(draft)
            if problem:
                raise ValueError(f"StaticDraft(kernels=True) does not apply: {problem}")
        self.draft, self.kernels = draft, bool(kernels)
        self.block_size = s = draft.block_size
        self.device, self.dtype = draft.fc.weight.device, draft.compute_dtype
        attn = draft.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.eps = float(draft.hf_config.rms_norm_eps)
        self.alloc = -(-int(max_len) // 16) * 16
        self.rows = int(rows)
        shape = (len(draft.layers), self.rows, self.num_kv_heads, self.alloc, self.head_dim)
        self.k = torch.zeros(shape, device=self.device, dtype=self.dtype)  # [nl, R, nkv, M, d]
        self.v = torch.zeros(shape, device=self.device, dtype=self.dtype)  # [nl, R, nkv, M, d]
        self.key_pos = torch.arange(self.alloc, device=self.device)  # [M]
        self.slots = torch.arange(s, device=self.device)  # [S]
        self.block_visible = torch.ones(s, dtype=torch.bool, device=self.device)  # [S]
        self.tokens = torch.zeros(s, dtype=torch.long, device=self.device)  # [S] the last proposal
        self._tree_tables: dict = {}  # TreeLayout -> per-depth Markov row tables (Triton path)
        self.markov = None  # the Triton Markov slots (kernels path, any Markov head type)
        self.vocab = draft.draft_vocab if self.kernels else None  # base logits over the Vd draft tokens (kernels)
        with torch.no_grad():
            cos, sin = draft.rope(self.k[0, 0, 0], self.key_pos.unsqueeze(0))  # [1, M, d]
        self.cos, self.sin = cos[0].to(self.dtype).contiguous(), sin[0].to(self.dtype).contiguous()  # [M, d]
        if self.kernels:
            from dspark_core.kernels.markov import MarkovSampler

            self.fused = [fuse_layer(layer) for layer in draft.layers]  # re-points Q/K/V, gate/up to views
            self.head_w = draft.draft_head_weight().detach().contiguous()  # [Vd, Ht] (the frozen head's own rows)
            d2t = None if self.vocab is None else self.vocab.d2t
            self.markov = None if draft.markov is None else \
                MarkovSampler(draft.markov.w1.weight.detach(), draft.markov.w2.weight.detach(), d2t)
            self.q_stats = torch.zeros(s, 2, device=self.device, dtype=torch.float32)  # [S, 2] (max, mass) of q
            self.q_draft = None if self.vocab is None else \
                torch.zeros(s, self.vocab.size, device=self.device, dtype=torch.float32)  # [S, Vd] scaled logits

    # -- request rows (the batched engine: any number of rows, variant hooks, eager or captured) ------------
    @torch.no_grad()
    def extend_rows(self, aux_hidden: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> None:
        """Write the context K/V of aux_hidden [T, K, Ht] of tokens at (``rows [T]``, ``pos [T]``) (device; a
        (row, position) may repeat with the same hidden: padding)."""
        draft, t = self.draft, aux_hidden.shape[0]
        c = draft.context_features(aux_hidden.to(self.device).unsqueeze(0))  # [1, T, H]
        rope = draft.rope(c, pos.view(1, t))
        for i, layer in enumerate(draft.layers):
            k, v = layer.self_attn.project_kv(c, rope)  # [1, nkv, T, d]
            self.k[i][rows, :, pos] = k[0].transpose(0, 1).to(self.dtype)  # [T, nkv, d]
            self.v[i][rows, :, pos] = v[0].transpose(0, 1).to(self.dtype)

    @torch.no_grad()
    def block_rows(self, anchor: torch.Tensor, p: torch.Tensor, extras=None) -> torch.Tensor:
        """One block per row: anchor [R] at position p [R], over the row's cached context (keys < p), the
        variant's extra K/V (hook 3; entries with owner < 0 hidden) and the block itself (bidirectional) ->
        final draft states h [R, S, H]. ``extras``: what the variant hooks read (``DSparkDraft.rows_extras``)."""
        draft, s, r = self.draft, self.block_size, anchor.shape[0]
        x = draft._block_states(anchor.view(r, 1), extras)  # [R, S, H] (hook 1)
        rope = draft.rope(x, p.view(r, 1) + self.slots)  # RoPE at p .. p+S-1
        visible = [self.key_pos.unsqueeze(0) < p.view(r, 1)]  # [R, M] the row's context
        extra = draft.extra_kv(extras, p.view(r, 1), torch.ones(r, 1, dtype=torch.bool, device=p.device))
        extra_rope = None
        if extra is not None:
            extra_rope = draft.rope(extra.states, extra.positions)
            visible.append(extra.owner >= 0)  # [R, E]
        visible.append(self.block_visible.expand(r, s))  # [R, S]
        mask = AttentionMask(dense=torch.cat(visible, dim=1)[:, None, None, :].expand(r, 1, s, -1))
        for i, layer in enumerate(draft.layers):
            prefix = [(self.k[i][:r], self.v[i][:r])]  # [R, nkv, M, d]
            if extra is not None:
                prefix.append(layer.self_attn.project_kv(extra.states, extra_rope))
            x = layer(x, prefix, rope, mask)
        return draft.norm(x)  # [R, S, H]

    # -- context --------------------------------------------------------------------------------
    @torch.no_grad()
    def extend(self, aux_hidden: torch.Tensor, pos: torch.Tensor, slot_offset: torch.Tensor | None = None) -> None:
        """Write the context K/V of aux_hidden [1, n, K, Ht] at positions ``pos [n]`` (device); with
        ``slot_offset [n]`` (a draft tree's rows) RoPE at ``pos`` but written to slots ``pos + slot_offset``."""
        n = aux_hidden.shape[1]
        if self.kernels and n <= 16:
            return self._extend_kernels(aux_hidden, pos, slot_offset)
        draft = self.draft
        c = draft.context_features(aux_hidden.to(self.device))  # [1, n, H]
        rope = draft.rope(c, pos.view(1, n))
        slots = pos if slot_offset is None else pos + slot_offset.long()  # [n]
        for i, layer in enumerate(draft.layers):
            k, v = layer.self_attn.project_kv(c, rope)  # [1, nkv, n, d]
            self.k[i].index_copy_(2, slots, k.to(self.dtype))
            self.v[i].index_copy_(2, slots, v.to(self.dtype))

    def _extend_kernels(self, aux_hidden: torch.Tensor, pos: torch.Tensor, slot_offset: torch.Tensor | None = None
                        ) -> None:
        from dspark_core.kernels.linear import fused_linear
        from dspark_core.kernels.rope import qk_norm_rope_cache

        draft, n = self.draft, aux_hidden.shape[1]
        flat = aux_hidden.reshape(n, -1).to(self.dtype)  # [n, K*Ht]
        pre = fused_linear(flat, draft.fc.weight)  # [n, H]; hidden_norm folded into each layer's product
        for i, w in enumerate(self.fused):
            qkv = fused_linear(pre, w.qkv_w, w.qkv_b, norm_weight=draft.hidden_norm.weight, eps=self.eps)
            qk_norm_rope_cache(qkv, w.q_norm, w.k_norm, self.cos, self.sin, pos, self.k[i], self.v[i],
                               self.num_heads, self.num_kv_heads, self.eps,
                               slot_offset=slot_offset)  # the queries are not used

    # -- propose ----------------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, anchor: torch.Tensor, p: torch.Tensor, need_hidden: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy block at anchor [1] (token) / p [1] (position): tokens [S] (into ``self.tokens``) and the final
        draft states h [S, H] (for the confidence head; the Triton path skips them without ``need_hidden``)."""
        if self.kernels:
            hidden, base = self._block_kernels(anchor, p, need_hidden or self._head_reads_hidden)
        else:
            hidden = self._block_torch(anchor, p)  # [S, H]
            base = self.draft.slot_logits(hidden)  # [S, V] float32
        self._markov_slots(base, anchor, hidden)
        return self.tokens, hidden

    @torch.no_grad()
    def propose_sampled(self, anchor: torch.Tensor, p: torch.Tensor, params, q_out: torch.Tensor,
                        race: torch.Tensor, need_hidden: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A block drawn from the draft: slot i's distribution q_i = ``logits_to_probs(base_i + Markov bias of the
        drawn token i-1, params)`` goes to ``q_out [S, V]`` and its token (``race_sample`` on ``race [S, V]``
        U[0, 1) draws) to ``self.tokens``. Returns tokens [S] and the final draft states [S, H] (as ``propose``)."""
        from dspark_core.decoding.sampling import logits_to_probs, race_sample

        if self.kernels:
            hidden, base = self._block_kernels(anchor, p, need_hidden or self._head_reads_hidden)
        else:
            hidden = self._block_torch(anchor, p)  # [S, H]
            base = self.draft.slot_logits(hidden)  # [S, V] float32
        if self._sample_kernel_applies(params):
            self._sampled_slots_kernel(base, anchor, hidden, params.temperature, q_out, race)
            return self.tokens, hidden
        base = self._full(base)  # [S, V]
        draft, prev, state = self.draft, anchor.view(1), None
        for i in range(self.block_size):
            logits = base[i : i + 1].float()  # [1, V]
            if draft.markov is not None:
                bias, state = self._markov_bias(prev, hidden, i, state)
                logits = logits + bias
            q_out[i].copy_(logits_to_probs(logits, params)[0])
            self.tokens[i].copy_(race_sample(q_out[i], race[i]))
            prev = self.tokens[i : i + 1]
        return self.tokens, hidden

    def plain_temperature(self, params) -> bool:
        """Sampling at a temperature with no top-k / top-p to apply: what the sampling kernels take (their sort /
        top-k stay on the torch path)."""
        return not params.greedy and params.top_p >= 1.0 and not 0 < params.top_k < self.draft.vocab_size

    def _sample_kernel_applies(self, params) -> bool:
        """The one-launch sampled slot (``MarkovSampler``) at a plain temperature (the tests compare it with the
        torch path, ``SAMPLE_KERNEL = False``)."""
        return self.kernels and self.markov is not None and self.plain_temperature(params) and SAMPLE_KERNEL

    def _sampled_slots_kernel(self, base: torch.Tensor, anchor: torch.Tensor, hidden: torch.Tensor | None,
                              temperature: float, q_out: torch.Tensor, race: torch.Tensor) -> None:
        """Slot by slot, one launch each (token drawn, q's logits left in q_out, or in ``q_draft`` [S, Vd] with a
        reduced vocabulary), then q_out normalised at once."""
        prev, state = anchor.view(1), None
        logits = q_out if self.q_draft is None else self.q_draft  # [S, V] | [S, Vd]
        for i in range(self.block_size):
            u, state = self._head_input(prev, hidden, i, state)
            self.markov.sample(base[i], prev, race[i], logits[i], self.tokens[i : i + 1], self.q_stats[i], temperature,
                               features=u)
            prev = self.tokens[i : i + 1]
        self.markov.normalize(q_out, self.q_stats, src=self.q_draft)

    def _block_torch(self, anchor: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        draft, s = self.draft, self.block_size
        x = draft._block_states(anchor.view(1, 1), None)  # [1, S, H]
        rope = draft.rope(x, (p + self.slots).view(1, s))
        visible = torch.cat([self.key_pos < p, self.block_visible])  # [M + S]
        mask = AttentionMask(dense=visible.view(1, 1, 1, -1).expand(1, 1, s, -1))
        for i, layer in enumerate(draft.layers):
            x = layer(x, [(self.k[i], self.v[i])], rope, mask)
        return draft.norm(x)[0]  # [S, H]

    def _block_kernels(self, anchor: torch.Tensor, p: torch.Tensor, need_hidden: bool
                       ) -> tuple[torch.Tensor | None, torch.Tensor]:
        from dspark_core.kernels.attention import decode_attention
        from dspark_core.kernels.linear import fused_linear
        from dspark_core.kernels.rope import qk_norm_rope_cache

        draft, s, eps = self.draft, self.block_size, self.eps
        x = draft._block_states(anchor.view(1, 1), None)[0].contiguous()  # [S, H]
        pos = p + self.slots  # [S] RoPE positions and where the block's K/V go
        last = (p + (s - 1)).expand(s).contiguous()  # [S] every block query sees keys <= p + S - 1
        scale = draft.layers[0].self_attn.scale
        for i, w in enumerate(self.fused):
            qkv = fused_linear(x, w.qkv_w, w.qkv_b, norm_weight=w.ln1, eps=eps)  # [S, (nq + 2 nkv) d]
            q = qk_norm_rope_cache(qkv, w.q_norm, w.k_norm, self.cos, self.sin, pos, self.k[i], self.v[i],
                                   self.num_heads, self.num_kv_heads, eps)  # [S, nq, d]
            attn = decode_attention(q, self.k[i], self.v[i], last, scale)  # [S, nq, d]
            x = fused_linear(attn.view(s, -1), w.o_w, w.o_b, residual=x)  # [S, H]
            h = fused_linear(x, w.gate_up_w, w.gate_up_b, norm_weight=w.ln2, eps=eps, gated=True)  # [S, F]
            x = fused_linear(h, w.down_w, w.down_b, residual=x)  # [S, H]
        hidden = draft.norm(x) if need_hidden or draft.head_proj is not None else None  # [S, H]
        if draft.head_proj is None:
            base = fused_linear(x, self.head_w, norm_weight=draft.norm.weight, eps=eps).float()  # [S, Vd]
        else:
            base = (draft.head_states(hidden).to(self.head_w.dtype) @ self.head_w.t()).float()  # [S, Vd]
        return hidden, base

    def _full(self, base: torch.Tensor) -> torch.Tensor:
        """Base logits over the target vocabulary [S, V]: those of the Triton block's Vd draft tokens, ``-inf``
        elsewhere (what ``slot_logits`` gives the torch path)."""
        return base if self.vocab is None else self.vocab.expand(base, float("-inf"))

    @torch.no_grad()
    def propose_tree(self, anchor: torch.Tensor, p: torch.Tensor, layout, tok: torch.Tensor) -> None:
        """Greedy draft tree (``dspark_core.decoding.tree.TreeLayout``) at anchor [1] / p [1] into the token buffer
        tok [R] = [anchor, node 1 .. node N] (tok[0] must hold the anchor): the main chain as ``propose``, each
        branch's first token the second best of its depth's slot (same previous token as the main chain's),
        then its greedy Markov continuation. With the Triton draft, one launch per depth for all its rows."""
        if self.kernels:
            hidden, base = self._block_kernels(anchor, p, need_hidden=self._head_reads_hidden)
        else:
            hidden = self._block_torch(anchor, p)  # [S, H]
            base = self.draft.slot_logits(hidden)  # [S, V] float32
        rows = layout.markov_rows()
        if self.markov is not None and self.draft.markov.kind == "vanilla":
            tables = self._tree_tables.get(layout)
            if tables is None:
                tables = [torch.tensor(r, dtype=torch.int32, device=self.device) for r in rows]  # [rows_d, 3] each
                self._tree_tables[layout] = tables
            for d, table in enumerate(tables):
                self.markov.rows(base[d].contiguous(), tok, table)
            return
        base = self._full(base)  # [S, V]
        states: dict = {0: None}  # row -> the Markov head's state after it (rnn: it follows the node's path)
        for d, picks in enumerate(rows):
            for prev, out, out2 in picks:
                states[out] = states[out2] = self._slot(base[d], tok[prev : prev + 1], tok[out : out + 1],
                                                        None if out2 < 0 else tok[out2 : out2 + 1], hidden, d,
                                                        states[prev])

    def _slot(self, base: torch.Tensor, prev: torch.Tensor, out: torch.Tensor, out2: torch.Tensor | None,
              hidden: torch.Tensor | None, slot: int, state: torch.Tensor | None) -> torch.Tensor | None:
        """The torch path of one tree pick: out = argmax(base [V] + Markov bias of prev [1]), out2 = the second
        best (``MarkovArgmax.rows`` on the Triton path). Returns the Markov head's state after the pick."""
        logits = base.view(1, -1)  # [1, V]
        if self.draft.markov is not None:
            bias, state = self._markov_bias(prev, hidden, slot, state)
            logits = logits + bias
        first, second = top2_reference(logits)
        out.copy_(first)
        if out2 is not None:
            out2.copy_(second)
        return state

    @property
    def _head_reads_hidden(self) -> bool:
        """The Markov head type reads the slots' draft states (gated, rnn): the Triton block must return them."""
        return self.draft.markov is not None and self.draft.markov.kind != "vanilla"

    def _markov_bias(self, prev: torch.Tensor, hidden: torch.Tensor | None, slot: int, state: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The torch path's Markov bias of slot ``slot`` after token prev [1]: (bias [1, V] float32, next state)."""
        draft = self.draft
        h = hidden[slot : slot + 1] if hidden is not None else None  # [1, H]
        u, state = draft.markov_step(draft.markov_features(prev, h, None), h, state)  # [1, r]
        return draft.markov_bias(u).float(), state

    def _head_input(self, prev: torch.Tensor, hidden: torch.Tensor | None, slot: int, state: torch.Tensor | None
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """W2's input u [r] of slot ``slot`` for the Markov kernel (None for a vanilla head: the kernel reads
        ``W1[prev]`` itself) and the head's next state: the head type's torch step."""
        if self.draft.markov.kind == "vanilla":
            return None, state
        draft, h = self.draft, hidden[slot : slot + 1]  # [1, H]
        u, state = draft.markov_step(draft.markov_features(prev, h, None), h, state)  # [1, r]
        return u.to(self.markov.w2.dtype).reshape(-1).contiguous(), state

    def _markov_slots(self, base: torch.Tensor, anchor: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """tokens[i] = argmax(base[i] + Markov bias of the previous token), slot by slot on the device."""
        draft = self.draft
        if draft.markov is None:
            best = base.argmax(dim=-1)  # [S] (draft ids with a reduced vocabulary: ties -> lowest, as the target's)
            self.tokens.copy_(best if self.vocab is None else self.vocab.to_target(best))
            return
        prev, state = anchor.view(1), None
        for i in range(self.block_size):
            out = self.tokens[i : i + 1]
            if self.markov is not None:
                u, state = self._head_input(prev, hidden, i, state)
                self.markov(base[i].contiguous(), prev, out, features=u)
            else:
                bias, state = self._markov_bias(prev, hidden, i, state)
                out.copy_((base[i : i + 1] + bias).argmax(dim=-1))
            prev = out

    @torch.no_grad()
    def confident_slots(self, anchor: torch.Tensor, hidden: torch.Tensor, threshold: float) -> torch.Tensor:
        """[] long: slots before the first whose confidence is below ``threshold`` (S when none / no head)."""
        draft, s = self.draft, self.block_size
        if threshold <= 0.0 or draft.confidence is None:
            return torch.full((), s, dtype=torch.long, device=self.device)
        prev = torch.cat([anchor.view(1), self.tokens[:-1]])  # [S] t_{i-1}
        m = draft.markov_features(prev, hidden, None)  # [S, r] | None
        conf = torch.sigmoid(draft.confidence_logits(hidden, m))  # [S]
        below = conf < threshold
        return torch.where(below, self.slots, torch.full_like(self.slots, s)).min()
