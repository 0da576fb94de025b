"""The draft tree as data.

Node 0 is the root: the last accepted token, which the target has not processed yet. Every other node holds a
drafted token, the index of its parent, its depth (root = 0) and its score: the product of the draft
probabilities along the path from the root (EAGLE-2's confidence, the utility CAST sums). Nodes are stored in
topological order (a parent's index is smaller than its children's), so one pass over the nodes can build any
per-node quantity that depends on the ancestors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Proposal:
    """How a node's children were drawn when the drafter samples: `tokens` in draw order, without replacement,
    from the distribution `q` [V]. Verification needs every drawn token, also the ones the policy did not keep."""

    tokens: list[int]
    q: torch.Tensor


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [n] int64
    parents: torch.Tensor  # [n] int64, root's parent is -1
    scores: torch.Tensor  # [n] float32, root's score is 1
    depths: torch.Tensor  # [n] int64
    proposals: dict[int, Proposal] = field(default_factory=dict, compare=False)  # sampled drafting only
    # per node, the match length a lookup drafter proposed it from (Candidates.matched); None: a model drafter's
    matched: list[int] | None = field(default=None, compare=False)

    @staticmethod
    def single(root_token: int) -> DraftTree:
        """The tree of plain autoregressive decoding: the root alone."""
        return DraftTree(
            torch.tensor([root_token]), torch.tensor([-1]), torch.tensor([1.0]), torch.tensor([0])
        )

    @staticmethod
    def chain(tokens: list[int]) -> DraftTree:
        """A chain: each token the child of the one before (cost probes and warm-ups verify these)."""
        return DraftTree.from_lists(tokens, list(range(-1, len(tokens) - 1)), [1.0] * len(tokens))

    @staticmethod
    def from_lists(tokens: list[int], parents: list[int], scores: list[float],
                   proposals: dict[int, Proposal] | None = None) -> DraftTree:
        if not tokens or parents[0] != -1:
            raise ValueError("a tree needs a root at index 0 with parent -1")
        depths = [0] * len(tokens)
        for i in range(1, len(tokens)):
            if not 0 <= parents[i] < i:
                raise ValueError(f"node {i} has parent {parents[i]}: parents must come before their children")
            depths[i] = depths[parents[i]] + 1
        return DraftTree(
            torch.tensor(tokens, dtype=torch.long),
            torch.tensor(parents, dtype=torch.long),
            torch.tensor(scores, dtype=torch.float32),
            torch.tensor(depths, dtype=torch.long),
            dict(proposals or {}),
        )

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: entry (i, j) is True when j is i itself or one of its ancestors."""
        return ancestor_masks([self], len(self))[0]

    def position_ids(self, past_length: int) -> torch.Tensor:
        return self.depths + past_length

    def attention_mask(self, past_length: int) -> torch.Tensor:
        """[1, 1, n, past + n] bool: every node sees the whole cached prefix and its own ancestors only."""
        n = len(self)
        prefix = torch.ones(n, past_length, dtype=torch.bool)
        return torch.cat([prefix, self.ancestor_mask()], dim=1)[None, None]

    def children(self, node: int) -> list[int]:
        return (self.parents == node).nonzero().flatten().tolist()

    def path_to(self, node: int) -> list[int]:
        """Indices from the root's first child down to `node` (empty for the root)."""
        parents = self.parents.tolist()
        path = []
        while node > 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def leaves(self) -> list[int]:
        has_child = torch.zeros(len(self), dtype=torch.bool)
        has_child[self.parents[1:]] = True
        return (~has_child).nonzero().flatten().tolist()

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path as node indices, root included."""
        return [[0, *self.path_to(leaf)] for leaf in self.leaves()]

    def subtree(self, keep: list[int] | torch.Tensor) -> DraftTree:
        """The tree restricted to `keep` (which must contain the root and be closed under taking parents)."""
        keep = torch.as_tensor(keep, dtype=torch.long).sort().values
        if keep.numel() == 0 or int(keep[0]) != 0:
            raise ValueError("a subtree must keep the root")
        new_index = torch.full((len(self),), -1, dtype=torch.long)
        new_index[keep] = torch.arange(keep.numel())
        parents = self.parents[keep]
        new_parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents)
        if bool((new_parents[1:] < 0).any()):
            raise ValueError("the kept nodes are not closed under taking parents")
        kept = set(keep.tolist())
        proposals = {int(new_index[node]): prop for node, prop in self.proposals.items() if node in kept}
        return DraftTree(self.tokens[keep], new_parents, self.scores[keep], self.depths[keep], proposals)


class TreePool:
    """A tree while it is being drafted: plain lists that grow by appending, with each node's path kept, so that
    neither the drafting loop nor a drafter rebuilds anything per layer. What drafters' `expand` receives."""

    def __init__(self, root_token: int) -> None:
        self.tokens, self.parents, self.depths = [root_token], [-1], [0]
        self._paths: list[list[int]] = [[]]

    def append(self, tokens: Sequence[int], parents: Sequence[int]) -> range:
        """Add nodes (parents already in the pool); returns their indices."""
        first = len(self.tokens)
        for parent in parents:
            if not 0 <= parent < len(self._paths):
                raise ValueError(f"parent {parent} is not in the pool yet")
            self._paths.append(self._paths[parent] + [len(self._paths)])
            self.depths.append(self.depths[parent] + 1)
        self.tokens += tokens
        self.parents += parents
        return range(first, len(self.tokens))

    @staticmethod
    def from_lists(tokens: list[int], parents: list[int]) -> TreePool:
        pool = TreePool(tokens[0])
        pool.append(tokens[1:], parents[1:])
        return pool

    def __len__(self) -> int:
        return len(self.tokens)

    def path_to(self, node: int) -> list[int]:
        """Indices from the root's first child down to `node` (empty for the root); do not modify."""
        return self._paths[node]

    def tree(self, scores: list[float], proposals: dict[int, Proposal] | None = None,
             matched: list[int] | None = None) -> DraftTree:
        return DraftTree(torch.tensor(self.tokens, dtype=torch.long), torch.tensor(self.parents, dtype=torch.long),
                         torch.tensor(scores, dtype=torch.float32), torch.tensor(self.depths, dtype=torch.long),
                         dict(proposals or {}), None if matched is None else list(matched))


_BIT_WIDTH = 62  # node sets as the bits of an int64, its sign bit left alone


def padded_rows(rows: list[torch.Tensor], width: int, fill: int) -> torch.Tensor:
    """1-D tensors as the rows of one [len(rows), width] tensor, right-padded with `fill`."""
    out = torch.full((len(rows), width), fill, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def ancestor_masks(trees: list[DraftTree], width: int) -> torch.Tensor:
    """[B, width, width] bool: row b's `ancestor_mask`, padded (a padding node sees only itself). Trees up to
    `_BIT_WIDTH` wide (every verified tree but a long profile chain) are walked in Python, each node's ancestor
    set an integer's bits (its parent's, plus itself), and unpacked in one shift: a few tensor ops for the whole
    batch, where the level-by-level indexing below took ~0.4 ms on a 2-core CPU for a 16-node tree."""
    if width <= _BIT_WIDTH:
        bits = []
        for tree in trees:
            row: list[int] = []
            for parent in tree.parents.tolist():
                row.append((row[parent] if parent >= 0 else 0) | 1 << len(row))
            bits.append(row + [1 << i for i in range(len(row), width)])
        return (torch.tensor(bits, dtype=torch.long)[:, :, None] >> torch.arange(width)) & 1 == 1
    # wider: every node's k-th ancestor is marked at step k, one tree level at a time for the whole batch
    parents = padded_rows([t.parents for t in trees], width, -1)
    mask = torch.eye(width, dtype=torch.bool).repeat(len(trees), 1, 1)
    rows = torch.arange(len(trees))[:, None].expand_as(parents)
    nodes = torch.arange(width)[None].expand_as(parents)
    ancestor = parents
    for _ in range(max(t.max_depth for t in trees)):
        has = ancestor >= 0
        mask[rows[has], nodes[has], ancestor[has]] = True
        ancestor = torch.where(has, parents.gather(1, ancestor.clamp(min=0)), ancestor)
    return mask
