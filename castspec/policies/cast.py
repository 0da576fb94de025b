"""CAST: cost-aware breadth pruning, depth pruning and dynamic reranking (METHOD.md sections 2.2-2.5).

Every decision compares the utility a set of nodes adds (summed draft scores, batch-averaged) with what it
costs (from a measured cost table, in units of one plain AR step of the target) by Algorithm 1. Thresholds are
either the paper's fixed C1/C2/C3, or, in auto mode, the goodput the engine is measuring: a node is worth
drafting or verifying when the tokens it is expected to add per unit of cost exceed the tokens per unit of cost
the decoder currently achieves (see docs/cast.md)."""

from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from collections.abc import Hashable
from itertools import pairwise

import torch

from castspec.costs.table import CostTable, isotonic
from castspec.decode.tree import DraftTree
from castspec.errors import CastspecError
from castspec.policies.base import Policy, StepContext, batch_utilities


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


UNSEEN_WEIGHT = 1e-3  # a score bin with no evidence of its own yields to any bin that has some


class _ScoreBins:
    """P(accepted | score) for one band (of depth or match length): binned, decaying counts of what the target
    did, over `prior` pseudo-observations at the prior's rate per bin (the bin centres, or the shallower band's
    fitted rates), fitted non-decreasing in the score."""

    def __init__(self, edges: tuple[float, ...], prior: float, decay: float) -> None:
        self.edges, self.prior, self.decay = edges, prior, decay
        self.centres = [(lo + hi) / 2 for lo, hi in pairwise(edges)]
        self.accepted = [0.0] * len(self.centres)  # what was seen, decayed (the prior is added at each fit)
        self.seen = [0.0] * len(self.centres)
        self.rates = list(self.centres)
        self._fit()

    def fade(self) -> None:
        self.accepted = [self.decay * a for a in self.accepted]
        self.seen = [self.decay * n for n in self.seen]

    def add(self, score: float, ok: bool) -> None:
        i = bisect.bisect_right(self.edges, score, 1, len(self.edges) - 1) - 1
        self.seen[i] += 1
        self.accepted[i] += float(ok)

    def refit(self, prior_rates: list[float]) -> None:
        rates = [(a + self.prior * r) / (n + self.prior) if n + self.prior > 0 else r
                 for a, n, r in zip(self.accepted, self.seen, prior_rates, strict=True)]
        # the fit weighs each bin by its own evidence, so that the priors of bins that saw nothing do not pool an
        # observed bin towards their centres: 70 of 70 suffix nodes scored 0.47 taken read 0.92 when 9 unseen
        # bins above it with 4 pseudo-observations each joined its pool
        self.rates = isotonic(rates, [n + UNSEEN_WEIGHT for n in self.seen])
        self._fit()

    def _fit(self) -> None:
        self._xs = torch.tensor([0.0, *self.centres, 1.0], dtype=torch.float64)
        self._ys = torch.tensor([0.0, *self.rates, self.rates[-1]], dtype=torch.float64)

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        """Calibrated scores ([N] float64 in [0, 1]): piecewise-linear through the bin centres."""
        xs, ys = self._xs, self._ys
        right = torch.bucketize(flat, xs[1:-1]).clamp(max=len(xs) - 2) + 1
        left = right - 1
        weight = (flat - xs[left]) / (xs[right] - xs[left])
        return ys[left] + weight * (ys[right] - ys[left])


class AcceptanceCalibration:
    """P(the target accepts a drafted node | it accepted the node's parent), as a function of the node's draft
    probability given its parent and of its depth, learned from the trees verified so far.

    CAST's utilities assume that draft probabilities are acceptance chances, so that a node's score (their product
    along its path) is the chance the target accepts it. A drafter can be far off: an n-gram index that saw a
    suffix once says 1.0 at every step of a long chain, a weak EAGLE head is confident and wrong. Probabilities are
    binned; each bin starts with `prior` pseudo-observations at its own centre (so an unobserved drafter is taken
    at its word), counts decay by `decay` per step so the map follows the text, and the per-bin rates are fitted
    non-decreasing (isotonic regression weighted by each bin's own evidence) so that a likelier child never maps
    below a less likely one. Each depth band (`DEPTHS`: 1, 2-3, 4-7, 8 and deeper) has bins of its own: a copied
    span that the target has followed for a few tokens goes on far more surely than a first guess does (an n-gram
    or suffix match says the same score at every depth, but whether its first token is taken is a coin toss while
    its tenth, given the nine before it, is nearly sure), and one map for all depths made every deep node as
    doubtful as a first one. A band's prior is the band above it (the drafter's word only for depth 1), so a
    deep band that has seen little reads like the shallower one instead of starting from the drafter's word again.
    A lookup drafter (n-gram, suffix tree) says how long the match behind each node is (`Candidates.matched`:
    the tokens of context + path that agree with the earlier text it proposes from), and its nodes are banded by
    that length instead (`MATCHES`: under 6, 6-9, 10-13, 14 and longer). The depth was a stand-in for it that
    only counts the tree's own part: the first node of a step that goes on copying a function from the prompt is
    at depth 1, yet behind it are 30 tokens of agreement, and after a 2-3 token match the target took the next
    token 54 % of the time against 99 % after a 16-token one (32 answers, bench/regret). Banded by depth, a copy's
    first trees were priced like a fresh guess once other texts had taught the map what first guesses are worth.
    A node's utility is then the product of calibrated probabilities along its path
    (`CastPolicy.node_utility`), which keeps every child below its parent."""

    EDGES = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.97, 1.0)
    DEPTHS = (1, 2, 4, 8)  # the first depth of each band
    MATCHES = (0, 6, 10, 14)  # the first match length of each band (a lookup drafter's nodes)

    def __init__(self, prior: float = 4.0, decay: float = 0.99, per_row: bool = True) -> None:
        self.prior, self.decay = prior, decay
        self.bands = [_ScoreBins(self.EDGES, prior, decay) for _ in self.DEPTHS]
        self.regimes = RowRegimes(len(self.DEPTHS)) if per_row else None

    def band(self, depth: int, matched: int | None = None) -> int:
        """A node's band: by its match length where its drafter gives one, else by its depth."""
        if matched is not None:
            return max(0, bisect.bisect_right(self.MATCHES, matched) - 1)
        return max(0, bisect.bisect_right(self.DEPTHS, depth) - 1)

    @property
    def rates(self) -> list[float]:
        """The first-guess (depth 1) map's rates per bin."""
        return self.bands[0].rates

    def observe(self, scores: list[float], accepted: list[bool], depths: list[int] | None = None,
                row: Hashable | None = None, matched: list[int] | None = None) -> None:
        """One step: every verified drafted node's score, whether the target accepted it and its depth (1 where
        not given; none on an AR step) or match length (`matched`, a lookup drafter's), and the row (request) it
        was drafted for. Old evidence fades towards the prior, so a drafter judged poor is tried again after a
        while instead of never being verified (and so never re-judged) again."""
        depths = depths or [1] * len(scores)
        bands = [self.band(d) for d in depths] if matched is None else [self.band(0, m) for m in matched]
        if self.regimes is not None and row is not None and scores:
            # what the shared map predicted for these nodes, before it learns from them
            clamped = torch.tensor(scores, dtype=torch.float64).clamp(0, 1)
            predicted = torch.zeros_like(clamped)
            for band in set(bands):
                where = torch.tensor([b == band for b in bands])
                predicted[where] = self.bands[band](clamped[where])
            self.regimes.observe(row, bands, predicted.tolist(), accepted)
        for bins in self.bands:
            bins.fade()
        for score, ok, band in zip(scores, accepted, bands, strict=True):
            self.bands[band].add(score, ok)
        prior_rates = self.bands[0].centres
        for bins in self.bands:
            bins.refit(prior_rates)
            prior_rates = bins.rates

    def __call__(self, scores: torch.Tensor, depth: int = 1, rows: list[Hashable] | None = None,
                 matched: list[int] | None = None) -> torch.Tensor:
        """Calibrated scores of nodes at `depth` (0 stays 0: padding). `rows`: the row (request) of each of
        `scores`' rows, whose own recent verdicts scale the shared map (`RowRegimes`); `matched`: each of
        `scores`' rows' match length (a lookup drafter's), which then picks its band instead of the depth."""
        flat = scores.double().clamp(0, 1)
        if matched is None:
            bands = [self.band(depth)] * flat.shape[0]
            out = self.bands[bands[0]](flat.flatten()).reshape(flat.shape)
        else:
            bands = [self.band(depth, m) for m in matched]
            out = torch.empty_like(flat)
            for band in set(bands):
                where = torch.tensor([b == band for b in bands])
                out[where] = self.bands[band](flat[where].flatten()).reshape(flat[where].shape)
        if rows is not None and self.regimes is not None:
            factors = torch.tensor([self.regimes.factor(row, band) for row, band in zip(rows, bands, strict=True)],
                                   dtype=torch.float64)
            out = (out * factors.reshape(-1, *([1] * (out.dim() - 1)))).clamp(max=RowRegimes.MOST)
        return torch.where(flat > 0, out, 0.0).to(scores.dtype)


class RowRegimes:
    """How each row's (request's) own text departs from the shared acceptance map, per band (of depth or match
    length): the ratio of the nodes its target accepted to the nodes the shared map expected it to accept, over
    its recent steps.

    The shared map learns from every row and over ~100 steps; a text's regime changes faster and differs between
    the rows of a batch: a row that copies a span of its prompt takes deep suffix matches nearly surely, while a
    row writing new prose beside it takes few of the very same scores. One map for both over-prices drafting for
    the first and under-prices it for the second (CAST trailed the chain of 4 on GSM8K and MT-bench and the
    chain of 16 on repetitive prompts, with one map that had learnt from all of them; bench/regret). A row's
    utility is the shared map's chance times its band's ratio (at most `MOST`); with `prior` pseudo-nodes at
    the newcomers' ratio (below) a new row reads as the rows before it read at their start, and its own evidence
    fades by `decay` a step, so the ratio follows a text whose regime turns. Rows no step has named for a while are
    dropped (`keep` at most).

    The newcomers' ratio, per band, pools each row's first verdicts in that band (decayed by `newcomer_decay` per
    row; `prior` pseudo-nodes at ratio 1): a new text's first tree is sized before any evidence of its own, and the
    shared map it would read then is of the texts just before it. After a copy text that map read 0.99 for an
    n-gram match's first token, while the target takes it 0.31 of the time on MT-bench answers and 0.48 on GSM8K
    (bench/regret): trees of 24 nodes priced ~3.5 AR steps whose first node was rejected. A first tree's worth is
    linear in its first node's chance (every deeper node is conditional on it), so the mean over past newcomers is
    the hedge across texts (capped at the map itself); the row's own evidence takes over within a few steps."""

    MOST = 0.99  # a scaled chance never reaches certainty: some price always remains for a deeper node

    def __init__(self, bands: int, prior: float = 2.0, decay: float = 0.8, keep: int = 256,
                 newcomer_decay: float = 0.9) -> None:
        self.bands, self.prior, self.decay, self.keep = bands, prior, decay, keep
        self.newcomer_decay = newcomer_decay
        self.rows: OrderedDict[Hashable, tuple[list[float], list[float]]] = OrderedDict()
        # per band: decayed sums of the nodes taken and expected in rows' first verdicts of that band
        self.newcomers: tuple[list[float], list[float]] = ([0.0] * bands, [0.0] * bands)

    def observe(self, row: Hashable, bands: list[int], predicted: list[float], accepted: list[bool]) -> None:
        taken, expected = self.rows.pop(row, None) or ([0.0] * self.bands, [0.0] * self.bands)
        first = [e == 0.0 for e in expected]  # bands this row has had no verdict in yet
        taken = [self.decay * t for t in taken]
        expected = [self.decay * e for e in expected]
        for band, p, ok in zip(bands, predicted, accepted, strict=True):
            taken[band] += float(ok)
            expected[band] += p
        new_taken, new_expected = self.newcomers
        for band in range(self.bands):
            if first[band] and expected[band] > 0.0:
                new_taken[band] = self.newcomer_decay * new_taken[band] + taken[band]
                new_expected[band] = self.newcomer_decay * new_expected[band] + expected[band]
        self.rows[row] = (taken, expected)  # most recent last
        while len(self.rows) > self.keep:
            self.rows.popitem(last=False)

    def newcomer_factor(self, band: int) -> float:
        """How rows' first verdicts in `band` fell short of the shared map: a new row's ratio. Never above 1: a
        hedge, so a row with no evidence of its own is never priced above the map (over the suffix tree, whose
        count scores are shy, a newcomers' ratio above 1 drafted GSM8K's first trees too deep: 0.94 of the best
        fixed tree against 0.96 capped, bench/regret)."""
        new_taken, new_expected = self.newcomers
        return min(1.0, (new_taken[band] + self.prior) / (new_expected[band] + self.prior))

    def factor(self, row: Hashable, band: int) -> float:
        start = self.newcomer_factor(band)
        seen = self.rows.get(row)
        if seen is None:
            return start
        taken, expected = seen
        return (taken[band] + self.prior * start) / (expected[band] + self.prior)


class DraftingPayoff:
    """Whether drafting has paid lately: per drafting step, the tokens it emitted minus its price in plain AR
    steps (its draft forwards plus its verify forward, from the cost table), averaged with decaying weights.
    An AR step's payoff is 0 by definition, so drafting is worth it while this is above 0.

    Starts at `prior_gain` with `prior` pseudo-observations and fades back there (also on AR steps), so a drafter
    that stopped paying is tried again now and then: with a = (1 - decay) * prior * prior_gain, a drafter that
    loses g AR steps per try ends up trying on about a / (g + a) of the steps. Priced, not timed, so that a replay
    decides exactly as real decoding does.

    The evidence is of the texts decoded lately, and a new request is a new text: n-gram matches that lost on an
    MT-bench answer say nothing of a HumanEval completion that repeats its prompt, yet a closed gate gathers no
    evidence of its own (it fades back open only after ~100 AR steps: a whole request decoded as AR where a chain
    of 16 would have made it 4.6x faster, bench/regret). So while the gate is closed, a step that carries a row
    (request) the target has not yet been shown a drafted node for drafts anyway (`untried`), and its gain is
    counted like any other: a text that pays reopens the gate at once, one that does not adds one more loss. Worst
    case: one verified tree per request while drafting loses, sized by the calibrated map (which has learnt the
    losses by then), plus the drafter's lookups on the steps before that where it had nothing to offer, plus, for a
    draft model, the try's catch-up of the request's prompt (the prompt's prefill on the draft model)."""

    KEEP_ROWS = 1024  # rows remembered as tried (one not named for this long would be tried again)

    def __init__(self, prior_gain: float = 0.5, prior: float = 2.0, decay: float = 0.99) -> None:
        self.prior_gain, self.prior, self.decay = prior_gain, prior, decay
        self.total, self.weight = prior * prior_gain, prior
        self.tried_rows: OrderedDict[Hashable, None] = OrderedDict()
        self.new_row_tries = 0

    def untried(self, rows: tuple[Hashable, ...]) -> bool:
        """Whether any of this step's rows has had no drafted node verified yet."""
        return any(row not in self.tried_rows for row in rows)

    def tried(self, row: Hashable) -> None:
        """`row` had a drafted node verified."""
        self.tried_rows[row] = None
        self.tried_rows.move_to_end(row)
        while len(self.tried_rows) > self.KEEP_ROWS:
            self.tried_rows.popitem(last=False)

    @property
    def expected(self) -> float:
        return self.total / self.weight

    def observe(self, gain: float | None) -> None:
        """One step: a drafting step's gain in tokens over an AR step, or None for an AR step."""
        d = self.decay
        self.total = d * self.total + (1 - d) * self.prior * self.prior_gain
        self.weight = d * self.weight + (1 - d) * self.prior
        if gain is not None:
            self.total += gain
            self.weight += 1


class Exploration:
    """Drafting that the cost table prices out is tried now and then anyway. A table that is wrong about drafting
    (its drafter points timed while the machine was busy, or seeded from another hour's profile) learns only from
    steps that draft: without tries, one bad price would stand for a whole run.

    A try comes after `gap` priced-out steps. It drafts one node and verifies it: the drafter's first forward
    absorbs the `gap` tokens emitted since it last ran (that is the drafter's state kept current: for a draft
    model a forward of gap + 1 tokens, for a lookup drafter next to nothing), then one one-token draft forward,
    and the verify takes two tokens instead of one. Where the table is unsure of the one-token draft price
    (`OnlineCostTable.draft_sure`: the cell was timed fewer than a few times, or recent timings disagree with the
    table) the gap goes back to `every`; where it is sure, the gap doubles, up to `most`. So a drafter that never
    pays costs, per step, its catch-up price per token (a draft model's per-token prefill cost) plus
    (D1 + V) / `most` (D1: a one-token draft forward, V: one more verified token, both in AR steps) in the long
    run, and (D1 + V) / `every` more while its price is being learned; a table wrong about the drafter gets a try
    every `every` steps until the timings correct it."""

    def __init__(self, every: int = 8, most: int = 256) -> None:
        if every < 1 or most < every:
            raise CastspecError("exploration: every >= 1 and most >= every")
        self.every, self.most = every, most
        self.gap, self.waited, self.tries = every, 0, 0

    def due(self) -> bool:
        """One priced-out step: whether it is this one's turn to try drafting."""
        self.waited += 1
        return self.waited >= self.gap

    def tried(self, sure: bool) -> None:
        self.waited, self.tries = 0, self.tries + 1
        self.gap = min(self.most, 2 * self.gap) if sure else self.every


class CastPolicy(Policy):
    name = "cast"
    CATCH_UP_HORIZON = 64  # tokens over which a drafter's catch-up is spread (`_catch_up_price`)

    def __init__(self, costs: CostTable, c1: float | None = 4.0, c2: float | None = 3.0, c3: float | None = 2.5,
                 fifo_size: int = 8, max_depth: int = 8, top_k: int = 8, max_verify: int = 64,
                 auto: bool = False, calibrate: bool = False, payoff: bool | None = None) -> None:
        if costs.draft is None:
            raise CastspecError("CAST needs a cost table with a drafter table (castspec profile --draft/--drafter)")
        if fifo_size < 1 or max_depth < 1 or top_k < 1 or max_verify < 1:
            raise CastspecError("cast-r, cast-max-depth, top_k and max_verify must be positive")
        if not auto and any(c is None or c < 0 for c in (c1, c2, c3)):
            raise CastspecError("fixed-threshold CAST needs non-negative C1, C2 and C3")
        self.costs, self.c1, self.c2, self.c3 = costs, c1, c2, c3
        self.fifo_size, self.max_depth, self.top_k, self.max_verify, self.auto = (
            fifo_size, max_depth, top_k, max_verify, auto)
        self.calibration = AcceptanceCalibration() if calibrate else None
        # the payoff gate is on wherever CAST adapts (auto or calibrated) unless asked otherwise: it is what keeps a
        # drafter that does not pay on this machine at AR's speed instead of below it
        self.payoff = DraftingPayoff() if (auto or calibrate if payoff is None else payoff) else None
        # tries of drafting that the table prices out, where the table learns from them (auto mode reads prices)
        self.exploration = Exploration() if auto and hasattr(costs, "draft_sure") else None
        self._exploring = False
        self._new_row_try = False  # this step drafts past a closed payoff gate because it carries a new row
        self._step_price: float | None = None  # this step's price in AR steps so far; None: not drafting
        self._catch_up, self._catch_up_horizon = 0.0, 1  # this step's drafter catch-up and the tokens it is spread over
        self._row_keys: tuple = ()  # this step's rows (requests), for their own acceptance regimes
        self.ratios: deque[float] = deque([1.0], maxlen=fifo_size)
        self.goodput = None  # tokens per AR step's price, over recent steps (exponential average)
        self.trace: dict = {}

    # ---- thresholds ---------------------------------------------------------------------------------------

    def threshold(self, which: str, scores: torch.Tensor, ctx: StepContext) -> float:
        """C1 (breadth), C2 (depth) or C3 (verify). Auto: the goodput of recent steps in tokens per AR step,
        never below 1 (plain AR's own goodput)."""
        if not self.auto:
            return {"breadth": self.c1, "depth": self.c2, "verify": self.c3}[which]
        return 1.0 if self.goodput is None else max(1.0, self.goodput)

    def observe(self, tokens: int, seconds: float) -> None:
        # the goodput is read in the units of every utility / cost ratio it is compared with: tokens per step price
        # from the same cost table (an AR step costs 1). Tokens per wall second times the table's AR seconds mixed
        # two clocks: under a table whose seconds are not this machine's (a profile of another hour, a synthetic
        # one), the threshold came out many times too high and CAST drafted nothing.
        price = 1.0 if self._step_price is None else self._step_price + self._catch_up * self._catch_up_share(tokens)
        rate = tokens / price
        self.goodput = rate if self.goodput is None else 0.8 * self.goodput + 0.2 * rate
        # a try is priced by the very table it questions: its gain says nothing of what drafting pays
        if self.payoff is not None and not self._exploring:
            self.payoff.observe(None if self._step_price is None else tokens - price)
        self._step_price = None

    def observe_tree(self, tree: DraftTree, path: list[int], row: Hashable | None = None) -> None:
        """Calibration learns P(accepted | parent accepted) from each verified node whose parent the target
        accepted (the root or a node on the path): its draft probability given the parent, and the verdict; the
        row's own regime (`RowRegimes`) from the same nodes. The payoff gate notes the row as tried."""
        if self.payoff is not None and row is not None and len(tree) > 1:
            self.payoff.tried(row)
        if self.calibration is None:
            return
        kept = {0, *path}
        scores, parents, depths = tree.scores.tolist(), tree.parents.tolist(), tree.depths.tolist()
        nodes = [i for i in range(1, len(tree)) if parents[i] in kept]
        self.calibration.observe([scores[i] / scores[parents[i]] if scores[parents[i]] > 0 else 0.0 for i in nodes],
                                 [i in kept for i in nodes], [depths[i] for i in nodes], row,
                                 None if tree.matched is None else [tree.matched[i] for i in nodes])

    def node_utility(self, probs: torch.Tensor, parent_utility: torch.Tensor, depth: int = 1,
                     rows: list[int] | None = None, matched: list[int] | None = None) -> torch.Tensor:
        """Calibrated: the parent's utility times the learnt chance that the target takes this child (at its
        depth) once it has taken the parent, scaled by the row's own regime when `rows` (each parent's row in the
        batch) says whose they are; a chain of confident n-gram guesses then loses worth with every step as the
        target's choices say it does, and a copied span that the target keeps taking stays worth drafting."""
        if self.calibration is None:
            return super().node_utility(probs, parent_utility, depth, rows, matched)
        keys = None
        if rows is not None and len(self._row_keys) > max(rows, default=-1):
            keys = [self._row_keys[b] for b in rows]
        return self.calibration(probs, depth, keys, matched).to(parent_utility.dtype) * parent_utility

    # ---- decisions ----------------------------------------------------------------------------------------

    def _catch_up_price(self, ctx: StepContext) -> tuple[float, int]:
        """The drafter's catch-up in AR steps (its first forward's price beyond one token: the tokens accepted
        since it last ran, a new request's whole prompt) and the tokens it is spread over.

        A catch-up is paid once and serves every later drafting step of the rows, so each drafting step is
        charged the share of it that its tokens are of the next `CATCH_UP_HORIZON` (fewer where the rows end
        sooner). Charged whole to the first step, as before, a draft model's catch-up of a new prompt (150 tokens:
        6.9 AR steps on the AVX2 EPYC, where a one-token draft forward costs 0.48) outweighed any one tree, and
        every step skipped made the next catch-up dearer: CAST over the draft model drafted on 4 of 43 steps of a
        HumanEval prompt that the chain of 16 decoded in 4 steps (bench/regret). Worst case: catching up on every
        token, at the drafter's prefill price per token (0.046 AR steps for the 0.5B draft model there, ~0 for a
        lookup drafter)."""
        b, c = ctx.batch_size, ctx.context_length
        if ctx.pending <= 1:
            return 0.0, 1
        extra = self.costs.normalised_draft(b, c, ctx.pending) - self.costs.normalised_draft(b, c, 1)
        return max(0.0, extra), max(1, min(self.CATCH_UP_HORIZON, ctx.depth_limit + 1))

    def _catch_up_share(self, tokens: int) -> float:
        return min(1.0, tokens / self._catch_up_horizon)

    def start_step(self, ctx: StepContext) -> None:
        self._layer_utility: float | None = None
        self._drafted = 0
        # verifying nothing costs one AR step; the first draft forward's catch-up beyond one token is charged
        # by its share (`_catch_up_price`) once the step's tokens are known
        self._step_price = 1.0 + self.costs.normalised_draft(ctx.batch_size, ctx.context_length, 1)
        self._catch_up, self._catch_up_horizon = self._catch_up_price(ctx)
        self._row_keys = ctx.rows
        self.trace = {"context": ctx.context_length, "batch_size": ctx.batch_size, "layers": []}
        if self.payoff is not None:
            self.trace["drafting_payoff"] = round(self.payoff.expected, 4)
        regimes = self.calibration.regimes if self.calibration is not None else None
        if regimes is not None and ctx.rows:  # each row's ratio to the shared map, per band
            self.trace["row_regimes"] = [[round(regimes.factor(row, band), 3) for band in range(regimes.bands)]
                                         for row in ctx.rows]
            self.trace["newcomer_ratios"] = [round(regimes.newcomer_factor(band), 3) for band in range(regimes.bands)]
        if self._exploring:
            self.trace["exploring"] = {"try": self.exploration.tries, "next_gap": self.exploration.gap}
        if self._new_row_try:  # drafting although the payoff gate is closed: a new request's first try
            self.payoff.new_row_tries += 1
            self.trace["new_row_try"] = self.payoff.new_row_tries

    def should_draft(self, ctx: StepContext) -> bool:
        """Auto mode: draft only if some chain could beat AR even at the best: d drafted tokens, all accepted,
        must be worth more than their cost (d draft forwards of one node plus the wider verify forward). Where
        no depth passes, speculation cannot pay on this hardware and the step is plain AR.
        Payoff gate (on by default in auto or calibrated mode): also only while drafting has paid lately
        (`DraftingPayoff`): the test above assumes every drafted token is accepted, so a drafter whose forwards
        cost a good share of a target step, or whose scores no calibration can fix, still costs its forwards;
        only skipping them stops that loss."""
        self._exploring = self._new_row_try = False
        if self.payoff is not None and self.payoff.expected <= 0:
            if not self.payoff.untried(ctx.rows):
                return False
            self._new_row_try = True  # a new text: the gate's evidence is of other texts (DraftingPayoff)
        if not self.auto:
            return True
        b, c = ctx.batch_size, ctx.context_length
        step = self.costs.normalised_draft(b, c, 1)
        # the first draft layer shares its forward with the catch-up of every token absorbed since the drafter
        # last ran (a new prompt, skipped steps): drafting d tokens must pay for its share of it too
        catch_up, horizon = self._catch_up_price(ctx)
        if any(d > d * step + catch_up * min(1.0, d / horizon) + self.costs.normalised_target(b, c, d + 1) - 1.0
               for d in range(1, min(self.max_depth, ctx.depth_limit) + 1)):
            return True
        if self.exploration is not None and self.exploration.due():
            self.exploration.tried(self.costs.draft_sure(b, c, 1))
            self._exploring = True
            return True
        self._new_row_try = False
        return False

    def width(self, layer: int, scores: torch.Tensor, ctx: StepContext) -> int:
        b = ctx.batch_size
        utilities = batch_utilities(scores, b)
        draft_context = ctx.context_length + self._drafted
        draft_costs = [self.costs.normalised_draft(b, draft_context, k) for k in range(1, len(utilities) + 1)]
        if self._exploring:  # a try: expand the best first-layer node once (a one-token draft forward), then stop
            width = 1 if layer == 1 and utilities and layer < ctx.depth_limit else 0
            self.trace["layers"].append({"layer": layer, "candidates": len(utilities), "width": width,
                                         "exploring": True})
            if width:
                self._drafted += 1
                self._step_price += draft_costs[0]
            return width
        costs = draft_costs
        if self.auto:
            # a drafted node only pays off once verified: charge its share of the verify forward as well
            verify = self.costs.normalised_target
            base = verify(b, ctx.context_length, self._drafted + 1)
            costs = [c + verify(b, ctx.context_length, self._drafted + 1 + k) - base
                     for k, c in enumerate(draft_costs, start=1)]
        c1 = self.threshold("breadth", scores, ctx)
        width = min(select_max_valid_index(utilities, costs, c1), self.top_k)
        entry = {"layer": layer, "candidates": len(utilities), "width": width, "c1": c1,
                 "utilities": [round(u, 5) for u in utilities[: 2 * self.top_k]],
                 "costs": [round(c, 4) for c in costs[: 2 * self.top_k]]}
        self.trace["layers"].append(entry)
        if width == 0 and utilities and self.auto and self._chain_pays(utilities[0], layer, self._drafted + 1, ctx, c1):
            width = entry["width"] = 1
            entry["lookahead"] = True
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
        if (next_value < c2 and self.auto and layer < self.max_depth
                and self._chain_pays(alpha * kept_utility, layer + 1, self._drafted + width + 1, ctx, c2)):
            entry["lookahead"] = True  # the next layer alone would not pay, the chain it heads would
        elif layer >= self.max_depth or next_value < c2:
            entry["stop"] = "max_depth" if layer >= self.max_depth else "depth_pruning"
            return 0
        self._drafted += width
        if layer < ctx.depth_limit:  # the forward that expands the kept nodes (none at the depth limit)
            self._step_price += draft_costs[width - 1]
        return width

    def _chain_pays(self, utility: float, depth: int, base: int, ctx: StepContext, threshold: float) -> bool:
        """Whether a node at `depth` (or a projected next layer's best node) that does not pay alone would pay as
        the head of a chain: its descendants projected at the recent layer-to-layer ratio (alpha, as depth pruning
        projects), each priced a one-node draft forward and its share of the verify forward that already holds
        `base` tokens (the root and the nodes kept so far), the chain cut where Algorithm 1's anchor stops. The
        verify forward's cost is not concave in its tokens: on the AVX512-BF16 EPYC a second token costs 0.26 AR
        steps and the next 23 together 1.0, so after a copied chain of 25 tokens lifted the goodput to 3.9, the
        next copy's first node (0.99 tokens for 0.26) was declined alone, by breadth and then by depth pruning,
        and CAST decoded one token a step until the goodput sank back (HumanEval over n-gram, 0.74 of the chain
        of 16 by replay). Worst case: a chain drafted whose verify budget is then cut to nothing, its draft
        forwards paid for no token."""
        b, alpha = ctx.batch_size, sum(self.ratios) / len(self.ratios)
        room = min(self.max_depth, ctx.depth_limit) - depth + 1
        verify, draft = self.costs.normalised_target, self.costs.normalised_draft
        one_draft = draft(b, ctx.context_length + base - 1, 1)
        gains, prices, total = [], [], 0.0
        for length in range(1, max(0, room) + 1):
            total += utility * alpha ** (length - 1)
            gains.append(total)
            prices.append(length * one_draft + verify(b, ctx.context_length, base + length)
                          - verify(b, ctx.context_length, base))
        return select_max_valid_index(gains, prices, threshold) > 0

    def verify_budget(self, scores: torch.Tensor, ctx: StepContext) -> int:
        b = ctx.batch_size
        utilities = batch_utilities(scores[..., : self.max_verify], b)
        # verifying k drafted nodes is a forward of k + 1 tokens (the root); verifying none is one AR step
        costs = [self.costs.normalised_target(b, ctx.context_length, k + 1) for k in range(1, len(utilities) + 1)]
        c3 = self.threshold("verify", scores, ctx)
        budget = select_max_valid_index(utilities, costs, c3, base_utility=0.0, base_cost=1.0)
        if self._exploring:
            budget = min(1, len(utilities))
        self._step_price += (costs[budget - 1] - 1.0) if budget else 0.0
        self.trace.update({"verify_budget": budget, "c3": c3, "verify_utilities": [round(u, 5) for u in
                                                                                  utilities[:32]],
                           "verify_costs": [round(c, 4) for c in costs[:32]]})
        return budget

    def describe(self) -> str:
        mode = "auto" if self.auto else f"C1={self.c1}, C2={self.c2}, C3={self.c3}"
        mode += ", calibrated" if self.calibration is not None else ""
        mode += ", payoff-gated" if self.payoff is not None else ""
        return f"cast({mode}, R={self.fifo_size}, max_depth={self.max_depth}, top_k={self.top_k})"
