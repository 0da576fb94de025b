"""Cost model: measured forward latency f(B, c, n) of a model (B sequences, KV context c, n new tokens each),
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
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from castspec.errors import CastspecError

FORMAT = "castspec-cost-table/1"
KEY_FIELDS = ("device", "threads", "model", "dtype", "torch", "transformers")


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


def model_identity(model) -> str:
    """Name plus a hash of the config and parameter count: two different models never share a key."""
    config = model.config.to_json_string(use_diff=False)
    params = sum(p.numel() for p in model.parameters())
    digest = hashlib.sha256(f"{config}|{params}".encode()).hexdigest()[:16]
    name = getattr(model.config, "_name_or_path", "") or model.config.model_type
    return f"{Path(str(name)).name}#{digest}"


def setup_key(model, dtype: torch.dtype | None = None) -> dict:
    device = next(model.parameters()).device
    return {
        "device": device_name(device),
        "threads": torch.get_num_threads(),
        "model": model_identity(model),
        "dtype": str(dtype or next(model.parameters()).dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


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

    def __post_init__(self) -> None:
        for name, axis in (("batch_sizes", self.batch_sizes), ("contexts", self.contexts), ("tokens", self.tokens)):
            if not axis or sorted(set(axis)) != list(axis):
                raise CastspecError(f"cost grid axis {name} must be non-empty and strictly increasing: {axis}")
        shape = (len(self.batch_sizes), len(self.contexts), len(self.tokens))
        if len(self.seconds) != shape[0] or any(len(r) != shape[1] or any(len(c) != shape[2] for c in r)
                                                for r in self.seconds):
            raise CastspecError(f"cost grid values do not match its axes {shape}")
        # a longer context or more tokens never costs less
        self.monotone = [isotonic_plane(plane) for plane in self.seconds]
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


def isotonic_plane(plane: list[list[float]], iterations: int = 200, tolerance: float = 1e-12) -> list[list[float]]:
    """The least-squares fit to plane[c][n] that is non-decreasing along both axes: Dykstra's alternating
    projections onto the row-monotone and the column-monotone sets (each projection is 1-D isotonic)."""
    rows, cols = len(plane), len(plane[0])
    x = [list(r) for r in plane]
    p = [[0.0] * cols for _ in range(rows)]
    q = [[0.0] * cols for _ in range(rows)]
    for _ in range(iterations):
        shifted = [[x[i][j] + p[i][j] for j in range(cols)] for i in range(rows)]
        y = [isotonic(r) for r in shifted]
        p = [[shifted[i][j] - y[i][j] for j in range(cols)] for i in range(rows)]
        shifted = [[y[i][j] + q[i][j] for j in range(cols)] for i in range(rows)]
        columns = [isotonic([shifted[i][j] for i in range(rows)]) for j in range(cols)]
        new = [[columns[j][i] for j in range(cols)] for i in range(rows)]
        q = [[shifted[i][j] - new[i][j] for j in range(cols)] for i in range(rows)]
        change = max(abs(new[i][j] - x[i][j]) for i in range(rows) for j in range(cols))
        x = new
        if change < tolerance:
            break
    # the column step ends each round; one last row pass removes any residual row violation of order tolerance
    return [[max(r[: j + 1]) for j in range(cols)] for r in x]


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
        tmp = path.with_suffix(path.suffix + ".tmp")
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
            mismatched = [k for k in KEY_FIELDS if k in expect and table.meta.get("target", {}).get(k) != expect[k]]
            if mismatched:
                detail = "; ".join(f"{k}: table {table.meta.get('target', {}).get(k)!r}, here {expect[k]!r}"
                                   for k in mismatched)
                raise CastspecError(f"cost table {path} was measured on another setup ({detail}); "
                                    "profile this setup or force the table")
        return table


def _grid_json(grid: CostGrid) -> dict:
    return {"batch_sizes": grid.batch_sizes, "contexts": grid.contexts, "tokens": grid.tokens,
            "seconds": grid.seconds}


def _grid_from(data: dict) -> CostGrid:
    return CostGrid(list(data["batch_sizes"]), list(data["contexts"]), list(data["tokens"]), data["seconds"])


# ---- measuring -------------------------------------------------------------------------------------------------


def _filled_cache(model, batch_size: int, context: int):
    """A KV cache holding `context` entries of random values: attention costs depend on shapes only."""
    from castspec.kv import new_cache

    config = model.config
    cache = new_cache(model)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    param = next(model.parameters())
    for layer in range(config.num_hidden_layers):
        k = torch.randn(batch_size, heads, context, head_dim, dtype=param.dtype, device=param.device)
        cache.update(k, torch.randn_like(k), layer)
    return cache


def _chain_after(batch_size: int, context: int, tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and the [B, 1, n, c + n] mask of `tokens` new tokens per row, causal among themselves, after
    `context` cached ones (a chain costs what any tree of the same size costs)."""
    positions = torch.arange(context, context + tokens, device=device).expand(batch_size, tokens)
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
    mask = torch.cat([torch.ones(tokens, context, dtype=torch.bool, device=device), causal], 1)
    return positions, mask[None, None].expand(batch_size, 1, tokens, context + tokens)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def time_forward(model, batch_size: int, context: int, tokens: int, repeats: int = 3, warmup: int = 1) -> float:
    """Median wall seconds of one tree-masked forward of `tokens` new tokens per row after `context` cached ones."""
    from castspec import kv

    device = next(model.parameters()).device
    cache = _filled_cache(model, batch_size, context)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch_size, tokens), device=device)
    positions, mask = _chain_after(batch_size, context, tokens, device)
    times = []
    for i in range(warmup + repeats):
        _sync(device)
        start = time.perf_counter()
        kv.forward(model, cache, ids, positions, mask)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        kv.crop(cache, context)
    return statistics.median(times)


@torch.inference_mode()
def time_head(head, target_model, batch_size: int, context: int, tokens: int, repeats: int = 3,
              warmup: int = 1) -> float:
    """Median seconds of one EAGLE-head draft layer: `tokens` tree nodes per row after `context` cached pairs,
    the head's logits included as drafting computes them (the target's lm_head, or its rows for the head's draft
    vocabulary)."""
    from castspec import kv

    param = next(head.parameters())
    cache = _filled_cache(head, batch_size, context)
    ids = torch.randint(0, target_model.config.vocab_size, (batch_size, tokens), device=param.device)
    features = torch.randn(batch_size, tokens, head.config.hidden_size, dtype=param.dtype, device=param.device)
    positions, mask = _chain_after(batch_size, context, tokens, param.device)
    embed, lm_head = target_model.get_input_embeddings(), target_model.get_output_embeddings()
    times = []
    for i in range(warmup + repeats):
        _sync(param.device)
        start = time.perf_counter()
        head.draft_logits(head(embed(ids), features, positions, mask, cache), lm_head)
        _sync(param.device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        kv.crop(cache, context)
    return statistics.median(times)


def time_ngram(tokens: int, context: int, repeats: int = 3, drafter: str = "ngram") -> float:
    """Median seconds for a model-free drafter ('ngram' or 'suffix') to propose children for `tokens` nodes
    over a `context` history."""
    from castspec.drafters.ngram import NgramDrafter
    from castspec.drafters.suffix import SuffixDrafter
    from castspec.tree import TreePool

    rng = random.Random(0)
    history = [rng.randrange(64) for _ in range(context)]
    times = []
    for _ in range(repeats):
        d = SuffixDrafter() if drafter == "suffix" else NgramDrafter()
        d.begin([history], 4)
        pool = TreePool.from_lists([history[-1]] + [rng.randrange(64) for _ in range(tokens)], [-1] + [0] * tokens)
        start = time.perf_counter()
        d.expand([pool], [list(range(1, tokens + 1))], 4)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


Timer = Callable[[int, int, int], float]


def measure_grids(timers: dict[str, Timer], batch_sizes: list[int], contexts: list[int], tokens: list[int],
                  passes: int = 3, progress: Callable[[str], None] | None = None,
                  seed: int = 0) -> dict[str, CostGrid]:
    """Time every grid point of every timer once per pass, each pass in a fresh random order over all timers
    and points, and keep each point's median over the passes. Measuring a point's repeats back to back lets a
    burst of load elsewhere, or a slow first call after the previous shape, shift that point (or a run of its
    neighbours) as a whole; spread over passes, such a slowdown hits one pass of scattered points and the median
    drops it. Interleaving the timers puts the target's and the drafter's curves under the same conditions."""
    if passes < 1:
        raise CastspecError(f"profiling needs at least one pass, got {passes}")
    points = [(which, bi, ci, ni) for which in timers for bi in range(len(batch_sizes))
              for ci in range(len(contexts)) for ni in range(len(tokens))]
    samples: dict[tuple[str, int, int, int], list[float]] = {p: [] for p in points}
    rng = random.Random(seed)
    for k in range(passes):
        order = list(points)
        rng.shuffle(order)
        for which, bi, ci, ni in order:
            b, c, n = batch_sizes[bi], contexts[ci], tokens[ni]
            samples[which, bi, ci, ni].append(timers[which](b, c, n))
            if progress:
                progress(f"pass {k + 1}/{passes} {which} B={b} c={c} n={n}: "
                         f"{samples[which, bi, ci, ni][-1] * 1e3:.1f} ms")
    return {which: CostGrid(list(batch_sizes), list(contexts), list(tokens),
                            [[[statistics.median(samples[which, bi, ci, ni]) for ni in range(len(tokens))]
                              for ci in range(len(contexts))] for bi in range(len(batch_sizes))])
            for which in timers}


def token_grid(max_tokens: int) -> list[int]:
    base = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    return [n for n in base if n < max_tokens] + [max_tokens]


def validate(table: CostTable, timers: dict[str, Timer], points: Iterable[tuple[int, int, int]]) -> dict:
    """Measure held-out points and compare with the table's predictions: absolute percentage errors."""
    report = {}
    for which, timer in timers.items():
        grid = table.target if which == "target" else table.draft
        if grid is None:
            continue
        rows = []
        for b, c, n in points:
            measured = timer(b, c, n)
            predicted = grid(b, c, n)
            rows.append({"batch_size": b, "context": c, "tokens": n, "measured_s": measured,
                         "predicted_s": predicted, "ape": abs(predicted - measured) / measured})
        errors = sorted(r["ape"] for r in rows)
        report[which] = {"points": rows, "median_ape": statistics.median(errors),
                         "p90_ape": errors[min(len(errors) - 1, int(round(0.9 * (len(errors) - 1))))]}
    return report


def held_out_points(grid: CostGrid, count: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """Random (B, c, n) off the grid's c and n points (B among the measured ones), inside its range."""
    rng = random.Random(seed)
    points = []
    while len(points) < count:
        b = rng.choice(grid.batch_sizes)
        c = rng.randint(grid.contexts[0], grid.contexts[-1])
        n = rng.randint(grid.tokens[0], grid.tokens[-1])
        if c not in grid.contexts and n not in grid.tokens:
            points.append((b, c, n))
    return points


def plot_table(table: CostTable, out: str | Path, compare: CostTable | None = None) -> None:
    """The table's measured curves (ms per forward against n, per batch size and context); with `compare`
    (a learned table, say), that table's predictions at the same points, dotted, with its median deviation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grids = [("target", table.target)] + ([("draft", table.draft)] if table.draft is not None else [])
    fig, axes = plt.subplots(1, len(grids), figsize=(6.5 * len(grids), 4.5), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, (name, grid) in zip(axes[0], grids, strict=True):
        other = None if compare is None else compare.target if name == "target" else compare.draft
        cmap = plt.get_cmap("viridis")
        for bi, b in enumerate(grid.batch_sizes):
            color = cmap(bi / max(1, len(grid.batch_sizes) - 1))
            shown = grid.contexts if len(grid.contexts) <= 4 else [grid.contexts[i] for i in
                                                                     (0, len(grid.contexts) // 2, -1)]
            for si, c in enumerate(shown):
                ci = grid.contexts.index(c)
                ax.plot(grid.tokens, [s * 1e3 for s in grid.seconds[bi][ci]], styles[si % 4], color=color,
                        marker=".", label=f"B={b}, c={c}")
                if other is not None:
                    ax.plot(grid.tokens, [other(b, c, n) * 1e3 for n in grid.tokens], ":", color=color,
                            marker="x", markersize=4, linewidth=1)
        ax.set_xlabel("new tokens per sequence (n)")
        ax.set_ylabel("ms per forward")
        model = table.meta.get(name, {}).get("model", name)
        title = f"{name}: {model}"
        if other is not None:
            deviation = statistics.median(abs(other(b, c, n) / grid(b, c, n) - 1) for b in grid.batch_sizes
                                          for c in grid.contexts for n in grid.tokens)
            title += f"\ndotted x: compared table, median deviation {deviation * 100:.1f}%"
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncols=2)
    fig.suptitle(f"{table.meta.get('target', {}).get('device', '')}, "
                 f"{table.meta.get('target', {}).get('dtype', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
