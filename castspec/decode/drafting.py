"""Growing one step's draft tree: the drafter proposes, the policy decides widths, depth and verify budget."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from castspec.decode.constraints import Constraint
from castspec.decode.tree import DraftTree, Proposal, TreePool
from castspec.drafters.base import Candidates, Drafter
from castspec.policies.base import Policy, StepContext


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


class _Pool(TreePool):
    """Every node drafted this step for one row, in topological order, best first within a layer. A node's score
    is the product of draft probabilities along its path; its utility (what the policy ranks and buys by) is, by
    default, the same, or the policy's own estimate (`Policy.node_utility`)."""

    def __init__(self, root_token: int) -> None:
        super().__init__(root_token)
        self.scores, self.utilities = [1.0], [1.0]
        self.matched: list[int] | None = [0]  # each node's match length (a lookup drafter's), None: a model's
        self.proposals: dict[int, Proposal] = {}

    def tree(self, keep: list[int] | None = None) -> DraftTree:
        """The pool as a tree, or only the nodes `keep` (ancestor-closed, the root among them)."""
        if keep is None:
            return super().tree(self.scores, self.proposals, self.matched)
        keep = sorted(keep)
        new_index = {node: i for i, node in enumerate(keep)}
        parents = [-1] + [new_index[self.parents[node]] for node in keep[1:]]
        proposals = {new_index[node]: prop for node, prop in self.proposals.items() if node in new_index}
        tokens, parents, depths = torch.tensor([[self.tokens[n] for n in keep], parents,
                                                [self.depths[n] for n in keep]], dtype=torch.long)
        return DraftTree(tokens, parents, torch.tensor([self.scores[n] for n in keep], dtype=torch.float32), depths,
                         proposals, None if self.matched is None else [self.matched[n] for n in keep])


def _add_layers(pools: list[_Pool], frontiers: list[list[int]], cands: list[Candidates],
                policy: Policy | None = None, layer: int = 1) -> tuple[list[list[int]], torch.Tensor]:
    """Append every row's frontier children (the nodes of depth `layer`) to its pool, best first (draw order among
    equals). Returns each row's new node indices and their utilities, one row per pool [B, n] padded with 0 (what
    `Policy.width` reads). The utilities are one batch of tensor products (the policy's calibration works on
    tensors); the scores (draft probability products) and the ranking are plain Python: a layer has a few dozen
    candidates, and on so few the dispatch of a dozen small tensor ops (nonzero, sorts, bincount, gathers) cost
    ~0.4 ms a layer."""
    k = max(c.probs.shape[1] for c in cands)

    def stacked(part: str) -> torch.Tensor:
        if len(cands) == 1:
            return getattr(cands[0], part).cpu()
        parts = [getattr(c, part).cpu() for c in cands]
        return torch.cat([p if p.shape[1] == k else torch.nn.functional.pad(p, (0, k - p.shape[1])) for p in parts])

    probs, tokens = stacked("probs"), stacked("tokens")  # [sum of frontier sizes, k]
    flat_parents = [(b, node) for b, frontier in enumerate(frontiers) for node in frontier]
    parent_utilities = torch.tensor([pools[b].utilities[node] for b, node in flat_parents])[:, None]
    parent_rows = [b for b, _ in flat_parents]
    # a lookup drafter's match length per expanded node (its children's): None where a drafter gives none
    matched = None if any(c.matched is None for c in cands) else [m for c in cands for m in c.matched]
    if policy is not None:
        utilities = policy.node_utility(probs, parent_utilities, layer, parent_rows, matched)
    else:
        utilities = probs * parent_utilities
    prob_rows, token_rows = probs.tolist(), tokens.tolist()
    utility_rows = utilities.reshape(len(flat_parents), k).tolist()
    # per row: (-utility, draw index, token, score, parent, match length); sorting ranks by utility, then draw order
    ranked: list[list[tuple[float, int, int, float, int, int]]] = [[] for _ in pools]
    for i, (b, parent) in enumerate(flat_parents):
        parent_score = pools[b].scores[parent]
        length = matched[i] if matched is not None else 0
        for j, prob in enumerate(prob_rows[i]):
            if prob > 0:
                ranked[b].append((-utility_rows[i][j], i * k + j, token_rows[i][j], prob * parent_score, parent,
                                  length))
    size = max((len(entries) for entries in ranked), default=0)
    nodes, padded = [], []
    for pool, entries in zip(pools, ranked, strict=True):
        entries.sort()
        nodes.append(list(pool.append([e[2] for e in entries], [e[4] for e in entries])))
        pool.scores += [e[3] for e in entries]
        if matched is None:
            pool.matched = None
        elif pool.matched is not None:
            pool.matched += [e[5] for e in entries]
        row_utilities = [-e[0] for e in entries]
        pool.utilities += row_utilities
        padded.append(row_utilities + [0.0] * (size - len(entries)))
    return nodes, torch.tensor(padded, dtype=torch.float32).reshape(len(pools), size)


def _record_proposals(pools: list[_Pool], frontiers: list[list[int]], cands: list[Candidates]) -> None:
    """Sampled drafting: every token drawn at a node, in draw order, with the distribution it was drawn from
    (verification needs them all, also the ones the grammar or the policy leave out of the tree)."""
    for pool, frontier, c in zip(pools, frontiers, cands, strict=True):
        if c.proposal is not None:
            for row, node in enumerate(frontier):
                pool.proposals[node] = Proposal(c.tokens[row][c.probs[row] > 0].tolist(), c.proposal[row])


def _constrain(pools: list[_Pool], frontiers: list[list[int]], cands: list[Candidates],
               constraints: list[Constraint | None]) -> list[Candidates]:
    """Grammar-aware candidates: a child the grammar forbids after its parent's path is dropped (probability
    0), and where the grammar allows one token only, that token is the one child, with probability 1 (the
    target's masked distribution is certain there, so the policy prices it as certain)."""
    out = []
    for pool, frontier, c, constraint in zip(pools, frontiers, cands, constraints, strict=True):
        if constraint is None or not frontier:
            out.append(c)
            continue
        tokens, probs = c.tokens.cpu().clone(), c.probs.cpu().float().clone()
        for row, node in enumerate(frontier):
            path = [pool.tokens[n] for n in pool.path_to(node)]
            taken = constraint.enter(path)
            try:  # a path the grammar ends early (past an end of sequence) gets no children
                allowed, forced = (constraint.check_children(tokens[row].tolist()) if taken == len(path)
                                   else ([False] * tokens.shape[1], None))
            finally:
                constraint.leave(taken)
            if forced is not None:
                tokens[row], probs[row] = forced, 0.0
                probs[row, 0] = 1.0
                pool.proposals.pop(node, None)  # a certain child: deterministic verification accepts it surely
            else:
                probs[row, ~torch.tensor(allowed)] = 0.0
        out.append(Candidates(tokens, probs, matched=c.matched))
    return out


def grow_trees(
    drafter: Drafter, policy: Policy, new_tokens: list[list[int]], ctx: StepContext,
    features: list[torch.Tensor] | None = None, clock: Callable[[], float] | None = None,
    constraints: list[Constraint | None] | None = None,
) -> tuple[list[DraftTree], DraftRecord]:
    """Draft one tree per row, rooted at new_tokens[b][-1]. The batch shares one width per layer and one verify
    budget (METHOD.md section 3); each row expands and keeps its own best nodes. With a `clock`, every drafter
    call is timed into `record.forwards` (for an online cost model). `constraints[b]`: row b's grammar, in the
    state after its root (its candidates are checked against it)."""
    grammar = constraints is not None and any(c is not None for c in constraints)
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
            _record_proposals(pools, frontiers, cands)
            if grammar:
                cands = _constrain(pools, frontiers, cands, constraints)
            nodes, utilities = _add_layers(pools, frontiers, cands, policy, layer)
            added = sum(len(n) for n in nodes)
            width = policy.width(layer, utilities, ctx) if added else 0
            record.layer_sizes.append(added)
            record.widths.append(width)
            if width == 0 or layer >= ctx.depth_limit:
                break
            frontiers = [n[:width] for n in nodes]
            start = clock() if clock else 0.0
            cands = drafter.expand(pools, frontiers, policy.top_k)
            if clock:
                record.forwards.append((drafted, max(len(f) for f in frontiers), clock() - start))
            drafted += width
            layer += 1
    finally:
        drafter.end_step()
    record.decisions = dict(getattr(policy, "trace", {}))
    if all(len(pool) == 1 for pool in pools):
        return [pool.tree() for pool in pools], record
    # rank by utility, ties broken by depth so that a parent always outranks its child (ancestor-closed set:
    # a child's utility never exceeds its parent's), then by drafting order; a Python sort, as in `_add_layers`
    ranked = [sorted(range(1, len(pool)), key=lambda node, pool=pool: (-pool.utilities[node], pool.depths[node]))
              for pool in pools]
    size = max(len(row) for row in ranked)
    scores = torch.tensor([[max(pool.utilities[node], 0.0) for node in row] + [0.0] * (size - len(row))
                           for pool, row in zip(pools, ranked, strict=True)], dtype=torch.float32)  # padding: 0
    budget = max(0, min(policy.verify_budget(scores, ctx), scores.shape[1]))
    record.verify_budget = budget
    record.decisions = dict(getattr(policy, "trace", {}))
    trees = [pool.tree([0, *row[:budget]]) for pool, row in zip(pools, ranked, strict=True)]
    return trees, record


def grow_tree(
    drafter: Drafter, policy: Policy, new_tokens: list[int], ctx: StepContext
) -> tuple[DraftTree, DraftRecord]:
    """One sequence's tree (a batch of one)."""
    trees, record = grow_trees(drafter, policy, [new_tokens], ctx)
    return trees[0], record
