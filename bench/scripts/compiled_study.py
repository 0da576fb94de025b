"""The target's decode forward eager against compiled (`decode.compiled`), in one process, single steps alternated.

One model, compiled once (the compile time is recorded); `compiled.eager(model)` runs the same forwards eagerly.
Cases: verifies of n tokens per row at B rows after fixed contexts (commit of the root only, so every step times the
same context); each step is timed eager then compiled (the order flips every round), so that the machine's drift,
which moves whole minutes by 1.5x here, falls on both alike. Reports per case the medians and the median of the
per-pair ratios. Writes NAME.json, NAME.md, NAME.png.

Run: .venv/bin/python bench/scripts/compiled_study.py bench/forward-profile/NAME [--rounds 4] [--steps 6]
     [--model qwen2.5-coder-1.5b] [--dtype bf16]"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from paired_bars import paired_bars, paired_rows, paired_table

from castspec.costs.table import machine_label
from castspec.decode import compiled
from castspec.decode.target import Target
from castspec.decode.tree import DraftTree
from castspec.models import load_model

CASES = [(1, [400], 1), (1, [400], 16), (4, [300, 500, 400, 600], 1), (4, [300, 500, 400, 600], 4),
         (8, [400] * 8, 1), (8, [400] * 8, 3)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="alternated pairs per case and round")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model, _ = load_model(args.model, args.dtype)
    compile_s = compiled.compile_target(model, lambda line: print(line, file=sys.stderr))
    if compile_s is None:
        raise SystemExit("torch.compile failed on this machine")
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(n)]

    def chain(n: int) -> DraftTree:
        return DraftTree.from_lists([rng.randrange(100, 20000) for _ in range(n)], list(range(-1, n - 1)), [1.0] * n)

    def step(target: Target, rows: int, n: int) -> float:
        trees = [chain(n) for _ in range(rows)]
        start = time.perf_counter()
        target.verify(trees)
        seconds = time.perf_counter() - start
        target.commit([[0]] * rows)
        return seconds

    samples: dict[str, dict[str, list[float]]] = {}
    target = Target(model)
    for round_ in range(args.rounds):
        for batch, contexts, n in CASES:
            case = samples.setdefault(f"B={batch} n={n}", {"eager": [], "compiled": []})
            target.prefill([prompt(c) for c in contexts])
            step(target, batch, n)  # a first step after a prefill: not timed
            for _ in range(args.steps):
                order = ["eager", "compiled"] if round_ % 2 == 0 else ["compiled", "eager"]
                for name in order:
                    if name == "eager":
                        with compiled.eager(model):
                            case[name].append(step(target, batch, n))
                    else:
                        case[name].append(step(target, batch, n))
        print(f"round {round_ + 1} done", file=sys.stderr, flush=True)
    rows = paired_rows(samples, "eager", "compiled")
    command = (f"python bench/scripts/compiled_study.py {args.out} --rounds {args.rounds} --steps {args.steps} "
               f"--model {args.model} --dtype {args.dtype}")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_label(), "model": args.model,
            "dtype": args.dtype, "compile_s": round(compile_s, 1), "threads": torch.get_num_threads(),
            "command": command}
    (out.parent / f"{out.name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "samples": samples},
                                                            indent=1) + "\n")
    lines = [f"# The target's decode forward: eager against compiled (`decode.compiled`), {args.model} {args.dtype}",
             "", f"{meta['date']}, {meta['machine']}; compiled once in "
             f"{meta['compile_s']} s (two graphs); single steps alternated eager / compiled, {args.rounds} rounds x "
             f"{args.steps} pairs per case.", "", "```", command, "```", "",
             *paired_table(rows, "eager", "compiled", ("eager", "compiled"))]
    lines += ["", f"![plot]({out.name}.png)"]
    (out.parent / f"{out.name}.md").write_text("\n".join(lines) + "\n")
    paired_bars(rows, ("eager_ms", "compiled_ms"), ("eager", "compiled"), "eager_over_compiled",
                out.parent / f"{out.name}.png", f"{args.model} {args.dtype}, {meta['machine']}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
