"""`castspec tune`: find the best fixed tree (an EAGLE-2 grid, or chain lengths) for a target and drafter on a
tuning split, the way a careful user of a fixed-tree system would, so that CAST can be compared with it.

1. The target decodes the tuning prompts plainly (greedy): these outputs are the reference.
2. Every grid point is replayed against the reference (castspec/bench/replay.py): exact accepted lengths, measured
   drafting time, verify forwards priced by the cost table. CAST (auto and the paper's thresholds) is replayed
   alongside, so the whole grid and CAST are compared on the same footing.
3. The `measure` best grid points by predicted speed-up are run for real, with AR and CAST, in one interleaved
   benchmark on the same prompts; the fastest measured one is the grid-best. Predicted and measured speed-ups
   are reported side by side, which is also a check of the cost model."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

from tqdm import tqdm

from castspec.api import Engine, make_policy
from castspec.bench.replay import reference_features, replay
from castspec.bench.runner import (
    METHOD_OPTIONS,
    MethodSpec,
    encode_prompts,
    markdown_table,
    parse_methods,
    policy_options,
    run_benchmark,
)
from castspec.costs.table import CostTable
from castspec.errors import CastspecError

DEFAULT_GRIDS = {"eagle2": "top_k=2,4,8,10;depth=2,3,4,5,6,7;total_tokens=8,16,32,60",
                 "chain": "chain_length=1,2,3,4,5,6,8"}
GRID_KEYS = {method: METHOD_OPTIONS[method] for method in ("eagle2", "chain")}  # the fixed trees' options


def parse_grid(method: str, text: str | None) -> list[dict]:
    """'top_k=2,4;depth=3' -> every combination, as policy options; keys the method lacks are refused."""
    if method not in GRID_KEYS:
        raise CastspecError(f"tune searches fixed trees: --method eagle2 or chain, not {method!r}")
    axes: dict[str, list[int]] = {}
    for part in filter(None, (p.strip() for p in (text or DEFAULT_GRIDS[method]).split(";"))):
        key, _, values = part.partition("=")
        key = key.strip()
        if key not in GRID_KEYS[method]:
            raise CastspecError(f"grid key {key!r} is not an option of {method} (it has "
                                f"{', '.join(GRID_KEYS[method])})")
        try:
            axes[key] = sorted({int(v) for v in values.split(",") if v.strip()})
        except ValueError as e:
            raise CastspecError(f"grid values for {key} must be integers, got {values!r}") from e
        if not axes[key] or min(axes[key]) < 1:
            raise CastspecError(f"grid values for {key} must be positive integers, got {values!r}")
    if not axes:
        raise CastspecError("the grid is empty")
    points = [dict(zip(axes, combo, strict=True)) for combo in itertools.product(*axes.values())]
    for point in points:
        make_policy(method, **point)  # refuse impossible points before any model work
    return points


def method_label(method: str, drafter: str, options: dict) -> str:
    return f"{method}:{drafter}:" + ",".join(f"{k}={v}" for k, v in options.items())


def _replay_all(make_drafter, policy_of, prompts_ids: list[list[int]], references: list[list[int]],
                costs: CostTable, max_new_tokens: int, features: list | None = None) -> dict:
    features = features or [None] * len(prompts_ids)
    results = [replay(make_drafter(), policy_of(), ids, ref, costs, max_new_tokens, feats)
               for ids, ref, feats in zip(prompts_ids, references, features, strict=True)]
    steps = sum(len(r.accepted) for r in results)
    decode_s, ar_s = sum(r.decode_s for r in results), sum(r.ar_s for r in results)
    return {"predicted_speedup": round(ar_s / decode_s, 4) if decode_s else None,
            "tau": round(sum(r.new_tokens - 1 for r in results) / steps, 3) if steps else None,
            "mean_verify": round(statistics.fmean(n for r in results for n in r.tree_sizes), 2) if steps else 0,
            "mean_depth": round(statistics.fmean(d for r in results for d in r.depths), 2) if steps else 0,
            "draft_s": round(sum(r.draft_s for r in results), 3),
            "verify_s": round(sum(r.verify_s for r in results), 3),
            "ar_s": round(ar_s, 3)}


def run_tune(target_model, tokenizer, draft_model, method: str, drafter: str, grid: list[dict], prompts: list[dict],
             max_new_tokens: int, costs: CostTable, make_drafter, measure: int = 3, head=None) -> dict:
    """Steps 1-3 of the module docstring. `make_drafter()` builds a fresh drafter for each replay; `head`
    ((EagleHead, its source), as for run_benchmark) when the drafter is 'head'."""
    reference_engine = Engine(target_model, tokenizer)
    ids = encode_prompts(reference_engine, prompts)
    references = [reference_engine.generate(prompt_ids=i, max_new_tokens=max_new_tokens).output_ids
                  for i in tqdm(ids, desc="reference (AR)", unit="prompt")]
    layers = make_drafter().feature_layers
    features = [reference_features(target_model, i, ref, layers) for i, ref in zip(ids, references, strict=True)
                ] if layers else None
    labels = [method_label(method, drafter, point) for point in grid]
    labels += [f"cast:{drafter}", f"cast:{drafter}:calibrate=1", f"cast:{drafter}:auto=0"]
    replayed = []
    for spec in tqdm(parse_methods(";".join(labels)), desc="replay", unit="config"):
        options = policy_options(spec, costs)
        row = _replay_all(make_drafter, lambda s=spec.method, o=options: make_policy(s, **o), ids, references,
                          costs, max_new_tokens, features)
        replayed.append({"method": spec.label, "options": spec.options, **row})
    fixed = _ranked_fixed(replayed)
    specs = [MethodSpec("ar", "ar")]
    specs += [MethodSpec(r["method"], method, drafter, r["options"]) for r in fixed[:measure]]
    specs += [MethodSpec(f"cast:{drafter}", "cast", drafter, {})]
    measured = (run_benchmark(target_model, tokenizer, draft_model, specs, prompts, max_new_tokens, head=head)
                if measure else None)
    chosen = None
    if measured is not None:
        overall = [r for r in measured["summary"] if r["task"] == "all" and r["method"] in
                   {s.label for s in specs[1: 1 + measure]}]
        chosen = max(overall, key=lambda r: r["speedup"] or 0)["method"]
    return {"method": method, "drafter": drafter, "prompts": [p["id"] for p in prompts],
            "max_new_tokens": max_new_tokens, "cost_table": costs.meta, "replayed": replayed,
            "measured": measured, "chosen": chosen}


def _ranked_fixed(replayed: list[dict]) -> list[dict]:
    """The grid's points (CAST's rows left out), best predicted speed-up first."""
    return sorted((r for r in replayed if not r["method"].startswith("cast")),
                  key=lambda r: -(r["predicted_speedup"] or 0))


def tune_markdown(result: dict, command: str, top: int = 12) -> str:
    replayed = result["replayed"]
    fixed = _ranked_fixed(replayed)
    casts = [r for r in replayed if r["method"].startswith("cast")]
    lines = [f"# tune: {result['method']} with the {result['drafter']} drafter", "", "Command:", "", "```", command,
             "```", "", f"Tuning prompts: {', '.join(result['prompts'])}; {result['max_new_tokens']} new tokens.", "",
             f"## Replayed: the best {min(top, len(fixed))} of {len(fixed)} grid points, and CAST", "",
             "Exact accepted lengths against the target's greedy outputs; drafting measured; verify priced by the "
             "cost table (decode only, prefill excluded).", "",
             "| method | predicted speed-up | tau | verify size | depth |", "|---|---|---|---|---|"]
    for r in fixed[:top] + casts:
        lines.append(f"| `{r['method']}` | {r['predicted_speedup']:.2f}x | {r['tau']:.2f} | {r['mean_verify']:.2f} | "
                     f"{r['mean_depth']:.2f} |")
    if result["measured"] is not None:
        predicted = {r["method"]: r["predicted_speedup"] for r in replayed}
        lines += ["", "## Measured on the same prompts (one interleaved run)", "",
                  markdown_table(result["measured"]["summary"]), "",
                  "| method | predicted | measured (wall, prefill included) |", "|---|---|---|"]
        for r in result["measured"]["summary"]:
            if r["task"] == "all" and r["method"] in predicted:
                lines.append(f"| `{r['method']}` | {predicted[r['method']]:.2f}x | {r['speedup']:.2f}x |")
        lines += ["", f"Grid-best (fastest measured): `{result['chosen']}`"]
    return "\n".join(lines) + "\n"


def plot_tune(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed = [r for r in result["replayed"] if not r["method"].startswith("cast")]
    casts = [r for r in result["replayed"] if r["method"].startswith("cast")]
    fig, axes = plt.subplots(1, 2 if result["measured"] else 1, figsize=(11 if result["measured"] else 6, 4.2),
                             squeeze=False)
    ax = axes[0][0]
    verify = [r["mean_verify"] for r in fixed]
    points = ax.scatter([r["tau"] for r in fixed], [r["predicted_speedup"] for r in fixed], c=verify, cmap="viridis",
                        s=18, label=f"{result['method']} grid")
    fig.colorbar(points, ax=ax, label="mean verify size")
    for r in casts:
        ax.scatter([r["tau"]], [r["predicted_speedup"]], marker="*", s=160, color="red", edgecolor="black")
        ax.annotate(r["method"], (r["tau"], r["predicted_speedup"]), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlabel("tau (replayed, exact)")
    ax.set_ylabel("predicted decode speed-up over AR")
    ax.set_title(f"replayed grid ({result['drafter']} drafter)", fontsize=10)
    if result["measured"]:
        ax = axes[0][1]
        predicted = {r["method"]: r["predicted_speedup"] for r in result["replayed"]}
        rows = [r for r in result["measured"]["summary"] if r["task"] == "all" and r["method"] in predicted]
        ax.scatter([predicted[r["method"]] for r in rows], [r["speedup"] for r in rows])
        for r in rows:
            ax.annotate(r["method"], (predicted[r["method"]], r["speedup"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
        low = min([0.5] + [predicted[r["method"]] for r in rows] + [r["speedup"] for r in rows])
        high = max([1.2] + [predicted[r["method"]] for r in rows] + [r["speedup"] for r in rows])
        ax.plot([low, high], [low, high], color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("predicted (replay + cost table)")
        ax.set_ylabel("measured (wall clock)")
        ax.set_title("predicted vs measured speed-up", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def save_tune(result: dict, out_dir: Path, name: str, command: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps({**result, "command": command}, indent=1))
    (out_dir / f"{name}.md").write_text(tune_markdown(result, command) + f"\n![plot]({name}.png)\n")
    plot_tune(result, out_dir / f"{name}.png")
