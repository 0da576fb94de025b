"""Verification: which drafted nodes the target accepts, and the token that follows them. Pure tensor code.

Greedy: walk into the child holding the target's argmax. Sampling: at each node the emitted token must be
distributed exactly as the target's (warped) distribution p there, whatever the drafter proposed:

- deterministic candidates (top-k, n-gram): sequential rejection. Try the children in order; accept x with
  probability p(x); on rejection set p(x) = 0 and renormalise. If every child is rejected, draw from what is
  left of p. (Each child is accepted with exactly its share of p, so the emitted token is distributed as p.)
- sampled candidates (drawn without replacement from the drafter's q, in draw order): recursive rejection
  sampling. Accept x_i with probability min(1, p(x_i) / q_i(x_i)); on rejection p <- norm(max(p - q_i, 0)) and
  q_{i+1} = q_i without x_i, renormalised; draw from the final residual p if all are rejected. A drawn token the
  policy cut from the tree may still be accepted: it is then emitted and the step ends there.

Both rules are the single-draft rejection lemma applied recursively: P(emit y) = min(p, q)(y) + P(reject) *
residual(y) = p(y).

Under a grammar (`Constraint`), p at a node is the target's distribution masked to what the grammar allows after
that node's path: the walk advances the request's matcher by each token it emits, so each node it reaches is
judged in its own path's state, and a forbidden node has p = 0 and is never accepted.
"""

from __future__ import annotations

import torch

from castspec.decode.constraints import Constraint
from castspec.decode.sampling import SamplingParams, draw, warp
from castspec.decode.tree import DraftTree, Proposal


def greedy_accept(tree: DraftTree, target_logits: torch.Tensor, constraint: Constraint | None = None
                  ) -> tuple[list[int], int]:
    """Walk down from the root, each time into the child holding the target's argmax at the current node.

    Returns the accepted path (node indices, root excluded) and the bonus token: the target's argmax at the
    last accepted node. Emitting path tokens + bonus is exactly what greedy decoding would emit. With a
    constraint, the argmax of the masked logits, and the constraint has consumed path tokens + bonus."""
    if constraint is not None:
        def choice(node: int) -> int:
            token = int(constraint.mask(target_logits[node]).argmax())
            constraint.advance(token)
            return token
    elif target_logits.device.type == "cpu":
        # on a CPU an argmax scans a node's whole vocabulary: take it only at the nodes the walk reaches
        def choice(node: int) -> int:
            return int(target_logits[node].argmax())
    else:  # on a GPU every node's argmax is one kernel, and one transfer beats one per node
        choice = target_logits.argmax(dim=-1).tolist().__getitem__
    child_of = child_index(tree)
    path, node, token = [], 0, choice(0)
    while (node, token) in child_of:
        node = child_of[(node, token)]
        path.append(node)
        token = choice(node)
    return path, token


def child_index(tree: DraftTree) -> dict[tuple[int, int], int]:
    """(parent node, token) -> the first child of that parent holding that token."""
    child_of: dict[tuple[int, int], int] = {}
    for node, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True)):
        if node > 0:
            child_of.setdefault((parent, token), node)
    return child_of


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand((), generator=generator))


def _normalised(dist: torch.Tensor) -> torch.Tensor | None:
    total = float(dist.sum())
    return dist / total if total > 0 else None


def emit_from_candidates(p: torch.Tensor, candidates: list[int], generator: torch.Generator) -> int:
    """Sequential rejection over deterministic candidates; returns the emitted token (a candidate or not)."""
    p = p.clone()
    for token in candidates:
        if _uniform(generator) < float(p[token]):
            return token
        p[token] = 0
        p = _normalised(p)
        if p is None:  # the candidates held all of p's mass; unreachable except through rounding
            return token
    return draw(p, generator)


def emit_from_proposal(p: torch.Tensor, proposal: Proposal, generator: torch.Generator) -> int:
    """Recursive rejection sampling over tokens drawn without replacement from `proposal.q`."""
    p, q = p.clone(), proposal.q.float().to(p.device).clone()
    for token in proposal.tokens:
        q_token = float(q[token])
        if q_token > 0 and _uniform(generator) * q_token < float(p[token]):
            return token
        residual = _normalised((p - q).clamp(min=0))
        p = residual if residual is not None else p  # p == q: rejection had probability 0
        q[token] = 0
        remaining = _normalised(q)
        if remaining is None:
            break
        q = remaining
    return draw(p, generator)


def sample_accept(tree: DraftTree, target_probs, generator: torch.Generator,
                  constraint: Constraint | None = None) -> tuple[list[int], int]:
    """Walk down from the root while the emitted token is a verified child. `target_probs[node]`: the warped
    target distribution at a node ([n, V], or anything indexable by node). Returns the accepted path (root
    excluded) and the token emitted after it (a fresh draw, or an accepted drafted token that was not
    verified); a constraint has consumed every emitted token."""
    child_of = child_index(tree)
    children: dict[int, list[int]] = {}
    for (parent, token), _ in sorted(child_of.items(), key=lambda item: item[1]):
        children.setdefault(parent, []).append(token)
    path, node = [], 0
    while True:
        proposal = tree.proposals.get(node)
        if proposal is not None:
            token = emit_from_proposal(target_probs[node], proposal, generator)
        else:
            token = emit_from_candidates(target_probs[node], children.get(node, []), generator)
        if constraint is not None:
            constraint.advance(token)
        if (node, token) not in child_of:
            return path, token
        node = child_of[(node, token)]
        path.append(node)


class _MaskedProbs:
    """The warped distribution at a node under the grammar state the walk is in when it reads that node (the
    walk reads each node once, in path order, before advancing past it)."""

    def __init__(self, logits: torch.Tensor, sampling: SamplingParams, constraint: Constraint) -> None:
        self.logits, self.sampling, self.constraint = logits, sampling, constraint

    def __getitem__(self, node: int) -> torch.Tensor:
        return warp(self.constraint.mask(self.logits[node]), self.sampling)


def accept(tree: DraftTree, target_logits: torch.Tensor, sampling: SamplingParams | None,
           generator: torch.Generator | None, constraint: Constraint | None = None) -> tuple[list[int], int]:
    """Greedy or sampling verification of one verified tree; under a constraint, which then holds the emitted
    tokens."""
    if sampling is None or sampling.greedy:
        return greedy_accept(tree, target_logits, constraint)
    if constraint is not None:
        return sample_accept(tree, _MaskedProbs(target_logits, sampling, constraint), generator, constraint)
    return sample_accept(tree, warp(target_logits, sampling), generator)
