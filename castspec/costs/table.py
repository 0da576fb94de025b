"""The cost table: measured forward latency f(B, c, n) of a model (B sequences, KV context c, n new tokens each),
stored as a table keyed by the setup it was measured on, read back by interpolation.

Interpolation scheme: at each measured batch size, bilinear in (c, n) over the measured grid, with linear
extrapolation from the last two grid points beyond its edges (attention grows about linearly in c, the MLP in n)
and never below the nearest measured value; between measured batch sizes, linear in B; beyond them, linear
extrapolation from the two nearest (or proportional to B when only one was measured). Before use, each batch
size's (c, n) plane is replaced by its least-squares isotonic fit (non-decreasing in c and in n), so the lookup
is non-decreasing in n and c too; unlike a running maximum, one slow outlier is averaged with its neighbours
instead of being carried to every larger point."""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from castspec.decode.compiled import is_compiled
from castspec.decode.prepack import is_prepacked
from castspec.decode.widen_linear import is_widened
from castspec.errors import CastspecError

FORMAT = "castspec-cost-table/1"
KEY_FIELDS = ("device", "threads", "model", "dtype", "torch", "transformers", "linears")


# The widest matrix instructions decide a CPU's speed more than its name: two "AMD EPYC" machines, one with native
# bf16 and one without, time a bf16 forward 3x apart, so a cost table from one must not be read on the other.
CPU_MATH_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "neon", "asimd")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")):
                flags.update(line.split(":", 1)[1].split())
    except OSError:
        pass
    best = next((flag for flag in CPU_MATH_FLAGS if flag in flags), None)
    return f"{name} [{best}]" if best else name


def machine_label() -> str:
    """This machine as results name it: the CPU with its widest matrix instructions, and the torch threads."""
    return f"{device_name(torch.device('cpu'))}, {torch.get_num_threads()} threads"


def model_identity(model) -> str:
    """Name plus a hash of the config and parameter count: two different models never share a key, and the same
    model loaded from another folder (another $CASTSPEC_HOME, a copy) keeps its key: the config's record of the
    folder it was read from is left out of the hash (it once was not, and a table learned in one home was never
    found from another)."""
    config = model.config.to_dict()
    config.pop("_name_or_path", None)
    text = json.dumps(config, sort_keys=True, default=str)
    params = sum(p.numel() for p in model.parameters())
    digest = hashlib.sha256(f"{text}|{params}".encode()).hexdigest()[:16]
    name = getattr(model.config, "_name_or_path", "") or model.config.model_type
    return f"{Path(str(name)).name}#{digest}"


def setup_key(model, dtype: torch.dtype | None = None) -> dict:
    import transformers  # here, not at the top: the table itself (and the policies reading it) need no model code

    device = next(model.parameters()).device
    key = {
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "model": model_identity(model),
        "dtype": str(dtype or next(model.parameters()).dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if is_prepacked(model):  # faster forwards than the same model's unpacked: tables of its own
        key["linears"] = "onednn-prepacked"
        if limit := getattr(model, "castspec_row_limit", 0):  # forwards of a few rows by castspec's kernel: faster
            key["linears"] += "+row-kernel" + (f"-{limit}-rows" if limit > 1 else "")
        if getattr(model, "castspec_fused", 0):  # siblings' weights stacked (one call for q/k/v): faster again
            key["linears"] += "+fused"
    if is_widened(model):  # bf16 widened by castspec's AVX2 kernel: far faster than aten's bf16 path there
        key["linears"] = "widened-avx2"
    if is_compiled(model):  # likewise for a compiled decode forward
        key["forward"] = "compiled"
    return key


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise linear; beyond the last point linear from the end segment, never below the last value; before the
    first point the first value (a forward after fewer cached entries than the smallest timed context costs what
    that one did: extrapolating down could reach zero, a free forward)."""
    return _interp_with(xs, ys.__getitem__, x)


def _interp_with(xs: list[float], value, x: float) -> float:
    """`_interp` with the ys computed on demand (`value(i)`): only the two ends of x's segment are needed."""
    if len(xs) == 1 or x <= xs[0]:
        return value(0)
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], value(i), value(i + 1)
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if x > xs[-1]:
        return max(y, y1)
    return y


@dataclass
class CostGrid:
    """Seconds per forward on a grid: seconds[b][ci][ni] for batch_sizes[b], contexts[ci], tokens[ni]."""

    batch_sizes: list[int]
    contexts: list[int]
    tokens: list[int]
    seconds: list[list[list[float]]]
    # True where the values are non-decreasing along every axis already (the online model fits its grids so):
    # the monotone fit below is then skipped (it was half of each rebuild of the online model's grid)
    already_monotone: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, axis in (("batch_sizes", self.batch_sizes), ("contexts", self.contexts), ("tokens", self.tokens)):
            if not axis or sorted(set(axis)) != list(axis):
                raise CastspecError(f"cost grid axis {name} must be non-empty and strictly increasing: {axis}")
        shape = (len(self.batch_sizes), len(self.contexts), len(self.tokens))
        if len(self.seconds) != shape[0] or any(len(r) != shape[1] or any(len(c) != shape[2] for c in r)
                                                for r in self.seconds):
            raise CastspecError(f"cost grid values do not match its axes {shape}")
        # a longer context or more tokens never costs less
        self.monotone = self.seconds if self.already_monotone else [isotonic_plane(p) for p in self.seconds]
        self._memo: dict[tuple[float, float, float], float] = {}

    def _at_batch(self, b: int, c: float, n: float) -> float:
        plane = self.monotone[b]
        return _interp_with(self.contexts, lambda ci: _interp(self.tokens, plane[ci], n), c)

    def __call__(self, batch_size: float, context: float, tokens: float) -> float:
        # CAST asks for the same few points many times per step: a grid never changes, so answers are kept
        key = (batch_size, context, tokens)
        cached = self._memo.get(key)
        if cached is not None:
            return cached
        if len(self.batch_sizes) == 1:
            value = self._at_batch(0, context, tokens)
            if batch_size > self.batch_sizes[0]:
                value *= batch_size / self.batch_sizes[0]
        else:
            value = _interp_with(self.batch_sizes, lambda b: self._at_batch(b, context, tokens), batch_size)
        if len(self._memo) > 4096:
            self._memo.clear()
        self._memo[key] = value
        return value


def isotonic(values: list[float], weights: list[float] | None = None) -> list[float]:
    """Weighted least-squares non-decreasing fit of a sequence (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, length]
    for v, w in zip(values, weights or [1.0] * len(values), strict=True):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, n1), (m2, w2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2) if w1 + w2 > 0 else (m1 + m2) / 2, w1 + w2, n1 + n2]
    return [m for m, _, n in blocks for _ in range(n)]


def isotonic_lines(values: torch.Tensor, weights: torch.Tensor, dim: int) -> torch.Tensor:
    """The weighted least-squares non-decreasing fit along `dim` of every line of `values` at once, by the
    max-min formula fit(i) = max_{j<=i} min_{k>=i} mean(values[j..k]) (means weighted; O(L^3) per line, but a
    cost grid's lines are short and torch does them all in one pass)."""
    x, w = values.movedim(dim, -1), weights.movedim(dim, -1)
    length = x.shape[-1]
    pad = torch.zeros(*x.shape[:-1], 1, dtype=x.dtype)
    sums, totals = torch.cat([pad, (x * w).cumsum(-1)], -1), torch.cat([pad, w.cumsum(-1)], -1)
    # means[..., j, k] over j..k; entries with k < j take +inf so that the min over k >= i never sees them
    means = (sums[..., None, 1:] - sums[..., :-1, None]) / (totals[..., None, 1:] - totals[..., :-1, None])
    order = torch.arange(length)
    means = means.masked_fill(order[None, :] < order[:, None], math.inf)
    right_min = means.flip(-1).cummin(-1).values.flip(-1)  # [..., j, i]: min over k >= i
    right_min = right_min.masked_fill(order[:, None] > order[None, :], -math.inf)  # only j <= i
    return right_min.amax(-2).movedim(-1, dim)


def isotonic_grid(values: torch.Tensor, weights: torch.Tensor | None = None, iterations: int = 500,
                  tolerance: float = 1e-10) -> torch.Tensor:
    """The weighted least-squares fit to `values` that is non-decreasing along every axis: Dykstra's alternating
    projections onto the sets monotone along each axis (each projection a weighted 1-D isotonic fit of every
    line), which converge to the projection onto their intersection. A point with little weight (an unseen or
    once-timed cell) is pulled into line by the points with much weight around it, instead of raising all of
    them, as a running maximum would. Weights must be positive."""
    values = values.to(torch.float64)
    weights = torch.ones_like(values) if weights is None else weights.to(torch.float64).expand_as(values)
    x = values.clone()
    increments = [torch.zeros_like(x) for _ in range(x.dim())]
    for _ in range(iterations):
        before = x
        for dim in range(x.dim()):
            shifted = x + increments[dim]
            x = isotonic_lines(shifted, weights, dim)
            increments[dim] = shifted - x
        if (x - before).abs().max() < tolerance:
            break
    # what Dykstra leaves of a violation is of order `tolerance`: a running maximum removes it exactly
    for dim in range(x.dim()):
        x = x.cummax(dim).values
    return x


def isotonic_plane(plane: list[list[float]]) -> list[list[float]]:
    """The least-squares fit to plane[c][n] that is non-decreasing along both axes (`isotonic_grid`)."""
    return isotonic_grid(torch.tensor(plane, dtype=torch.float64)).tolist()


@dataclass
class CostTable:
    """Latency tables of the target and of the drafter, and the setup they were measured on."""

    meta: dict
    target: CostGrid
    draft: CostGrid | None = None
    validation: dict = field(default_factory=dict)

    def f_target(self, batch_size: int, context: int, tokens: int) -> float:
        return self.target(batch_size, context, tokens)

    def f_draft(self, batch_size: int, context: int, tokens: int) -> float:
        if self.draft is None:
            raise CastspecError("this cost table has no drafter table")
        return self.draft(batch_size, context, tokens)

    def normalised_target(self, batch_size: int, context: int, tokens: int) -> float:
        """f_T(B, c, n) / f_T(B, c, 1): the cost of verifying n tokens in units of one AR step."""
        return self.f_target(batch_size, context, tokens) / self.f_target(batch_size, context, 1)

    def normalised_draft(self, batch_size: int, context: int, tokens: int) -> float:
        """f_D(B, c, n) / f_T(B, c, 1): the cost of drafting n nodes in units of one AR step."""
        return self.f_draft(batch_size, context, tokens) / self.f_target(batch_size, context, 1)

    def to_json(self) -> dict:
        out = {"format": FORMAT, "meta": self.meta, "target": _grid_json(self.target)}
        if self.draft is not None:
            out["draft"] = _grid_json(self.draft)
        if self.validation:
            out["validation"] = self.validation
        return out

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # a name of this process's own: two processes saving the same learned table must not rename one file twice
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)

    @staticmethod
    def load(path: str | Path, expect: dict | None = None, force: bool = False) -> CostTable:
        """Read a table; refuse one measured on another setup than `expect` (a `setup_key`) unless forced."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise CastspecError(f"cost table {path} does not exist") from e
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CastspecError(f"cost table {path} is corrupt or truncated (not valid JSON: {e})") from e
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CastspecError(f"{path} is not a castspec cost table (format {FORMAT!r} expected)")
        try:
            table = CostTable(data["meta"], _grid_from(data["target"]),
                              _grid_from(data["draft"]) if "draft" in data else None, data.get("validation", {}))
        except (KeyError, TypeError, ValueError) as e:
            raise CastspecError(f"cost table {path} is corrupt: missing or malformed {e}") from e
        if expect is not None and not force:
            measured = table.meta.get("target", {})
            # a key field either side records must agree: "linears" is recorded for packed models only
            mismatched = [k for k in KEY_FIELDS if (k in expect or k in measured) and measured.get(k) != expect.get(k)]
            if mismatched:
                detail = "; ".join(f"{k}: table {measured.get(k)!r}, here {expect.get(k)!r}"
                                   for k in mismatched)
                raise CastspecError(f"cost table {path} was measured on another setup ({detail}); "
                                    "profile this setup or force the table")
        return table


def _grid_json(grid: CostGrid) -> dict:
    return {"batch_sizes": grid.batch_sizes, "contexts": grid.contexts, "tokens": grid.tokens,
            "seconds": grid.seconds}


def _grid_from(data: dict) -> CostGrid:
    return CostGrid(list(data["batch_sizes"]), list(data["contexts"]), list(data["tokens"]), data["seconds"])


Timer = Callable[[int, int, int], float]  # (batch size, context, new tokens) -> seconds of one forward
