"""Online cost model: f(B, c, n) learned from the forwards the engine times, so that CAST needs no offline profile
and follows the machine it runs on (docs/cost-model.md).

Each model (target, drafter) has a `LearnedCurve`: cells on a fixed log-spaced grid over batch size B, context c and
new tokens n, each holding a robust estimate of log-seconds. A timed forward updates its nearest cell, moved to the
cell's centre along a prior shape (a non-negative fit a + b Bn + d Bc + e Bnc to what was seen), with a clipped
(Huber) step, so one outlier moves a cell by at most `rate * clip`. Cells never seen take the prior times the
residual of the cells seen near them, and the grid handed to CAST is made non-decreasing in B, c and n by a fit in
which each cell counts by its timings. A sustained departure of the measurements from the predictions (the median of
the last `window` residuals beyond `shift` on a log scale, most of them on the same side) moves every cell and the
prior at once: the table follows a neighbour's load or a clock change within `window` observations (smaller
departures are learned cell by cell), while a single slow step changes nothing but its own cell, and that by little.
Timings well below the table are believed sooner than timings above it (load only adds time): two in a row correct a
cell; `quick` of them from two cells or more (a corrected cell counting as its two) move the whole curve down.

`OnlineCostTable` is a `CostTable` whose grids are snapshots of the two curves, refreshed every few
observations; it starts from a short probe of the running setup, from a profiled table, or from what an earlier
run learned (saved under $CASTSPEC_HOME/costs with the setup key)."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from castspec.costs.profile import interleaved_medians
from castspec.costs.table import CostGrid, CostTable, Timer, isotonic_grid
from castspec.errors import CastspecError

BATCH_AXIS = [1, 2, 4, 8, 16, 32, 64]
CONTEXT_AXIS = [32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
TOKEN_AXIS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
# [K, 3]: every cell's grid indices, in the order of the grid's flattening
_GRID_INDICES = torch.cartesian_prod(*(torch.arange(len(a), dtype=torch.float64)
                                       for a in (BATCH_AXIS, CONTEXT_AXIS, TOKEN_AXIS)))
ONLINE_FORMAT = "castspec-online-cost/1"
# a draft forward under this share of an AR step, by its timing and by the table, is not learnt (observe_draft)
NEGLIGIBLE_DRAFT = 0.01


def _nearest(axis: list[int], value: float) -> int:
    """Index of the axis point nearest `value` on a log scale (values beyond the axis map to its ends)."""
    v = math.log(max(value, 1e-9))
    return min(range(len(axis)), key=lambda i: abs(math.log(axis[i]) - v))


def _features(b: float, c: float, n: float) -> list[float]:
    # weights read once per forward (a), work per new token (Bn), KV read per cached entry (Bc), attention (Bnc)
    return [1.0, b * n, b * c, b * n * c * 1e-3]


def fit_prior(points: list[tuple[float, float, float, float, float]]) -> list[float]:
    """Non-negative coefficients of `_features` minimising the weighted relative squared error over
    (b, c, n, seconds, weight) points: every subset of features is fitted by least squares and the best one with
    no negative coefficient kept (an exact non-negative least squares for four features). A small penalty per
    feature prefers the simpler shape when several fit equally well (one batch size seen says nothing of B)."""
    if not points:
        raise CastspecError("no timings to fit a cost prior to")
    rows = torch.tensor([_features(b, c, n) for b, c, n, _, _ in points], dtype=torch.float64)
    seconds = torch.tensor([s for *_, s, _ in points], dtype=torch.float64)
    weights = torch.tensor([w for *_, w in points], dtype=torch.float64).clamp(min=1e-9).sqrt()
    a, y = rows / seconds[:, None] * weights[:, None], weights  # relative error: (f(x) - s) / s
    gram, moment, total = a.T @ a, a.T @ y, float(y @ y)
    best, best_score = None, math.inf
    for k in range(1, rows.shape[1] + 1):
        for cols in map(list, itertools.combinations(range(rows.shape[1]), k)):
            g = gram[cols][:, cols]
            try:
                coef = torch.linalg.solve(g, moment[cols])
            except torch.linalg.LinAlgError:  # fewer distinct points than features: a smaller subset fits
                continue
            if (coef < 0).any() or not torch.isfinite(coef).all():
                continue
            rss = total - 2 * float(coef @ moment[cols]) + float(coef @ g @ coef)
            score = max(rss, 0.0) / total + 1e-4 * k
            if score < best_score:
                full = [0.0] * rows.shape[1]
                for i, value in zip(cols, coef.tolist(), strict=True):
                    full[i] = value
                best, best_score = full, score
    if best is None or sum(best) <= 0:
        mean = statistics.fmean(s for *_, s, _ in points)
        best = [mean, 0.0, 0.0, 0.0]
    return best


class LearnedCurve:
    """One model's forward latency, learned online (see the module docstring for the scheme)."""

    # the monotone fit's weights: a seen cell's timings up to a cap (so that one cell's hundreds of timings do
    # not freeze its neighbours), an unseen cell's guess from the prior next to nothing
    fit_weight_cap, unseen_weight = 64.0, 0.05

    def __init__(self, rate: float = 0.05, clip: float = 0.1, window: int = 12, shift: float = 0.3,
                 agreement: float = 0.75, refresh_every: int = 8, max_weight: float = 1000.0,
                 settled: float = 4.0, quick: int = 4) -> None:
        if not 0 < rate <= 1 or clip <= 0 or window < 3 or shift <= 0 or quick < 2:
            raise CastspecError("online cost model: rate in (0, 1], positive clip and shift, window >= 3, "
                                "quick >= 2")
        self.rate, self.clip, self.window, self.shift, self.agreement = rate, clip, window, shift, agreement
        self.refresh_every, self.max_weight, self.settled, self.quick = refresh_every, max_weight, settled, quick
        self.cells: dict[tuple[int, int, int], list[float]] = {}  # cell -> [log seconds, weight]
        self.coef: list[float] | None = None
        self.residuals: deque[float] = deque(maxlen=window)
        # the faster-than-the-table path (`_take_drop`, `_follow_drops`): per cell, its timings well below it since
        # a timing last agreed with it ([observation, log seconds]); the cells corrected down at once since the
        # curve last moved (and by how much); when a timing last agreed with a cell; and the last `quick`
        # departures from known cells, for `sure`
        self._fast: dict[tuple[int, int, int], list[tuple[int, float]]] = {}
        self._jumps: dict[tuple[int, int, int], float] = {}
        self._vouched: dict[tuple[int, int, int], int] = {}
        self._recent: deque[tuple[tuple[int, int, int], float]] = deque(maxlen=quick)
        self.observations = self.shifts = 0
        self._grid: CostGrid | None = None
        self._stale = 0
        self._kernel_keys: list[tuple[int, int, int]] = []
        self._kernel = torch.zeros(len(_GRID_INDICES), 0, dtype=torch.float64)

    # ---- reading ------------------------------------------------------------------------------------------

    def prior(self, b: float, c: float, n: float) -> float:
        if self.coef is None:
            raise CastspecError("the online cost model has seen no timings yet")
        return max(sum(k * x for k, x in zip(self.coef, _features(b, c, n), strict=True)), 1e-9)

    @property
    def ready(self) -> bool:
        return bool(self.cells)

    def sure(self, b: float, c: float, n: float) -> bool:
        """Whether the curve's word at (b, c, n) rests on evidence: the nearest cell has been timed `settled`
        times (a probe point or a seeded profile point is a guess), and the recent timings agree with the curve
        (their median departure within `shift`, as `_follow` reads it)."""
        key = (_nearest(BATCH_AXIS, b), _nearest(CONTEXT_AXIS, max(c, 1)), _nearest(TOKEN_AXIS, n))
        cell = self.cells.get(key)
        if cell is None or cell[1] < self.settled:
            return False
        # a cell whose last timing came in well below it, or recent timings of any cell far from the table, is
        # being contradicted: not sure, however many timings it once took
        if key in self._fast or any(abs(departure) > self.shift for _, departure in self._recent):
            return False
        return len(self.residuals) < 3 or abs(statistics.median(self.residuals)) <= self.shift

    def grid(self) -> CostGrid:
        """The fitted grid. Rebuilt at once where a correction moved cells (a shift, a drop, a refit), and
        otherwise after `refresh_every` timings, or a sixteenth of all timings so far if more: a settled cell
        moves by a few percent per timing, while a rebuild (a monotone fit over the whole grid) costs 4-13 ms;
        rebuilt every 8 timings, it ran on nearly every step of CAST over a model-free drafter (one timing per
        draft layer), 2-9 ms of host time per step."""
        if self._grid is None or self._stale >= max(self.refresh_every, self.observations // 16):
            self._grid = self._build()
            self._stale = 0
        return self._grid

    def __call__(self, b: float, c: float, n: float) -> float:
        return self.grid()(b, c, n)

    def _build(self) -> CostGrid:
        """Every cell's seconds: its own estimate where seen, else the prior times the seen cells' residuals
        (inverse-distance weighted in grid steps), then made non-decreasing along B, c and n."""
        if not self.cells:
            raise CastspecError("the online cost model has seen no timings yet")
        if self.coef is None:
            self._refit()
        keys = torch.tensor(list(self.cells), dtype=torch.float64)  # [S, 3] grid indices of the seen cells
        estimates = torch.tensor([est for est, _ in self.cells.values()], dtype=torch.float64)
        weights = torch.tensor([min(w, 8.0) for _, w in self.cells.values()], dtype=torch.float64)
        log_prior = self._log_prior_grid()
        residuals = estimates - log_prior[tuple(keys.long().T)]
        # every cell's residual: the seen cells' residuals weighted by timings and inverse distance, as two
        # products with the cached [K, S] kernel (no elementwise pass over it: 1.5 of a 4.4 ms rebuild before)
        kernel = self._distance_kernel()
        filled = (kernel @ (weights * residuals) / (kernel @ weights)).reshape(log_prior.shape)
        values = log_prior + filled
        seen = tuple(keys.long().T)
        values[seen] = estimates
        values = self._transfer_batches(values, sorted({int(k) for k in keys[:, 0].tolist()}))
        # monotone in B, c and n. First the seen cells among themselves, by a weighted least-squares fit (log
        # seconds) in which a cell counts by its timings: a cell timed once (a probe point caught by a burst of
        # load) is pulled into line by the well-timed cells around it instead of raising every larger cell to
        # itself, as a running maximum did (one slow probe at c=64, n=4 priced every verify of 4 tokens or more
        # at 1.7 AR steps for a whole run, and CAST never verified such trees, so nothing corrected it). The fit
        # runs on the sub-grid the seen cells span (unseen cells in it have almost no say): a few hundred
        # cells, not the whole grid. Then every unseen cell is held between the largest fitted cell below it
        # and the smallest above it (orthant max / min, separable along the axes)
        axes = [sorted({int(i) for i in keys[:, d].tolist()}) for d in range(3)]
        span = torch.meshgrid(*(torch.tensor(a) for a in axes), indexing="ij")
        sub_weights = torch.full(span[0].shape, self.unseen_weight, dtype=torch.float64)
        position = [{index: k for k, index in enumerate(a)} for a in axes]
        sub_seen = tuple(torch.tensor([position[d][int(i)] for i in keys[:, d].tolist()]) for d in range(3))
        sub_weights[sub_seen] = torch.tensor([min(w, self.fit_weight_cap) for _, w in self.cells.values()],
                                             dtype=torch.float64)
        fitted = isotonic_grid(values[span], sub_weights, tolerance=1e-3)[sub_seen]
        below = torch.full_like(values, -math.inf)
        above = torch.full_like(values, math.inf)
        below[seen], above[seen] = fitted, fitted
        for dim in range(3):
            below = torch.cummax(below, dim=dim).values
            above = torch.cummin(above.flip(dim), dim=dim).values.flip(dim)
        values = torch.maximum(torch.minimum(values, above), below)
        values[seen] = fitted
        values = values.exp()
        for dim in range(3):  # what the fit's tolerance leaves
            values = torch.cummax(values, dim=dim).values
        return CostGrid(list(BATCH_AXIS), list(CONTEXT_AXIS), list(TOKEN_AXIS), values.tolist(), already_monotone=True)

    def _distance_kernel(self) -> torch.Tensor:
        """[K, S]: 1 / (1 + d^2)^2 between every grid cell and each seen cell (d in grid steps), in `cells`'
        order. Kept between rebuilds: cells are only ever added, so a rebuild computes the new cells' columns."""
        keys = list(self.cells)
        known = len(self._kernel_keys)
        if self._kernel_keys != keys[:known]:  # not a prefix any more (cannot happen by `observe`): start over
            known, self._kernel = 0, self._kernel[:, :0]
        if known < len(keys):
            new = torch.tensor(keys[known:], dtype=torch.float64)  # [S', 3] grid indices
            squared = (_GRID_INDICES[:, None, :] - new[None]).pow(2).sum(2)
            self._kernel = torch.cat([self._kernel, (1.0 + squared).pow(-2)], dim=1)
            self._kernel_keys = keys
        return self._kernel

    @staticmethod
    def _transfer_batches(values: torch.Tensor, seen_batches: list[int]) -> torch.Tensor:
        """A batch size no timing has reached is read off the nearest smaller one that was timed, at the same
        number of tokens in all (B rows of n cost about what one of B * n costs: the weights are read once and
        the work follows the tokens); a better guess across B than any smooth prior, whose n-slope comes from
        one batch size's few tokens. Beyond the token axis, linear in seconds from its last two points."""
        tokens = torch.tensor(TOKEN_AXIS, dtype=torch.float64)
        out = values.clone()
        for bi in range(len(BATCH_AXIS)):
            if bi in seen_batches:
                continue
            source = max((s for s in seen_batches if s < bi), default=seen_batches[0])
            wanted = tokens * BATCH_AXIS[bi] / BATCH_AXIS[source]
            plane = values[source].exp()  # [C, N] seconds
            right = torch.searchsorted(tokens, wanted).clamp(1, len(TOKEN_AXIS) - 1)
            left = right - 1
            x0, x1 = tokens[left].log(), tokens[right].log()
            weight = ((wanted.clamp(min=1.0).log() - x0) / (x1 - x0)).clamp(max=1.0)
            inside = plane[:, left] + weight * (plane[:, right] - plane[:, left])
            slope = (plane[:, -1] - plane[:, -2]) / (tokens[-1] - tokens[-2])
            beyond = plane[:, -1:] + slope[:, None] * (wanted - tokens[-1]).clamp(min=0)
            out[bi] = torch.where(wanted > tokens[-1], beyond, inside).clamp(min=1e-9).log()
        return out

    def _log_prior_grid(self) -> torch.Tensor:
        b, c, n = torch.meshgrid(*(torch.tensor(a, dtype=torch.float64)
                                   for a in (BATCH_AXIS, CONTEXT_AXIS, TOKEN_AXIS)), indexing="ij")
        a0, a1, a2, a3 = self.coef
        return (a0 + a1 * b * n + a2 * b * c + a3 * b * n * c * 1e-3).clamp(min=1e-9).log()

    @staticmethod
    def _centre(key: tuple[int, int, int]) -> tuple[int, int, int]:
        return BATCH_AXIS[key[0]], CONTEXT_AXIS[key[1]], TOKEN_AXIS[key[2]]

    # ---- learning -----------------------------------------------------------------------------------------

    def observe(self, b: int, c: int, n: int, seconds: float) -> None:
        """One timed forward of n new tokens per row for b rows after c cached entries."""
        if not (seconds > 0 and math.isfinite(seconds)) or b < 1 or n < 1:
            return
        c = max(c, 1)
        key = (_nearest(BATCH_AXIS, b), _nearest(CONTEXT_AXIS, c), _nearest(TOKEN_AXIS, n))
        if key in self.cells and self.cells[key][1] >= self.settled:
            # a drift is a departure from what was learned, not a first visit to a cell the prior guessed
            predicted = self(b, c, n)
            if predicted > 0:
                self.residuals.append(math.log(seconds) - math.log(predicted))
        x = math.log(seconds)
        if self.coef is not None:  # carry the timing to the cell's centre along the prior's shape
            x += math.log(self.prior(*self._centre(key))) - math.log(self.prior(b, c, n))
        cell = self.cells.get(key)
        if cell is None:
            self.cells[key] = [x, 1.0]
        elif self._take_drop(key, cell, x):
            pass
        else:
            # a young cell (a probe, a seeded profile point) is a guess: it moves fast and far; a settled one by
            # at most rate * clip, whatever the timing
            step = max(self.rate, 1.0 / (cell[1] + 1.0))
            clip = self.clip * max(1.0, 8.0 / (cell[1] + 1.0))
            cell[0] += step * max(-clip, min(clip, x - cell[0]))
            cell[1] = min(cell[1] + 1.0, self.max_weight)
        self.observations += 1
        self._stale += 1
        if self.coef is None or (cell is None and len(self.cells) <= 32) or self.observations % 32 == 0:
            self._refit()  # the prior's shape matters most while few cells are known
        self._follow_drops()
        self._follow()

    def _take_drop(self, key: tuple[int, int, int], cell: list[float], x: float) -> bool:
        """Load only ever adds time: a timing well below what a cell says (by more than `shift` in log) shows the
        machine's own speed through a cell that was timed while the machine was busy, or seeded from another
        hour's table. Two such timings in a row move the cell to the slower of them at once (returns True); the
        Huber step would take dozens. Slow timings get no such path: they are what a burst of load looks like,
        and a table too optimistic corrects itself anyway, since what it prices cheap gets run and timed."""
        departure = x - cell[0]
        self._recent.append((key, departure))
        if departure >= -self.shift:
            self._fast.pop(key, None)
            if departure <= self.shift:
                self._vouched[key] = self.observations
            return False
        fast = self._fast.setdefault(key, [])
        fast.append((self.observations, x))
        if len(fast) < 2:
            return False
        jump = max(fast[-1][1], fast[-2][1]) - cell[0]
        cell[0] += jump
        cell[1] = min(cell[1] + 1.0, self.max_weight)
        del self._fast[key]
        self._vouched[key] = self.observations
        self._jumps[key] = jump
        self._grid = None
        return True

    def _follow_drops(self) -> None:
        """Move the whole curve down once `quick` timings well below it have come from two cells or more: the
        table as a whole was too slow (a table scaled up, a profile taken under load), not one cell. A corrected
        cell counts as its two timings and keeps counting after later timings agree with it (they agree because
        it was corrected); an uncorrected cell's fast timings count while no timing agreed with it since and they
        are within the last `window` observations. The move is the smallest of those cells' corrections, and
        cells a timing vouched for (agreed with, or just moved) within the last `window` observations stay."""
        fresh_after = self.observations - self.window
        evidence = {key: (2, jump) for key, jump in self._jumps.items()}
        for key, timings in self._fast.items():
            fresh = [x for at, x in timings if at > fresh_after]
            if fresh and key not in evidence:
                evidence[key] = (len(fresh), max(fresh) - self.cells[key][0])
        if len(evidence) >= 2 and sum(count for count, _ in evidence.values()) >= self.quick:
            self._move_down(max(correction for _, correction in evidence.values()))

    def _move_down(self, move: float) -> None:
        """Every cell no timing vouched for lately, and the prior, by `move` (< 0) on the log scale."""
        recent = self.observations - self.window
        for key, cell in self.cells.items():
            if self._vouched.get(key, -math.inf) <= recent:
                cell[0] += move
        if self.coef is not None:
            self.coef = [k * math.exp(move) for k in self.coef]
        self._recent.clear()
        self._fast.clear()
        self._jumps.clear()
        self.residuals.clear()
        self.shifts += 1
        self._grid = None

    def _follow(self) -> None:
        """Move the whole curve when the last `window` timings sit on one side of it."""
        if len(self.residuals) < self.window:
            return
        middle = statistics.median(self.residuals)
        same_side = sum(1 for r in self.residuals if (r > 0) == (middle > 0)) / len(self.residuals)
        if abs(middle) <= self.shift or same_side < self.agreement:
            return
        # the move is the recent half's median: when the whole window's median first passes, its older half may
        # still be from before the change
        middle = statistics.median(list(self.residuals)[self.window // 2:])
        for cell in self.cells.values():
            cell[0] += middle
        if self.coef is not None:
            self.coef = [k * math.exp(middle) for k in self.coef]
        self.residuals.clear()
        self.shifts += 1
        self._grid = None

    def _refit(self) -> None:
        self.coef = fit_prior([(*self._centre(key), math.exp(est), weight)
                               for key, (est, weight) in self.cells.items()])
        self._grid = None  # the next read rebuilds

    # ---- persistence --------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"cells": [[*key, est, weight] for key, (est, weight) in sorted(self.cells.items())],
                "coef": self.coef, "observations": self.observations, "shifts": self.shifts}

    def merge_json(self, data: dict, weight_cap: float = 20.0) -> None:
        """Take in a saved curve: its cells join (weight-averaged with any this curve holds), capped in weight so
        that this run's timings can still move them."""
        for bi, ci, ni, est, weight in data.get("cells", []):
            key, weight = (int(bi), int(ci), int(ni)), min(float(weight), weight_cap)
            mine = self.cells.get(key)
            if mine is None:
                self.cells[key] = [float(est), weight]
            else:
                total = mine[1] + weight
                self.cells[key] = [(mine[0] * mine[1] + float(est) * weight) / total, min(total, self.max_weight)]
        self.observations += int(data.get("observations", 0))
        if self.cells:
            self._refit()

    def seed_from(self, grid: CostGrid, weight: float = 2.0) -> None:
        """Start from a profiled grid: each of its points becomes a cell observation of the given weight."""
        for b in grid.batch_sizes:
            for c in grid.contexts:
                for n in grid.tokens:
                    key = (_nearest(BATCH_AXIS, b), _nearest(CONTEXT_AXIS, c), _nearest(TOKEN_AXIS, n))
                    if key not in self.cells:
                        self.cells[key] = [math.log(max(grid(b, c, n), 1e-9)), weight]
        self._refit()



class OnlineCostTable(CostTable):
    """A cost table that learns: `observe_target` / `observe_draft` take the engine's timed forwards, and the
    `target` / `draft` grids CAST reads are the learned curves' current snapshots."""

    def __init__(self, meta: dict, target: LearnedCurve | None = None, draft: LearnedCurve | None = None,
                 path: Path | None = None, save_every: int = 256) -> None:
        self.meta = {**meta, "online": True}
        self.validation = {}
        self.target_curve, self.draft_curve = target or LearnedCurve(), draft or LearnedCurve()
        self.path, self.save_every = path, save_every
        self._unsaved = 0

    @property
    def target(self) -> CostGrid:
        return self.target_curve.grid()

    @property
    def draft(self) -> CostGrid | None:
        return self.draft_curve.grid() if self.draft_curve.ready else None

    @property
    def ready(self) -> bool:
        return self.target_curve.ready and self.draft_curve.ready

    def draft_sure(self, b: int, c: int, n: int) -> bool:
        """Whether the drafter's price at (b, c, n) rests on evidence (`LearnedCurve.sure`)."""
        return self.draft_curve.ready and self.draft_curve.sure(b, c, n)

    def observe_target(self, b: int, c: int, n: int, seconds: float) -> None:
        self.target_curve.observe(b, c, n, seconds)
        self._count()

    def observe_draft(self, b: int, c: int, n: int, seconds: float) -> None:
        """A draft forward's timing. One well under an AR step, timed so and priced so (a model-free drafter's
        lookups), moves no decision and is not learnt: learning its microseconds rebuilt the draft curve on nearly
        every step (2-9 ms each)."""
        negligible = NEGLIGIBLE_DRAFT * self.f_target(b, c, 1)
        if seconds < negligible and self.f_draft(b, c, n) < negligible:
            return
        self.draft_curve.observe(b, c, n, seconds)
        self._count()

    def _count(self) -> None:
        self._unsaved += 1
        if self.path is not None and self._unsaved >= self.save_every:
            self.flush()

    def probe(self, target_timer: Timer, draft_timer: Timer | None, batch_size: int = 1,
              points: tuple[tuple[int, int], ...] = ((64, 1), (64, 4), (64, 16), (64, 64), (512, 1), (512, 16)),
              passes: int = 3, progress: Callable[[str], None] | None = None) -> dict:
        """A few forwards of each model at `batch_size` (context, tokens in `points`): enough for a first shape
        (n = 64 too, so that the prior's slope in tokens is not read off the steep first few); every later step
        refines it. Every shape is run once untimed first (the first call of a shape pays for allocations and
        kernel selection), then timed in `passes` passes, each over all points of both models in a new order,
        and each point keeps its median: a burst of load elsewhere (a package install, say) hits one pass of a
        few points and is dropped, instead of pricing drafting far too high for a whole run.
        Returns the medians and the draft/target ratio at one token, 64 of context."""
        if passes < 1:
            raise CastspecError(f"the cost probe needs at least one pass, got {passes}")
        timers = {"target": (target_timer, self.target_curve)}
        if draft_timer is not None:
            timers["draft"] = (draft_timer, self.draft_curve)
        total, done = len(timers) * len(points) * (passes + 1), 0

        def counted(message: str) -> None:
            nonlocal done
            done += 1
            if progress:
                progress(f"probing costs {done}/{total}: {message}")

        timed = interleaved_medians({which: timer for which, (timer, _) in timers.items()},
                                    [(batch_size, c, n) for c, n in points], passes, warm=True, progress=counted)
        medians = {(which, c, n): seconds for (which, _, c, n), seconds in timed.items()}
        for (which, c, n), seconds in medians.items():
            timers[which][1].observe(batch_size, c, n, seconds)
        report = {"medians": medians}
        c, n = points[0]
        if draft_timer is not None:
            report["draft_to_target"] = medians["draft", c, n] / medians["target", c, n]
        return report

    def to_json(self) -> dict:
        """The ordinary cost-table JSON of the current snapshots, plus the cells that go on learning."""
        out = super().to_json()
        out["online"] = {"format": ONLINE_FORMAT, "target": self.target_curve.to_json(),
                         "draft": self.draft_curve.to_json()}
        return out

    def flush(self) -> None:
        """Save what was learned (to `path`, if it has one)."""
        if self.path is not None and self.target_curve.ready:
            self.save(self.path)
            self._unsaved = 0

    @classmethod
    def load_learned(cls, path: Path, meta: dict) -> OnlineCostTable:
        """A table that goes on from what a saved run learned (refused if the file is not one)."""
        try:
            data = json.loads(path.read_text())
            online = data["online"]
            if online.get("format") != ONLINE_FORMAT:
                raise KeyError("format")
        except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise CastspecError(f"{path} is not a learned castspec cost table ({e})") from e
        table = cls(meta, path=path)
        table.target_curve.merge_json(online.get("target", {}))
        table.draft_curve.merge_json(online.get("draft", {}))
        return table


def learned_path(home: Path, target_key: dict, drafter: str) -> Path:
    """Where the learned table of this setup and drafter lives: one file per (setup key, drafter)."""
    digest = hashlib.sha256(json.dumps([target_key, drafter], sort_keys=True).encode()).hexdigest()[:16]
    return home / "costs" / f"online-{digest}.json"
