"""Draft trees under sampling: how the sibling tokens are drawn, and exact tree verification by recursive
rejection sampling over siblings (SpecInfer's multi-step speculative sampling, Miao et al. 2024; the sampling
trees of EAGLE, Li et al. 2024), for the layouts of ``dspark_core.decoding.tree`` (main chain + branches).

Proposal (``propose_tree``; the reference engine's draft step). Every node's *slot distribution* is the draft's
processed distribution (``logits_to_probs``: temperature, top-k, top-p) at its depth given its path: the block
state h_d, the Markov bias of its parent's token and the variant hooks, exactly as the chain's ``draft.propose``.

- the main chain's token at depth d is drawn from its slot distribution q_d (as ``draft.propose`` draws it);
- a branch starting at depth d takes its first token from q_d *without replacement* of the main chain's token
  x: ``sibling_probs(q_d, x) = q_d with x removed, renormalised``; when q_d has no mass outside x (greedy,
  top-k 1, a peaked top-p) a point mass at the draft's best token other than x -- at temperature 0 this is the
  greedy tree's second-best token, so one rule serves both modes;
- a branch's later tokens are drawn from their slot distribution given the branch's previous token.

Each node i records ``node_probs[i]``: the law its token was drawn from, given its ancestors and its earlier
siblings (lower rows). The verifier reads nothing else of the draft, so any sibling rule verifies exactly as long
as this law is recorded (i.i.d. siblings, q_c = q, whose tokens may coincide, verify exactly too).

Verification (``tree_verify_sampling``), with p(row) the target's processed distribution at each row: walk
from the anchor with a residual r = p(anchor)::

    for each child c of the current node, in row order (the main chain's first, then the branch's):
        accept c's token x with probability min(1, r(x) / q_c(x))  ->  move to c, r = p(c)
        else  r = norm(max(r - q_c, 0))  and try the next child
    no child left (all rejected, or a leaf): the next token is drawn from r

so the bonus is drawn from p at an accepted leaf and the correction from the last residual after a rejection.
Exactness, by induction over the siblings: given the earlier siblings' tokens and their rejections, the token
emitted at the node is distributed as the current residual r (one step of speculative sampling against target r
with proposal q_c gives min(r, q_c) + max(r - q_c, 0) = r, for any q_c, and the next residual does not depend on
the rejected token); with r = p(node) at the first child, every emitted token is a draw from p(node), so the
tokens committed per cycle are distributed as sequential draws from the target.

Rows are processed in index order, which visits each node's children in sibling order after the node itself
(a branch's rows follow the main chain's, a child's row follows its parent's); no host read, static shapes.

Shape legend: B batch (independent trees; 1 in the engine), S block size (main-chain depth), N nodes,
R = N + 1 verify rows (row 0 the anchor), V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from dspark_core.decoding.sampling import SamplingParams, logits_to_probs, one_hot_argmax
from dspark_core.decoding.tree import TreeLayout, TreeTensors

_MIN_MASS = 1e-20  # below it a residual / the mass left for a sibling counts as empty


@dataclass
class TreeProposal:
    """A draft tree in sampling mode (or greedy: then every law is a point mass)."""

    tokens: torch.Tensor  # [R] long: the anchor, then node 1 .. N in row order (the verify step's input ids)
    probs: torch.Tensor  # [N, V] float32: node i's law given its ancestors and earlier siblings (q_c above)


def sibling_probs(q: torch.Tensor, taken: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The law of a sibling drawn without replacement: q [B, V] with the earlier siblings' tokens ``taken`` ([B] or
    [B, k]) removed and renormalised; where q has no mass outside them, a point mass at the best other token of
    ``logits [B, V]`` (ties: the lowest id) -> [B, V] float32."""
    q = q.float()
    idx = taken.long().view(q.shape[0], -1)  # [B, k]
    rest = q.scatter(-1, idx, 0.0)  # [B, V]
    mass = rest.sum(dim=-1, keepdim=True)  # [B, 1]
    point = one_hot_argmax(logits.float().scatter(-1, idx, float("-inf")))  # [B, V]
    return torch.where(mass > _MIN_MASS, rest / mass.clamp_min(_MIN_MASS), point)


def residual(r: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(r - q, 0)) per row of r, q [B, V]; r itself where that is empty (then r <= q everywhere and a
    rejection has probability 0; kept for rounding)."""
    m = torch.clamp(r - q, min=0.0)  # [B, V]
    mass = m.sum(dim=-1, keepdim=True)  # [B, 1]
    return torch.where(mass > _MIN_MASS, m / mass.clamp_min(_MIN_MASS), r)


def tree_verify_sampling(target_probs: torch.Tensor, node_probs: torch.Tensor, nodes: torch.Tensor,
                         t: TreeTensors, generator: torch.Generator | None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling over a draft tree (see the module docstring), B trees at once.

    target_probs [B, R, V] (p at every row, row 0 the anchor), node_probs [B, N, V] (each node's law q_c),
    nodes [B, N] (node tokens, row r = node r - 1), t the layout's tables (``TreeLayout.tensors``; only depth,
    parent and ancestors are read, so any tree whose parents precede their children in row order works).
    Returns (a [B] accepted depth, w [B] the deepest accepted row (0: none), path [B, S+1] the rows of w's
    ancestors at depths 0..a (identity beyond a), next [B] the bonus / corrected token). The committed tokens are
    the node tokens at rows path[1..a], then next."""
    b, rows, v = target_probs.shape
    n = rows - 1
    if node_probs.shape != (b, n, v) or nodes.shape != (b, n) or t.parent.shape[0] != rows:
        raise ValueError(f"tree_verify_sampling: target_probs {tuple(target_probs.shape)}, node_probs "
                         f"{tuple(node_probs.shape)}, nodes {tuple(nodes.shape)} and a {t.parent.shape[0]}-row "
                         "tree disagree (want [B, R, V], [B, R-1, V], [B, R-1])")
    p = target_probs.float()
    q = node_probs.float()
    x = nodes.long().to(p.device)  # [B, N]
    u = torch.rand(b, n, generator=generator, device=p.device)  # [B, N] one uniform per node
    cur = torch.zeros(b, dtype=torch.long, device=p.device)  # [B] the current (deepest accepted) row
    r = p[:, 0]  # [B, V] the residual at the current node
    rows_ids = torch.arange(rows, device=p.device)  # [R]
    for j in range(1, rows):
        active = cur == t.parent[j]  # [B] node j is a child of the current node (its earlier siblings rejected)
        xj = x[:, j - 1 : j]  # [B, 1]
        qj = q[:, j - 1]  # [B, V]
        r_x, q_x = r.gather(1, xj)[:, 0], qj.gather(1, xj)[:, 0]  # [B], [B]
        accept = active & (u[:, j - 1] * q_x < r_x)  # u < r(x) / q(x) without dividing by q
        reject = active & ~accept
        r = torch.where(accept[:, None], p[:, j], torch.where(reject[:, None], residual(r, qj), r))
        cur = torch.where(accept, rows_ids[j], cur)
    nxt = torch.multinomial(r, 1, generator=generator)[:, 0]  # [B] from p at a leaf, else the last residual
    return t.depth[cur], cur, t.ancestors[cur], nxt


def tree_draft_problem(draft: Any) -> str | None:
    """Why ``propose_tree`` does not apply to ``draft`` (None when it does): it runs the DSpark block forward and
    picks every node's token itself, so it needs a ``DSparkDraft`` that keeps the base ``propose`` (the variant
    hooks block_inputs / markov_features / extra_kv / score_candidates are honoured, with the node's path as the
    block prefix; a variant that overrides ``propose``, such as draft_memory, is not)."""
    from dspark_core.draft.model import DSparkDraft

    if not isinstance(draft, DSparkDraft):
        return f"{type(draft).__name__} is not a DSparkDraft (a draft tree needs its block forward and heads)"
    if type(draft).propose is not DSparkDraft.propose:
        return f"{type(draft).__name__} overrides propose() (its per-proposal state has no tree form)"
    return None


@torch.no_grad()
def propose_tree(draft: Any, cache: Any, anchor: torch.Tensor, layout: TreeLayout, params: SamplingParams,
                 generator: torch.Generator | None, extras: Mapping[str, Any] | None = None) -> TreeProposal:
    """The draft tree of ``layout`` at ``anchor [1]`` (position ``cache.length``) by the rule of the module
    docstring: greedy picks at temperature 0 (the static engine's tree), draws from the processed q otherwise."""
    anchor = anchor.reshape(1).to(cache.k.device)  # [1]
    hidden = draft.forward_block(cache, anchor, extras)  # [1, S, H]
    base = draft.slot_logits(hidden)  # [1, S, V] float32
    depth, _, _, _, anc = layout.table()
    tok = torch.empty(layout.rows, dtype=torch.long, device=anchor.device)  # [R]
    tok[0] = anchor[0]
    probs = torch.empty(layout.nodes, base.shape[-1], dtype=torch.float32, device=anchor.device)  # [N, V]

    def draw(dist: torch.Tensor) -> torch.Tensor:  # [1, V] -> [1]
        if params.greedy:
            return dist.argmax(dim=-1)
        return torch.multinomial(dist, 1, generator=generator)[:, 0]

    states: dict[int, torch.Tensor | None] = {0: None}  # row -> the Markov head's state after it (rnn)
    for d, picks in enumerate(layout.markov_rows()):  # slot d: nodes at depth d + 1
        for prev, out, out2 in picks:
            prefix = tok[anc[prev][: depth[prev] + 1]].view(1, -1)  # [1, d+1] anchor .. the parent
            slot_extras = {**(extras or {}), "block_prefix": prefix}
            m = draft.markov_features(tok[prev : prev + 1], hidden[:, d], slot_extras)  # [1, r] | None
            logits = base[:, d]  # [1, V]
            if m is not None:  # the state follows the node's path: its parent's, then both children's
                u, states[out] = draft.markov_step(m, hidden[:, d], states[prev])  # [1, r]
                states[out2] = states[out]
                logits = logits + draft.markov_bias(u).float()
            logits = draft.score_candidates(logits, hidden[:, d], prefix, d, slot_extras)  # [1, V]
            q = logits_to_probs(logits, params)  # [1, V]
            x = draw(q)  # [1]
            tok[out], probs[out - 1] = x[0], q[0]
            if out2 >= 0:  # the branch starting here: without replacement of the main chain's token
                q2 = sibling_probs(q, x, logits)  # [1, V]
                tok[out2], probs[out2 - 1] = draw(q2)[0], q2[0]
    return TreeProposal(tokens=tok, probs=probs)
