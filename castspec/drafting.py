"""Growing one step's draft tree: the drafter proposes, the policy decides widths, depth and verify budget."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from castspec.drafters.base import Candidates, Drafter
from castspec.policies import Policy, StepContext
from castspec.tree import DraftTree, Proposal


@dataclass
class DraftRecord:
    """What the policy chose this step: candidates drafted and nodes expanded per layer, verify budget."""

    layer_sizes: list[int] = field(default_factory=list)  # candidates drafted at depth 1, 2, ...
    widths: list[int] = field(default_factory=list)  # how many of them were expanded (the last is 0)
    verify_budget: int = 0
    decisions: dict = field(default_factory=dict)  # the policy's own account of its choices, if it keeps one

    @property
    def depth(self) -> int:
        return sum(1 for size in self.layer_sizes if size > 0)

    @property
    def pool_size(self) -> int:
        return sum(self.layer_sizes)


class _Pool:
    """Every node drafted this step, in topological order, best-scored first within a layer."""

    def __init__(self, root_token: int) -> None:
        self.tokens, self.parents, self.scores = [root_token], [-1], [1.0]
        self.proposals: dict[int, Proposal] = {}

    def add_layer(self, frontier: list[int], cands: Candidates) -> tuple[list[int], torch.Tensor]:
        """Append the frontier's children, best first; returns their pool indices and sorted scores."""
        if cands.proposal is not None:
            for row, node in enumerate(frontier):
                drawn = cands.tokens[row][cands.probs[row] > 0].tolist()
                self.proposals[node] = Proposal(drawn, cands.proposal[row])
        parent_scores = torch.tensor([self.scores[p] for p in frontier])
        scores = (cands.probs * parent_scores[:, None]).flatten()
        parents = torch.tensor(frontier).repeat_interleave(cands.probs.shape[1])
        tokens = cands.tokens.flatten().cpu()
        real = cands.probs.flatten() > 0
        scores, parents, tokens = scores[real], parents[real], tokens[real]
        order = torch.sort(scores, descending=True, stable=True).indices
        first = len(self.tokens)
        self.tokens += tokens[order].tolist()
        self.parents += parents[order].tolist()
        self.scores += scores[order].tolist()
        return list(range(first, len(self.tokens))), scores[order]

    def tree(self) -> DraftTree:
        return DraftTree.from_lists(self.tokens, self.parents, self.scores, self.proposals)


def grow_tree(
    drafter: Drafter, policy: Policy, new_tokens: list[int], ctx: StepContext
) -> tuple[DraftTree, DraftRecord]:
    """Draft a tree rooted at new_tokens[-1] and cut it to the policy's verify budget."""
    record = DraftRecord()
    policy.start_step(ctx)
    pool = _Pool(new_tokens[-1])
    cands = drafter.begin(new_tokens, policy.top_k)
    frontier, layer = [0], 1
    try:
        while True:
            added, scores = pool.add_layer(frontier, cands)
            width = policy.width(layer, scores, ctx) if added else 0
            record.layer_sizes.append(len(added))
            record.widths.append(width)
            if width == 0 or layer >= ctx.depth_limit:
                break
            frontier = added[:width]
            cands = drafter.expand(pool.tree(), frontier, policy.top_k)
            layer += 1
    finally:
        drafter.end_step()
    full = pool.tree()
    drafted = len(full) - 1
    if drafted == 0:
        record.decisions = dict(getattr(policy, "trace", {}))
        return full, record
    # rank by score, ties broken by depth so that a parent always outranks its child (ancestor-closed set)
    key = full.scores[1:].double() - full.depths[1:].double() * 1e-12
    ranked = torch.sort(key, descending=True, stable=True).indices + 1
    budget = max(0, min(policy.verify_budget(full.scores[ranked], ctx), drafted))
    record.verify_budget = budget
    record.decisions = dict(getattr(policy, "trace", {}))
    return full.subtree(torch.cat([torch.tensor([0]), ranked[:budget]])), record
