"""Static draft trees for greedy verification: the main chain plus side branches, verified in one forward.

A DSpark block proposes a chain of S tokens (greedy Markov slots). With ``mma`` kernels the target verifies up
to 16 rows for the price of one, so the spare rows can carry alternatives: a *branch* ``(start, length)``
is the draft's second-best token at depth ``start`` (given the main chain before it) followed by the greedy
Markov continuation of ``length - 1`` more slots. Rows of the verify step::

    row 0                 the anchor (logical position p)
    rows 1..S             the main chain, depth d at row d (position p + d)
    then each branch      its nodes at depths start .. start + length - 1, one row each

Every node sees the anchor's prefix and its own ancestors only. A node at depth d sits at logical position
p + d (its RoPE position) but is written to cache slot p + row; its ancestors at depths < start are main-chain
rows (slot = position) and those at depths >= start are its own branch's rows, stored consecutively. So one
rule per row gives every key's slot: keys at logical positions >= ``pos - back`` are read ``offset`` slots
further (``back`` = depth - start, ``offset`` = row - depth; both 0 on the main chain). The decode kernels
read keys in logical order through this rule, so each node's attention sums in exactly the order of an AR
step at its position: a verified node is bit for bit what AR would compute there (batch-invariant kernels).

Acceptance (greedy): a node is accepted when its parent is and the target's argmax at the parent's row equals
its token. Siblings hold different tokens (top-1 vs top-2 of one distribution), so at most one node per depth
is accepted; the deepest accepted node ``w`` (depth a) gives the committed tokens (its path) and the bonus
(the argmax at its row). The draft's context K/V of every row are written like the target's (RoPE at the
logical position, in the row's slot); after acceptance the winning branch's K/V, in both caches, move from their
rows' slots to slots p+1..p+a (``StaticSpeculativeDecoder``; on the GPU inside the accept kernel).

Sampling mode (the reference engine, ``SpeculativeDecoder(tree_branches=...)``): the branch token is drawn from the
draft's distribution without replacement of the main chain's token, and the tree is verified exactly by recursive
rejection sampling over siblings (``dspark_core.decoding.tree_sampling``).

Shape legend: S block size (main-chain depth), N nodes (S + branch lengths), R = N + 1 verify rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple

import torch

MAX_ROWS = 16  # the decode kernels' widest step


class TreeTensors(NamedTuple):
    """The layout as device tensors (made once; static across cycles)."""

    depth: torch.Tensor  # [R] long: logical position - p
    offset: torch.Tensor  # [R] int32: cache slot - logical position
    back: torch.Tensor  # [R] int32: keys at logical >= pos - back are read at + offset
    parent: torch.Tensor  # [R] long: parent row (0 for the anchor itself)
    ancestors: torch.Tensor  # [R, S+1] long: row of the ancestor at each depth (identity beyond the node)


@dataclass(frozen=True)
class TreeLayout:
    """Main chain of ``block_size`` tokens + ``branches`` ((start, length), ...); see the module docstring."""

    block_size: int
    branches: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        s = self.block_size
        starts = [b[0] for b in self.branches]
        for start, length in self.branches:
            if not 1 <= start <= s or length < 1 or start + length - 1 > s:
                raise ValueError(f"tree branch (start {start}, length {length}): needs 1 <= start <= {s} and "
                                 f"start + length - 1 <= block_size {s}")
        if len(set(starts)) != len(starts):
            raise ValueError(f"tree branches {list(self.branches)}: two branches start at the same depth (both "
                             "would hold the same second-best token)")
        if self.rows > MAX_ROWS:
            raise ValueError(f"tree of {self.rows} verify rows (anchor + {s} + branch lengths "
                             f"{[b[1] for b in self.branches]}) exceeds the kernels' {MAX_ROWS}")

    @property
    def nodes(self) -> int:
        return self.block_size + sum(length for _, length in self.branches)

    @property
    def rows(self) -> int:
        return self.nodes + 1

    @property
    def is_chain(self) -> bool:
        return not self.branches

    def branch_rows(self) -> list[tuple[int, int, int]]:
        """(first row, start depth, length) of each branch."""
        out, row = [], self.block_size + 1
        for start, length in self.branches:
            out.append((row, start, length))
            row += length
        return out

    def table(self) -> tuple[list[int], list[int], list[int], list[int], list[list[int]]]:
        """Per row: depth, offset, back, parent, ancestors (lists; see ``TreeTensors``)."""
        s = self.block_size
        depth, offset, back, parent = [0], [0], [0], [0]
        anc = [list(range(s + 1))]
        for d in range(1, s + 1):
            depth.append(d), offset.append(0), back.append(0), parent.append(d - 1)
            anc.append(list(range(s + 1)))
        for first, start, length in self.branch_rows():
            for j in range(length):
                row, d = first + j, start + j
                depth.append(d), offset.append(row - d), back.append(j)
                parent.append(start - 1 if j == 0 else row - 1)
                path = list(range(start)) + [first + i for i in range(j + 1)]  # rows at depths 0..d
                anc.append(path + list(range(d + 1, s + 1)))
        return depth, offset, back, parent, anc

    def markov_rows(self) -> list[list[tuple[int, int, int]]]:
        """Per depth d = 1..S, the draft's Markov picks at that slot as (prev, out, out2) rows of the token buffer
        [anchor, node 1 .. node N] (index = verify row): the main chain's (out2 = the first row of the branch
        starting at d, else -1) and each branch's continuation through d."""
        s = self.block_size
        first_at = {start: first for first, start, _ in self.branch_rows()}
        out = [[(d - 1, d, first_at.get(d, -1))] for d in range(1, s + 1)]
        for first, start, length in self.branch_rows():
            for j in range(1, length):
                out[start + j - 1].append((first + j - 1, first + j, -1))
        return out

    def tensors(self, device: torch.device | str) -> TreeTensors:
        depth, offset, back, parent, anc = self.table()
        return TreeTensors(torch.tensor(depth, device=device), torch.tensor(offset, dtype=torch.int32, device=device),
                           torch.tensor(back, dtype=torch.int32, device=device), torch.tensor(parent, device=device),
                           torch.tensor(anc, device=device))


def parse_branches(spec: str | Iterable) -> tuple[tuple[int, int], ...]:
    """Branches from "1:3,2:1" or [[1, 3], [2, 1]] (start depth, length); ValueError on anything else."""
    if isinstance(spec, str):
        items = [part.split(":") for part in spec.replace(" ", "").split(",") if part]
    else:
        items = list(spec)
    out = []
    for item in items:
        try:
            start, length = (int(v) for v in item)
        except (TypeError, ValueError):
            raise ValueError(f"tree_branches: {item!r} is not a (start, length) pair of integers") from None
        out.append((start, length))
    return tuple(out)


def top2_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, argmax without it) of logits [1, V] -> two [1] int64 (ties: the lowest id, as torch.argmax)."""
    first = logits.argmax(dim=-1)  # [1]
    second = logits.scatter(-1, first.view(1, 1), float("-inf")).argmax(dim=-1)  # [1]
    return first, second


def tree_accept_reference(logits: torch.Tensor, nodes: torch.Tensor, t: TreeTensors
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree acceptance as static-shape device ops: logits [R, V], node tokens [N] ->
    (a [] accepted depth, w [] winning row, path [S+1] rows of its ancestors (identity beyond a), bonus [])."""
    best = logits.argmax(dim=-1)  # [R]
    ok = torch.cat([torch.ones(1, dtype=torch.bool, device=best.device), best[t.parent[1:]] == nodes])  # [R]
    e = torch.arange(t.ancestors.shape[1], device=best.device)  # [S+1]
    need = (e >= 1) & (e <= t.depth[:, None])  # [R, S+1] the ancestors that must hold
    accepted = ~(need & ~ok[t.ancestors]).any(dim=1)  # [R]
    score = torch.where(accepted, t.depth, torch.full_like(t.depth, -1))  # [R]
    w = score.argmax()  # the deepest accepted row (unique per depth; the anchor when none)
    return score[w], w, t.ancestors[w], best[w]

