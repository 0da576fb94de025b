"""The target's forward before and after the slot cache and ragged attention, in one process, alternated.

Before: `castspec/decode/target.py` and `kv.py` as of a git revision (a rectangular `DynamicCache` with masked
holes, sdpa with a 4-D mask; a prompt joining running rows is prefilled by a forward of its own). After: this
checkout's `Target` (a slot per row; trees and prompt chunks in one ragged forward). Cases: verifies of n tokens per
row at B rows (commit of the root only, so every round times the same context), and a 150-token prompt joining 7
running rows with 2-node trees (before: the verify, then the prompt's own forward; after: both in one forward).
Writes NAME.json, NAME.md, NAME.png.

Run: .venv/bin/python bench/scripts/ragged_study.py bench/forward-profile/NAME [--before 4c7a6b4] [--rounds 3]
     [--model qwen2.5-coder-1.5b]"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from paired_bars import paired_bars

from castspec.costs.table import machine_label
from castspec.decode.target import Target
from castspec.decode.tree import DraftTree
from castspec.models import load_model

CASES = [(1, [400], 1), (1, [400], 8), (4, [300, 500, 400, 600], 1), (4, [300, 500, 400, 600], 4),
         (8, [400] * 8, 1), (8, [400] * 8, 3)]


def before_target(revision: str):
    """The Target class of `revision`, its kv module loaded beside it under another name."""
    folder = Path(tempfile.mkdtemp(prefix="castspec-before-"))
    for name in ("kv", "target"):
        text = subprocess.run(["git", "show", f"{revision}:castspec/decode/{name}.py"], check=True,
                              capture_output=True, text=True).stdout
        text = text.replace("from castspec.decode import kv", "import before_kv as kv")
        (folder / f"before_{name}.py").write_text(text)
    sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location("before_target", folder / "before_target.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--before", default="4c7a6b4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    before = before_target(args.before)
    model, _ = load_model(args.model, "bf16")
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(n)]

    def chain(n: int) -> DraftTree:
        return DraftTree.from_lists([rng.randrange(100, 20000) for _ in range(n)], list(range(-1, n - 1)), [1.0] * n)

    def verify_times(kind, contexts: list[int], n: int, repeats: int = 4) -> list[float]:
        target = kind(model)
        target.prefill([prompt(c) for c in contexts])
        times = []
        for _ in range(repeats):
            trees = [chain(n) for _ in contexts]
            start = time.perf_counter()
            target.verify(trees)
            times.append(time.perf_counter() - start)
            target.commit([[0] for _ in contexts])
        return times

    def join_time(kind) -> float:
        target = kind(model)
        target.prefill([prompt(400) for _ in range(7)])
        newcomer = prompt(150)
        if kind is before:
            start = time.perf_counter()
            target.verify([chain(2) for _ in range(7)])
            target.commit([[0]] * 7)
            target.add_rows([newcomer])
        else:
            prefills = target.start_rows([newcomer])
            start = time.perf_counter()
            target.forward([chain(2) for _ in range(7)], prefills, None)
            target.commit([[0]] * 7)
            target.join_rows(prefills)
        return time.perf_counter() - start

    samples: dict[str, dict[str, list[float]]] = {}
    with torch.inference_mode():
        for round_ in range(args.rounds):
            order = [("before", before), ("after", Target)]
            if round_ % 2:
                order.reverse()
            for batch, contexts, n in CASES:
                for name, kind in order:
                    samples.setdefault(f"B={batch} n={n}", {}).setdefault(name, []).extend(
                        verify_times(kind, contexts, n))
            for name, kind in order:
                samples.setdefault("7 rows + 150-token join", {}).setdefault(name, []).append(join_time(kind))
            print(f"round {round_ + 1} done", file=sys.stderr, flush=True)
    rows = [{"case": case, "before_ms": round(1000 * statistics.median(s["before"]), 1),
             "after_ms": round(1000 * statistics.median(s["after"]), 1),
             "before_over_after": round(statistics.median(s["before"]) / statistics.median(s["after"]), 3)}
            for case, s in samples.items()]
    command = f"python bench/scripts/ragged_study.py {args.out} --before {args.before} --rounds {args.rounds}"
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_label(), "model": args.model,
            "dtype": "bf16", "before": args.before, "command": command}
    (out.parent / f"{out.name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "samples": samples},
                                                            indent=1) + "\n")
    lines = [f"# The target's forward: rectangular cache (before, {args.before}) against slot cache + ragged "
             "attention (after)", "", f"{meta['date']}, {meta['machine']}, {args.model} bf16 (linear weights "
             f"pre-packed), both layouts in one process, alternated, {args.rounds} rounds (median).", "",
             "```", command, "```", "", "| case | before ms | after ms | before / after |", "|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['before_ms']} | {r['after_ms']} | {r['before_over_after']:.2f}x |" for r in rows]
    lines += ["", f"![plot]({out.name}.png)"]
    (out.parent / f"{out.name}.md").write_text("\n".join(lines) + "\n")
    paired_bars(rows, ("before_ms", "after_ms"), (f"before ({args.before})", "slot cache + ragged forward"),
                "before_over_after", out.parent / f"{out.name}.png", f"{args.model} bf16, {meta['machine']}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
