"""CAST: cost-aware breadth pruning, depth pruning and dynamic reranking (METHOD.md sections 2.2-2.5).

Every decision compares the utility a set of nodes adds (summed draft scores, batch-averaged) with what it
costs (from a measured cost table, in units of one plain AR step of the target) by Algorithm 1. Thresholds are
either the paper's fixed C1/C2/C3, or, in auto mode, the goodput the engine is measuring: a node is worth
drafting or verifying when the tokens it is expected to add per unit of cost exceed the tokens per unit of cost
the decoder currently achieves (see docs/cast.md)."""

from __future__ import annotations

from collections import deque

import torch

from castspec.cost import CostTable
from castspec.errors import CastspecError
from castspec.policies import Policy, StepContext, batch_utilities


def select_max_valid_index(utilities: list[float], costs: list[float], threshold: float,
                           base_utility: float = 0.0, base_cost: float = 0.0) -> int:
    """Algorithm 1: how many items (1..n) to keep. The anchor starts at (base_utility, base_cost) and moves to
    item k whenever the marginal ratio from the anchor to k reaches the threshold; measuring from the last
    anchor (not from k-1) lets the scan cross a single non-concave dip. Equal costs count as an infinite ratio
    when the utility grows. Ties keep the item, within rounding (this is what makes Theorem 4.1 exact)."""
    tie = 1e-9 * abs(threshold)
    anchor, u_anchor, c_anchor = 0, base_utility, base_cost
    for k, (u, c) in enumerate(zip(utilities, costs, strict=True), start=1):
        du, dc = u - u_anchor, c - c_anchor
        ratio = du / dc if dc > 0 else (float("inf") if du > 0 else float("-inf"))
        if ratio >= threshold - tie and du > 0:
            anchor, u_anchor, c_anchor = k, u, c
    return anchor


class CastPolicy(Policy):
    name = "cast"

    def __init__(self, costs: CostTable, c1: float | None = 4.0, c2: float | None = 3.0, c3: float | None = 2.5,
                 fifo_size: int = 8, max_depth: int = 8, top_k: int = 8, max_verify: int = 64,
                 auto: bool = False) -> None:
        if costs.draft is None:
            raise CastspecError("CAST needs a cost table with a drafter table (castspec profile --draft/--drafter)")
        if fifo_size < 1 or max_depth < 1 or top_k < 1 or max_verify < 1:
            raise CastspecError("cast-r, cast-max-depth, top_k and max_verify must be positive")
        if not auto and any(c is None or c < 0 for c in (c1, c2, c3)):
            raise CastspecError("fixed-threshold CAST needs non-negative C1, C2 and C3")
        self.costs, self.c1, self.c2, self.c3 = costs, c1, c2, c3
        self.fifo_size, self.max_depth, self.top_k, self.max_verify, self.auto = (
            fifo_size, max_depth, top_k, max_verify, auto)
        self.ratios: deque[float] = deque([1.0], maxlen=fifo_size)
        self.goodput = None  # tokens per second, measured (exponential average)
        self.trace: dict = {}
        self._ar_seconds = 1.0

    # ---- thresholds ---------------------------------------------------------------------------------------

    def threshold(self, which: str, scores: torch.Tensor, ctx: StepContext) -> float:
        """C1 (breadth), C2 (depth) or C3 (verify). Auto: the measured goodput in tokens per AR-step time,
        never below 1 (plain AR's own goodput)."""
        if not self.auto:
            return {"breadth": self.c1, "depth": self.c2, "verify": self.c3}[which]
        if self.goodput is None:
            return 1.0
        return max(1.0, self.goodput * self._ar_seconds)

    def observe(self, tokens: int, seconds: float) -> None:
        if seconds > 0:
            rate = tokens / seconds
            self.goodput = rate if self.goodput is None else 0.8 * self.goodput + 0.2 * rate

    # ---- decisions ----------------------------------------------------------------------------------------

    def start_step(self, ctx: StepContext) -> None:
        self._ar_seconds = self.costs.f_target(ctx.batch_size, ctx.context_length, 1)
        self._layer_utility: float | None = None
        self._drafted = 0
        self.trace = {"context": ctx.context_length, "batch_size": ctx.batch_size, "layers": []}

    def should_draft(self, ctx: StepContext) -> bool:
        """Auto mode: draft only if some chain could beat AR even at the best: d drafted tokens, all accepted,
        must be worth more than their cost (d draft forwards of one node plus the wider verify forward). Where
        no depth passes, speculation cannot pay on this hardware and the step is plain AR."""
        if not self.auto:
            return True
        b, c = ctx.batch_size, ctx.context_length
        step = self.costs.normalised_draft(b, c, 1)
        # the first draft layer shares its forward with the catch-up of every token absorbed since the drafter
        # last ran: after skipped steps that forward is wider, and drafting must pay for it too
        first = self.costs.normalised_draft(b, c, max(1, ctx.pending))
        return any(d > first + (d - 1) * step + self.costs.normalised_target(b, c, d + 1) - 1.0
                   for d in range(1, min(self.max_depth, ctx.depth_limit) + 1))

    def width(self, layer: int, scores: torch.Tensor, ctx: StepContext) -> int:
        b = ctx.batch_size
        utilities = batch_utilities(scores, b)
        draft_context = ctx.context_length + self._drafted
        costs = [self.costs.normalised_draft(b, draft_context, k) for k in range(1, len(utilities) + 1)]
        if self.auto:
            # a drafted node only pays off once verified: charge its share of the verify forward as well
            verify = self.costs.normalised_target
            base = verify(b, ctx.context_length, self._drafted + 1)
            costs = [c + verify(b, ctx.context_length, self._drafted + 1 + k) - base
                     for k, c in enumerate(costs, start=1)]
        c1 = self.threshold("breadth", scores, ctx)
        width = min(select_max_valid_index(utilities, costs, c1), self.top_k)
        entry = {"layer": layer, "candidates": len(utilities), "width": width, "c1": c1,
                 "utilities": [round(u, 5) for u in utilities[: 2 * self.top_k]],
                 "costs": [round(c, 4) for c in costs[: 2 * self.top_k]]}
        self.trace["layers"].append(entry)
        if width == 0:
            return 0
        kept_utility = utilities[width - 1]
        if self._layer_utility:
            self.ratios.append(kept_utility / self._layer_utility)
        self._layer_utility = kept_utility
        alpha = sum(self.ratios) / len(self.ratios)
        c2 = self.threshold("depth", scores, ctx)
        next_value = alpha * kept_utility / costs[width - 1]
        entry.update({"alpha": round(alpha, 4), "depth_value": round(next_value, 4), "c2": c2})
        if layer >= self.max_depth or next_value < c2:
            entry["stop"] = "max_depth" if layer >= self.max_depth else "depth_pruning"
            return 0
        self._drafted += width
        return width

    def verify_budget(self, scores: torch.Tensor, ctx: StepContext) -> int:
        b = ctx.batch_size
        utilities = batch_utilities(scores[..., : self.max_verify], b)
        # verifying k drafted nodes is a forward of k + 1 tokens (the root); verifying none is one AR step
        costs = [self.costs.normalised_target(b, ctx.context_length, k + 1) for k in range(1, len(utilities) + 1)]
        c3 = self.threshold("verify", scores, ctx)
        budget = select_max_valid_index(utilities, costs, c3, base_utility=0.0, base_cost=1.0)
        self.trace.update({"verify_budget": budget, "c3": c3, "verify_utilities": [round(u, 5) for u in
                                                                                  utilities[:32]],
                           "verify_costs": [round(c, 4) for c in costs[:32]]})
        return budget

    def describe(self) -> str:
        mode = "auto" if self.auto else f"C1={self.c1}, C2={self.c2}, C3={self.c3}"
        return f"cast({mode}, R={self.fifo_size}, max_depth={self.max_depth}, top_k={self.top_k})"
