"""Does a compiled forward of one token a row get slower once the same process has verified trees? (issue 37/38:
at four clients the CAST server's root-only forwards took 210 ms against 196 ms in the AR server,
bench/serve-load/README.md.) In one process: the target compiled as `castspec serve` loads it, B rows prefilled,
the median of R root-only forwards, then forwards over chains of 2-17 nodes on half the rows, then root-only again.

Run: .venv/bin/python bench/scripts/root_forward_after_trees.py [--model qwen2.5-coder-1.5b] [--dtype bf16]
     [--rows 4] [--reps 15]   (prints the timings)"""

from __future__ import annotations

import argparse
import statistics
import time

from castspec.costs.table import machine_label
from castspec.decode.target import Target
from castspec.decode.tree import DraftTree
from castspec.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, args.dtype, compile=True)
    target = Target(model)
    target.prefill([tokenizer(f"def f{i}(x):\n    return x * {i}\n")["input_ids"] * 3 for i in range(args.rows)])

    def median_ms(trees: list[DraftTree], reps: int) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            target.verify(trees)
            times.append(time.perf_counter() - start)
            target.commit([[0]] * args.rows)  # keep the root only: every row's length grows by one
        return 1000 * statistics.median(times)

    roots = [DraftTree.single(5) for _ in range(args.rows)]
    print(f"{machine_label()}, {args.model} {args.dtype}, {args.rows} rows, compiled")
    print(f"root-only forwards, before any tree: {median_ms(roots, args.reps):.1f} ms")
    for nodes in (2, 5, 9, 3, 17, 4, 7):
        trees = [DraftTree.chain([5] + [7] * nodes) if i % 2 == 0 else DraftTree.single(5) for i in range(args.rows)]
        print(f"chains of {nodes} drafted nodes on half the rows: {median_ms(trees, 3):.1f} ms")
    print(f"root-only forwards, after the trees: {median_ms(roots, args.reps):.1f} ms")


if __name__ == "__main__":
    main()
