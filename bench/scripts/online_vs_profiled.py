"""Prediction error of a learned (online) cost table against a profiled one, on the same held-out points timed
now: random (B, c, n) inside the profiled grid, off its c and n points. Writes JSON + markdown.

    python bench/scripts/online_vs_profiled.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --dtype fp32 \\
        --profiled bench/serve/cost-qwen1.5b-draft0.5b-fp32-b1248-avx2.json --learned LEARNED.json \\
        --out bench/cost-online/error-qwen1.5b-draft0.5b-fp32-avx2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from castspec.costs import profile as cost
from castspec.costs.table import CostTable, device_name
from castspec.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--profiled", required=True)
    ap.add_argument("--learned", required=True)
    ap.add_argument("--points", type=int, default=16)
    ap.add_argument("--out", required=True, help="path without extension")
    args = ap.parse_args()

    target = load_model(args.model, args.dtype)[0]
    draft = load_model(args.draft, args.dtype)[0] if args.draft else None
    timers = {"target": lambda b, c, n: cost.time_target_forward(target, b, c, n, repeats=3)}
    timers["draft"] = ((lambda b, c, n: cost.time_forward(draft, b, c, n, repeats=3)) if draft is not None
                       else (lambda b, c, n: cost.time_ngram(n * b, c, repeats=3)))
    tables = {"profiled": CostTable.load(args.profiled), "learned": CostTable.load(args.learned)}
    points = cost.held_out_points(tables["profiled"].target, args.points, seed=7)
    rows = []
    for i, (b, c, n) in enumerate(points):
        for which, timer in timers.items():
            measured = timer(b, c, n)
            row = {"model": which, "batch_size": b, "context": c, "tokens": n, "measured_s": measured}
            for name, table in tables.items():
                grid = table.target if which == "target" else table.draft
                row[f"{name}_s"] = grid(b, c, n)
                row[f"{name}_ape"] = abs(grid(b, c, n) - measured) / measured
            rows.append(row)
        print(f"\rpoint {i + 1}/{len(points)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)

    def median_ape(name: str, which: str, batch: int | None = None) -> float:
        picked = [r[f"{name}_ape"] for r in rows if r["model"] == which and batch in (None, r["batch_size"])]
        return statistics.median(picked) if picked else float("nan")

    summary = {w: {name: {"all": median_ape(name, w), "B=1": median_ape(name, w, 1)} for name in tables}
               for w in timers}
    report = {"date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": f"{device_name(torch.device('cpu'))}, {torch.get_num_threads()} threads",
              "command": "python " + " ".join(sys.argv), "profiled": args.profiled, "learned": args.learned,
              "summary": summary, "points": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1))
    lines = [f"# Learned vs profiled cost table: median prediction error on {len(points)} held-out points",
             "", f"{report['date']}, {report['machine']}", "", "```", report["command"], "```", "",
             "| model | table | all batch sizes | B = 1 |", "|---|---|---|---|"]
    for which, by_table in summary.items():
        for name, errors in by_table.items():
            lines.append(f"| {which} | {name} | {errors['all'] * 100:.1f}% | {errors['B=1'] * 100:.1f}% |")
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
