"""Few-row linears by castspec's AVX512-BF16 kernel against oneDNN's packed kernel (`decode.row_linear`).

Part 1, the kernels alone: 1-4 bf16 rows through the target's linear shapes, enough copies of each weight to leave
the caches, best of 5; GB/s of weight read. Part 2, the target's decode forward (compiled, as the command line
runs it) in one process: single steps with the dense weights handed to the row kernel, then without (oneDNN's
packed kernel for every row), alternated and the order flipped every round, so that the machine's drift falls on
both alike. Only forwards of up to the model's row limit (the load line says it) change; the others are the
control. Writes NAME.json, NAME.md, NAME.png.

Run: .venv/bin/python bench/scripts/row_kernel_study.py bench/forward-profile/NAME [--rounds 4] [--steps 6]"""

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
from castspec.decode.prepack import PrepackedLinear
from castspec.decode.row_linear import row_kernel
from castspec.decode.target import Target
from castspec.decode.tree import DraftTree
from castspec.models import load_model

CASES = [(1, [400], 1), (2, [300, 500], 1), (1, [400], 16), (4, [300, 500, 400, 600], 1), (1, [1500], 1)]
ALONE_ROWS = (1, 2, 3, 4)


def best_of(run, repeats: int = 5) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


@torch.inference_mode()
def kernels_alone(layers: list[PrepackedLinear]) -> list[dict]:
    """Each distinct shape of `layers`: GB/s of 1-4 rows through copies of its weight, by both kernels."""
    rows, seen = [], set()
    for layer in layers:
        shape = (layer.out_features, layer.in_features)
        if shape in seen:
            continue
        seen.add(shape)
        copies = max(1, int(400e6 // (2 * shape[0] * shape[1])))  # ~400 MB: beyond any cache here
        weights = [layer.row_weight.clone() for _ in range(copies)]
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
        gb = 2 * shape[0] * shape[1] * copies / 1e9
        for count in ALONE_ROWS:
            ours, onednn = row_times(torch.randn(count, shape[1], dtype=torch.bfloat16), weights, packed)
            rows.append({"shape": f"{shape[0]} x {shape[1]}", "rows": count, "row_kernel_gbs": round(gb / ours, 1),
                         "onednn_gbs": round(gb / onednn, 1)})
    return rows


def row_times(x: torch.Tensor, weights: list[torch.Tensor], packed: list[torch.Tensor]) -> tuple[float, float]:
    """Seconds for `x` through every weight: by the row kernel (dense), by oneDNN (packed)."""
    kernel = row_kernel()
    return (best_of(lambda: [kernel(x, w, None) for w in weights]),
            best_of(lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="alternated pairs per case and round")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines_in: list[str] = []
    model, _ = load_model(args.model, "bf16", compile=True, log=lambda line: (lines_in.append(line),
                                                                               print(line, file=sys.stderr)))
    if not getattr(model, "castspec_row_limit", 0):
        raise SystemExit("the row kernel is not used for this model on this machine (see the load line)")
    layers = [m for m in model.modules() if isinstance(m, PrepackedLinear)]
    kept = [m.row_weight for m in layers]
    alone = kernels_alone(layers)
    for row in alone:
        print(row, file=sys.stderr, flush=True)

    def use_rows(on: bool) -> None:
        for layer, weight in zip(layers, kept, strict=True):
            layer.row_weight = weight if on else None

    rng = random.Random(0)
    target = Target(model)

    def step(rows: int, n: int) -> float:
        trees = [DraftTree.chain([rng.randrange(100, 20000) for _ in range(n)]) for _ in range(rows)]
        start = time.perf_counter()
        target.verify(trees)
        seconds = time.perf_counter() - start
        target.commit([[0]] * rows)
        return seconds

    samples: dict[str, dict[str, list[float]]] = {}
    for round_ in range(args.rounds):
        for batch, contexts, n in CASES:
            case = samples.setdefault(f"B={batch} n={n} c={contexts[0]}", {"onednn": [], "row_kernel": []})
            target.prefill([[rng.randrange(100, 20000) for _ in range(c)] for c in contexts])
            for on in (True, False):  # a first step of each after the prefill (and each variant's graph): untimed
                use_rows(on)
                step(batch, n)
            for _ in range(args.steps):
                for name in (["onednn", "row_kernel"] if round_ % 2 == 0 else ["row_kernel", "onednn"]):
                    use_rows(name == "row_kernel")
                    case[name].append(step(batch, n))
        print(f"round {round_ + 1} done", file=sys.stderr, flush=True)
    use_rows(True)
    rows = paired_rows(samples, "onednn", "row_kernel")
    command = f"python bench/scripts/row_kernel_study.py {args.out} --rounds {args.rounds} --steps {args.steps}"
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_label(), "model": args.model,
            "dtype": "bf16", "threads": torch.get_num_threads(), "load_lines": lines_in, "command": command}
    (out.parent / f"{out.name}.json").write_text(json.dumps(
        {"meta": meta, "kernels_alone": alone, "rows": rows, "samples": samples}, indent=1) + "\n")
    lines = [f"# Few-row linears: castspec's AVX512-BF16 kernel against oneDNN's packed kernel, {args.model} bf16",
             "", f"{meta['date']}, {meta['machine']}.", "", "```", command, "```", "", "At load:", "",
             *[f"    {line}" for line in lines_in], "", "## The kernels alone (weights beyond the caches)",
             "", "| weight shape | rows | row kernel GB/s | oneDNN packed GB/s |", "|---|---|---|---|",
             *[f"| {r['shape']} | {r['rows']} | {r['row_kernel_gbs']} | {r['onednn_gbs']} |" for r in alone], "",
             "## Decode forwards of the compiled target, alternated single steps", "",
             f"{args.rounds} rounds x {args.steps} pairs per case; only forwards of up to {model.castspec_row_limit} "
             "rows (B x n) use the kernel.", "",
             *paired_table(rows, "onednn", "row_kernel", ("oneDNN", "row kernel"))]
    lines += ["", f"![plot]({out.name}.png)"]
    (out.parent / f"{out.name}.md").write_text("\n".join(lines) + "\n")
    paired_bars(rows, ("onednn_ms", "row_kernel_ms"), ("oneDNN packed", "row kernel"), "onednn_over_row_kernel",
                out.parent / f"{out.name}.png", f"{args.model} bf16, {meta['machine']}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
