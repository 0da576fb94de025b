"""Growing one step's draft tree: the drafter proposes, the policy decides widths, depth and verify budget."""

from __future__ import annotations

from collections.abc import Callable
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
    # timed drafter calls when a clock was given: (context added this step, new tokens per row, seconds)
    forwards: list[tuple[int, int, float]] = field(default_factory=list)

    @property
    def depth(self) -> int:
        return sum(1 for size in self.layer_sizes if size > 0)

    @property
    def pool_size(self) -> int:
        return sum(self.layer_sizes)


class _Pool:
    """Every node drafted this step, in topological order, best first within a layer. A node's score is the
    product of draft probabilities along its path; its utility (what the policy ranks and buys by) is, by default,
    the same, or the policy's own estimate (`Policy.node_utility`)."""

    def __init__(self, root_token: int) -> None:
        self.tokens, self.parents, self.scores, self.utilities = [root_token], [-1], [1.0], [1.0]
        self.proposals: dict[int, Proposal] = {}

    def add_layer(self, frontier: list[int], cands: Candidates, policy: Policy | None = None
                  ) -> tuple[list[int], torch.Tensor]:
        """Append the frontier's children, best first; returns their pool indices and sorted utilities."""
        if cands.proposal is not None:
            for row, node in enumerate(frontier):
                drawn = cands.tokens[row][cands.probs[row] > 0].tolist()
                self.proposals[node] = Proposal(drawn, cands.proposal[row])
        parent_scores = torch.tensor([self.scores[p] for p in frontier])[:, None]
        parent_utilities = torch.tensor([self.utilities[p] for p in frontier])[:, None]
        probs = cands.probs.cpu()
        scores = (probs * parent_scores).flatten()
        utilities = (policy.node_utility(probs, parent_utilities) if policy is not None else
                     probs * parent_utilities).flatten()
        parents = torch.tensor(frontier).repeat_interleave(cands.probs.shape[1])
        tokens = cands.tokens.flatten().cpu()
        real = probs.flatten() > 0
        scores, utilities, parents, tokens = scores[real], utilities[real], parents[real], tokens[real]
        order = torch.sort(utilities, descending=True, stable=True).indices
        first = len(self.tokens)
        self.tokens += tokens[order].tolist()
        self.parents += parents[order].tolist()
        self.scores += scores[order].tolist()
        self.utilities += utilities[order].tolist()
        return list(range(first, len(self.tokens))), utilities[order]

    def tree(self) -> DraftTree:
        return DraftTree.from_lists(self.tokens, self.parents, self.scores, self.proposals)


def _padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """Per-row score vectors (each sorted decreasing) as one [B, n] matrix padded with zeros."""
    width = max((r.numel() for r in rows), default=0)
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : r.numel()] = r
    return out


def grow_trees(
    drafter: Drafter, policy: Policy, new_tokens: list[list[int]], ctx: StepContext,
    features: list[torch.Tensor] | None = None, clock: Callable[[], float] | None = None,
) -> tuple[list[DraftTree], DraftRecord]:
    """Draft one tree per row, rooted at new_tokens[b][-1]. The batch shares one width per layer and one verify
    budget (METHOD.md section 3); each row expands and keeps its own best nodes. With a `clock`, every drafter
    call is timed into `record.forwards` (for an online cost model)."""
    record = DraftRecord()
    policy.start_step(ctx)
    pools = [_Pool(tokens[-1]) for tokens in new_tokens]
    start = clock() if clock else 0.0
    cands = drafter.begin(new_tokens, policy.top_k, features)
    if clock:
        record.forwards.append((0, max(len(t) for t in new_tokens), clock() - start))
    frontiers, layer, drafted = [[0] for _ in pools], 1, 0
    try:
        while True:
            layers = [pool.add_layer(f, c, policy) for pool, f, c in zip(pools, frontiers, cands, strict=True)]
            added = sum(len(nodes) for nodes, _ in layers)
            width = policy.width(layer, _padded([scores for _, scores in layers]), ctx) if added else 0
            record.layer_sizes.append(added)
            record.widths.append(width)
            if width == 0 or layer >= ctx.depth_limit:
                break
            frontiers = [nodes[:width] for nodes, _ in layers]
            start = clock() if clock else 0.0
            cands = drafter.expand([pool.tree() for pool in pools], frontiers, policy.top_k)
            if clock:
                record.forwards.append((drafted, max(len(f) for f in frontiers), clock() - start))
            drafted += width
            layer += 1
    finally:
        drafter.end_step()
    fulls = [pool.tree() for pool in pools]
    record.decisions = dict(getattr(policy, "trace", {}))
    if all(len(full) == 1 for full in fulls):
        return fulls, record
    # rank by utility, ties broken by depth so that a parent always outranks its child (ancestor-closed set:
    # a child's utility never exceeds its parent's)
    utilities = [torch.tensor(pool.utilities, dtype=torch.float64) for pool in pools]
    ranked = [torch.sort(u[1:] - f.depths[1:].double() * 1e-12, descending=True, stable=True).indices + 1
              for u, f in zip(utilities, fulls, strict=True)]
    scores = _padded([u[r].float() for u, r in zip(utilities, ranked, strict=True)])
    budget = max(0, min(policy.verify_budget(scores, ctx), scores.shape[1]))
    record.verify_budget = budget
    record.decisions = dict(getattr(policy, "trace", {}))
    trees = [f.subtree(torch.cat([torch.tensor([0]), r[:budget]])) for f, r in zip(fulls, ranked, strict=True)]
    return trees, record


def grow_tree(
    drafter: Drafter, policy: Policy, new_tokens: list[int], ctx: StepContext
) -> tuple[DraftTree, DraftRecord]:
    """One sequence's tree (a batch of one)."""
    trees, record = grow_trees(drafter, policy, [new_tokens], ctx)
    return trees[0], record
