"""Tree-shaping policies: pure decisions from draft scores (and, for CAST, a cost model).

The tree-growing loop consults a policy at two kinds of points:
- after each draft layer: `width(layer, scores)` = how many of that layer's candidates (sorted by score,
  best first) to expand into the next layer; 0 ends drafting;
- after drafting: `verify_budget(scores)` = how many drafted nodes (best first) the target verifies.
Every candidate drafted stays eligible for verification (EAGLE-2's rerank pool); width only decides which
ones are expanded. A policy never sees a model, so it is unit-testable with plain tensors."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from castspec.decode.tree import DraftTree
from castspec.errors import CastspecError


@dataclass(frozen=True)
class StepContext:
    """What a cost-aware policy may want to know about the step being drafted."""

    batch_size: int = 1
    context_length: int = 0  # tokens in the target's KV cache
    depth_limit: int = 1 << 30  # no node deeper than this (max_new_tokens or the context window is near)
    pending: int = 1  # tokens the drafter must absorb before drafting (more than 1 after skipped draft steps)
    rows: tuple[Hashable, ...] = ()  # each row's request (a key that stays the row's over its steps), if known


class Policy(ABC):
    name: str = "policy"
    top_k: int = 1  # children the drafter proposes for each expanded node

    def start_step(self, ctx: StepContext) -> None:  # noqa: B027 - stateless policies need nothing here
        """Called before each step's drafting."""

    def should_draft(self, ctx: StepContext) -> bool:
        """Whether to draft at all this step (False: a plain AR step; the drafter catches up later)."""
        return True

    def node_utility(self, probs: torch.Tensor, parent_utility: torch.Tensor, depth: int = 1,
                     rows: list[int] | None = None, matched: list[int] | None = None) -> torch.Tensor:
        """A drafted node's worth from its draft probability given its parent (`probs` [F, k]), its parent's
        utility ([F, 1]), its depth (a layer's nodes share it), each parent's row in the batch (`rows`, [F]) and,
        from a lookup drafter, each parent's match length (`matched`, [F], `Candidates.matched`).
        The default is the draft score: the product of draft probabilities along the path. It must not exceed
        the parent's (so that the best nodes always form a tree)."""
        return probs * parent_utility

    def observe(self, tokens: int, seconds: float) -> None:  # noqa: B027 - only adaptive policies listen
        """Called after each step with the tokens it emitted and its wall time (draft + verify)."""

    def observe_tree(self, tree: DraftTree, path: list[int],  # noqa: B027 - only adaptive policies listen
                     row: Hashable | None = None) -> None:
        """Called after each step, per row, with the verified tree, the nodes the target accepted and the row's
        key (`StepContext.rows`)."""

    @abstractmethod
    def width(self, layer: int, scores: torch.Tensor, ctx: StepContext) -> int:
        """`scores`: this layer's candidate scores, [n] or one row per sequence [B, n], each sorted decreasing
        (rows padded with 0). `layer`: their depth (1 = root's children). Every row expands its best `width`."""

    @abstractmethod
    def verify_budget(self, scores: torch.Tensor, ctx: StepContext) -> int:
        """`scores`: every drafted node's score, [n] or [B, n], sorted decreasing; every row verifies its best
        `verify_budget` nodes."""

    def describe(self) -> str:
        return self.name


def batch_utilities(scores: torch.Tensor, batch_size: int) -> list[float]:
    """u_k = (1/B) * sum over rows of each row's k best scores (METHOD.md 2.3), for k = 1..n."""
    return (torch.atleast_2d(scores).double().cumsum(-1).sum(0) / batch_size).tolist()


def _positive(name: str, value: int) -> int:
    if not isinstance(value, int) or value < 1:
        raise CastspecError(f"{name} must be a positive integer, got {value!r}")
    return value


class ChainPolicy(Policy):
    """Classic speculative decoding: a single chain of the drafter's top-1 tokens, `length` deep."""

    name = "chain"
    top_k = 1

    def __init__(self, length: int = 4) -> None:
        self.length = _positive("chain length", length)

    def width(self, layer: int, scores: torch.Tensor, ctx: StepContext) -> int:
        return 1 if layer < self.length else 0

    def verify_budget(self, scores: torch.Tensor, ctx: StepContext) -> int:
        return int(scores.shape[-1])

    def describe(self) -> str:
        return f"chain(length={self.length})"


class Eagle2Policy(Policy):
    """EAGLE-2's dynamic tree with fixed hyper-parameters: expand the `top_k` best candidates of every layer
    (each into its `top_k` best children) for `depth` layers, then verify the `total_tokens - 1` best drafted
    nodes (the root makes `total_tokens`). `depth` counts layers of drafted nodes."""

    name = "eagle2"

    def __init__(self, top_k: int = 10, depth: int = 5, total_tokens: int = 60) -> None:
        self.top_k = _positive("top_k", top_k)
        self.depth = _positive("depth", depth)
        self.total_tokens = _positive("total_tokens", total_tokens)
        if total_tokens < 2:
            raise CastspecError("total_tokens must be at least 2 (the root and one drafted token)")

    def width(self, layer: int, scores: torch.Tensor, ctx: StepContext) -> int:
        return min(self.top_k, int(scores.shape[-1])) if layer < self.depth else 0

    def verify_budget(self, scores: torch.Tensor, ctx: StepContext) -> int:
        return min(self.total_tokens - 1, int(scores.shape[-1]))

    def describe(self) -> str:
        return f"eagle2(top_k={self.top_k}, depth={self.depth}, total_tokens={self.total_tokens})"
