"""`castspec demo` as a newcomer runs it, from N empty $CASTSPEC_HOMEs in a row (issue 37's bar: CAST over the draft
model >= 0.95x the best fixed draft-model tree of the same run, with drafted nodes > 0, every time).

Each run is a fresh process with a new home holding only a link to the fetched models (no cost tables: CAST starts
from a probe). Writes NAME.json (every row of every run), NAME.md (one table per run plus the bar) and NAME.png.

With SEED_COSTS=DIR and DRAFT_X=F in the environment, every home starts instead with a copy of the learned tables
in DIR (`$CASTSPEC_HOME/costs` of an earlier run on this machine) whose drafter cells are F times too slow: what a
table learned while the machine was busy looks like (the bar there: CAST >= 0.9x the best fixed tree). Where DIR
holds no tables yet, a first demo from an empty home learns them there (its rows are kept as `seed_run`).

Run: .venv/bin/python bench/scripts/demo_homes.py 3 bench/demo/NAME [extra castspec demo arguments]"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from castspec.bench.runner import method_family
from castspec.costs.table import machine_label


def seed_home(home: Path, source: Path, factor: float) -> list[dict]:
    """Copy the learned tables in `source` into `home`, every drafter cell `factor` times slower."""
    (home / "costs").mkdir()
    seeded = []
    for table in sorted(source.glob("online-*.json")):
        data = json.loads(table.read_text())
        for cell in data["online"]["draft"]["cells"]:
            cell[3] += math.log(factor)  # [B, c, n, log seconds, weight]
        (home / "costs" / table.name).write_text(json.dumps(data))
        seeded.append({"table": table.name, "drafter": str(data["meta"].get("draft")),
                       "cells": len(data["online"]["draft"]["cells"])})
    return seeded


def one_run(models: Path, extra: list[str], seed: Path | None = None, keep: Path | None = None) -> dict:
    """One demo in a new home (seeded from `seed` when given); `keep`: copy the tables it learned there."""
    with tempfile.TemporaryDirectory() as home:
        (Path(home) / "models").symlink_to(models)
        seeded = seed_home(Path(home), seed, float(os.environ.get("DRAFT_X", "1"))) if seed else None
        env = {**os.environ, "CASTSPEC_HOME": home}
        report = Path(home) / "demo.json"
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "castspec.cli", "demo", *extra, "--json", str(report)],
                              env=env, text=True, capture_output=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            sys.exit(f"castspec demo failed:\n{proc.stderr[-3000:]}")
        demo = json.loads(report.read_text())
        tables = sorted((Path(home) / "costs").glob("online-*.json"))
        probes = {str(data["meta"].get("draft")): data["meta"]["probe"]
                  for data in (json.loads(t.read_text()) for t in tables) if "probe" in data["meta"]}
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for table in tables:
                shutil.copy(table, keep / table.name)
    keys = ("method", "tokens_per_s", "speedup", "tau", "mean_tree_size", "mean_depth", "drafted_share")
    rows = [{k: row.get(k) for k in keys} for row in demo["rows"]]
    return {"rows": rows, "cast_lines": demo["cast_choices"], "wall_s": round(wall, 1), "seeded": seeded,
            "probes": probes}


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value}"


def bar(run: dict, drafter: str = "draft") -> dict:
    by = {r["method"]: r for r in run["rows"]}
    cast = by[f"cast:{drafter}"]
    fixed = [r for m, r in by.items() if method_family(m) in (("chain", drafter), ("eagle2", drafter))]
    best = max(fixed, key=lambda r: r["speedup"])
    return {"drafter": drafter, "cast": cast["speedup"], "best_fixed": best["method"],
            "best_fixed_speedup": best["speedup"], "ratio": round(cast["speedup"] / best["speedup"], 3),
            "drafted": (cast["mean_tree_size"] or 0) > 0}


def plot(result: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    methods = [r["method"] for r in runs[0]["rows"]]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(methods) + 1.5))
    height = 0.8 / len(runs)
    for k, run in enumerate(runs):
        by = {r["method"]: r["speedup"] for r in run["rows"]}
        ax.barh([i + k * height for i in range(len(methods))], [by.get(m, 0) for m in methods], height=height,
                label=f"home {k + 1}", color=["#4c72b0", "#55a868", "#c44e52", "#8172b2"][k % 4])
    ax.set_yticks([i + height * (len(runs) - 1) / 2 for i in range(len(methods))], methods, fontsize=8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel("speed-up over AR (tokens/s, same prompts, each run its own AR)")
    ax.set_title(f"castspec demo, {len(runs)} fresh processes, {result['meta']['machine']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)
    plt.close(fig)


def main(count: int, out: str, extra: list[str]) -> None:
    models = Path(os.environ.get("CASTSPEC_HOME", Path.home() / ".cache" / "castspec")) / "models"
    runs, seed, seed_run = [], None, None
    if os.environ.get("SEED_COSTS"):
        seed = Path(os.environ["SEED_COSTS"])
        if not list(seed.glob("online-*.json")):
            print(f"learning the tables to seed from in {seed} (a demo from an empty home) ...", file=sys.stderr,
                  flush=True)
            seed_run = one_run(models, extra, keep=seed)
    for k in range(count):
        print(f"demo {k + 1}/{count} ...", file=sys.stderr, flush=True)
        runs.append(one_run(models, extra, seed=seed))
        runs[-1]["bars"] = [bar(runs[-1], d) for d in ("draft", "ngram")]
        print(json.dumps(runs[-1]["bars"]), file=sys.stderr, flush=True)
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    if os.environ.get("SEED_COSTS"):
        command = f"SEED_COSTS={os.environ['SEED_COSTS']} DRAFT_X={os.environ.get('DRAFT_X', '1')} " + command
    result = {"meta": {"machine": machine_label(), "date": time.strftime("%Y-%m-%d %H:%M"), "command": command},
              "runs": runs, "seed_run": seed_run}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    homes = (f"homes seeded with drafter costs x{os.environ.get('DRAFT_X', '1')}" if os.environ.get("SEED_COSTS")
             else "empty homes")
    lines = [f"# castspec demo from {count} {homes}, {result['meta']['machine']}", "",
             f"`{result['meta']['command']}` ({result['meta']['date']}; each run a fresh process and "
             + ("a home seeded with learned tables whose drafter cells are x" + os.environ.get("DRAFT_X", "1")
                if os.environ.get("SEED_COSTS") else "an empty $CASTSPEC_HOME: CAST starts from a probe") + ")", "",
             "| run | CAST over draft | best fixed draft tree | ratio | CAST over n-gram | best fixed n-gram tree | "
             "ratio | probes |", "|---|---|---|---|---|---|---|---|"]
    for k, run in enumerate(runs, start=1):
        d, n = run["bars"]
        probe = f"{sum(p['seconds'] for p in run['probes'].values()):.1f} s" if run["probes"] else "-"
        lines.append(f"| {k} | {d['cast']:.2f}x | {d['best_fixed_speedup']:.2f}x (`{d['best_fixed']}`) | "
                     f"**{d['ratio']:.2f}** | {n['cast']:.2f}x | {n['best_fixed_speedup']:.2f}x (`{n['best_fixed']}`) "
                     f"| **{n['ratio']:.2f}** | {probe} |")
    for k, run in enumerate(runs, start=1):
        lines += ["", f"## Run {k} ({run['wall_s']} s)", "",
                  "| method | tok/s | speed-up | tau | verify size | depth |", "|---|---|---|---|---|---|"]
        lines += [f"| `{r['method']}` | {r['tokens_per_s']:.2f} | {r['speedup']:.2f}x | {_cell(r['tau'])} | "
                  f"{_cell(r['mean_tree_size'])} | {_cell(r['mean_depth'])} |" for r in run["rows"]]
        lines += [""] + run["cast_lines"]
    Path(out + ".md").write_text("\n".join(lines) + "\n")
    plot(result, out)
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3:])
