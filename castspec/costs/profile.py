"""Measuring costs: time target forwards, head forwards and model-free drafter lookups on this machine, over a grid
(`castspec profile`) or at a few points (the online model's first probe), validate a table on held-out points
and plot it."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from castspec.costs.table import CostGrid, CostTable, Timer, setup_key
from castspec.errors import CastspecError


def filled_cache(model, batch_size: int, context: int):
    """A KV cache holding `context` entries of random values: attention costs depend on shapes only."""
    from castspec.decode.kv import new_cache

    config = model.config
    cache = new_cache(model)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    param = next(model.parameters())
    for layer in range(config.num_hidden_layers):
        k = torch.randn(batch_size, heads, context, head_dim, dtype=param.dtype, device=param.device)
        cache.update(k, torch.randn_like(k), layer)
    return cache


def chain_after(batch_size: int, context: int, tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
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
    from castspec.decode import kv

    device = next(model.parameters()).device
    cache = filled_cache(model, batch_size, context)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch_size, tokens), device=device)
    positions, mask = chain_after(batch_size, context, tokens, device)
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
def time_target_forward(model, batch_size: int, context: int, tokens: int, repeats: int = 3, warmup: int = 1
                        ) -> float:
    """`time_forward` through the target's own path (`decode.target.Target`: its slot cache and ragged
    attention), which is what a decoding step runs; rows hold `context` zero entries each."""
    from castspec.decode.target import Target
    from castspec.decode.tree import DraftTree

    device = next(model.parameters()).device
    target = Target(model)
    target.hold_rows(batch_size, context)
    vocab = model.config.vocab_size
    trees = [DraftTree.chain(torch.randint(0, vocab, (tokens,)).tolist()) for _ in range(batch_size)]
    times = []
    for i in range(warmup + repeats):
        _sync(device)
        start = time.perf_counter()
        target.verify(trees)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def time_head(head, target_model, batch_size: int, context: int, tokens: int, repeats: int = 3,
              warmup: int = 1) -> float:
    """Median seconds of one EAGLE-head draft layer: `tokens` tree nodes per row after `context` cached pairs,
    the head's logits included as drafting computes them (the target's lm_head, or its rows for the head's draft
    vocabulary)."""
    from castspec.decode import kv

    param = next(head.parameters())
    cache = filled_cache(head, batch_size, context)
    ids = torch.randint(0, target_model.config.vocab_size, (batch_size, tokens), device=param.device)
    features = torch.randn(batch_size, tokens, head.config.hidden_size, dtype=param.dtype, device=param.device)
    positions, mask = chain_after(batch_size, context, tokens, param.device)
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
    from castspec.decode.tree import TreePool
    from castspec.drafters.ngram import NgramDrafter
    from castspec.drafters.suffix import SuffixDrafter

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



def interleaved_medians(timers: dict[str, Timer], points: list[tuple[int, int, int]], passes: int = 3,
                        warm: bool = False, progress: Callable[[str], None] | None = None,
                        seed: int = 0) -> dict[tuple[str, int, int, int], float]:
    """Time every (B, c, n) point of every timer once per pass, each pass in a fresh random order over all timers
    and points, and keep each point's median over the passes. Measuring a point's repeats back to back lets a
    burst of load elsewhere, or a slow first call after the previous shape, shift that point (or a run of its
    neighbours) as a whole; spread over passes, such a slowdown hits one pass of scattered points and the median
    drops it. Interleaving the timers puts the target's and the drafter's curves under the same conditions. With
    `warm`, a first untimed pass runs every shape once (a shape's first call pays for allocations and kernel
    selection). Returns {(timer name, b, c, n): median seconds}."""
    if passes < 1:
        raise CastspecError(f"timing needs at least one pass, got {passes}")
    order = [(which, *point) for which in timers for point in points]
    samples: dict[tuple[str, int, int, int], list[float]] = {key: [] for key in order}
    rng = random.Random(seed)
    first = 0 if warm else 1
    for k in range(first, passes + 1):
        rng.shuffle(order)
        for which, b, c, n in order:
            seconds = timers[which](b, c, n)
            if k > 0:
                samples[which, b, c, n].append(seconds)
            if progress:
                step = "warm-up" if k == 0 else f"pass {k}/{passes}"
                progress(f"{step} {which} B={b} c={c} n={n}: {seconds * 1e3:.1f} ms")
    return {key: statistics.median(values) for key, values in samples.items()}


def measure_grids(timers: dict[str, Timer], batch_sizes: list[int], contexts: list[int], tokens: list[int],
                  passes: int = 3, progress: Callable[[str], None] | None = None,
                  seed: int = 0) -> dict[str, CostGrid]:
    """Every grid point of every timer, timed in interleaved passes (`interleaved_medians`)."""
    points = [(b, c, n) for b in batch_sizes for c in contexts for n in tokens]
    medians = interleaved_medians(timers, points, passes, progress=progress, seed=seed)
    return {which: CostGrid(list(batch_sizes), list(contexts), list(tokens),
                            [[[medians[which, b, c, n] for n in tokens] for c in contexts] for b in batch_sizes])
            for which in timers}


def table_meta(target, target_source: str, dtype: str, repeats: int, command: str, draft=None,
               draft_source: str | None = None) -> dict:
    """What a cost table records of its setup: the keys it is matched by, and where the models came from."""
    meta = {"target": {**setup_key(target), "source": target_source, "dtype_name": dtype},
            "date": time.strftime("%Y-%m-%d %H:%M"), "repeats": repeats, "command": command}
    if draft is not None:
        meta["draft"] = {**setup_key(draft), "source": draft_source, "dtype_name": dtype}
    return meta


def measure_table(target, timers: dict[str, Timer], batch_sizes: list[int], contexts: list[int], tokens: list[int],
                  meta: dict, passes: int) -> CostTable:
    """A cost table: every timer ('target', and 'draft' if given) measured on the grid in `passes` interleaved
    passes, with a progress bar."""
    from tqdm import tqdm

    limit = getattr(target.config, "max_position_embeddings", None)
    if limit and contexts[-1] + tokens[-1] > limit:
        raise CastspecError(f"context {contexts[-1]} + {tokens[-1]} tokens exceeds the model's window {limit}")
    bar = tqdm(total=len(batch_sizes) * len(contexts) * len(tokens) * len(timers) * passes, desc="profile",
               unit="pt")
    grids = measure_grids(timers, batch_sizes, contexts, tokens, passes,
                          lambda msg: (bar.set_postfix_str(msg), bar.update()))
    bar.close()
    return CostTable(meta, grids["target"], grids.get("draft"))


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
