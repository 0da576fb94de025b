"""bf16 linears on a CPU with no bf16 arithmetic: castspec's AVX2 widening kernel against aten's bf16 path and
against fp32 weights (`decode.widen_linear`).

Part 1, the kernels alone: 1-256 rows through each distinct linear shape of the target's layers, enough copies of each
weight to leave the caches, best of 3; ms and GB/s of bf16 weight read (fp32 reads twice the bytes). Part 2, the
target's eager decode forward in one process: the bf16 model with its linears widened, the same model with them
put back to `nn.Linear` (aten's bf16 path, as `--no-prepack` loads it), and the model in fp32 (what a user picks
here to avoid aten's bf16 path), alternated per step and the order turned every round, so that the machine's drift
falls on all alike. Writes NAME.json, NAME.md, NAME.png.

Run: .venv/bin/python bench/scripts/widen_study.py bench/forward-profile/NAME [--rounds 3] [--steps 3]"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from row_kernel_study import best_of
from torch import nn

from castspec.costs.table import machine_label
from castspec.decode.target import Target
from castspec.decode.tree import DraftTree
from castspec.decode.widen_linear import WidenedLinear, build_kernel, widen
from castspec.models import load_model

ALONE_ROWS = (1, 4, 16, 64, 256)
# (rows, contexts, tree nodes per row): an AR step, a 16-node tree, a 4-row AR step, a prompt of 128 tokens
CASES = [(1, [400], 1), (1, [400], 16), (4, [300, 500, 400, 600], 1), (1, [200], 128)]
VARIANTS = ("aten_bf16", "widened_bf16", "fp32")


@torch.inference_mode()
def kernels_alone(linears: list[nn.Linear]) -> list[dict]:
    """Each distinct shape: ms and GB/s (of bf16 bytes) for 1-256 rows by the three paths."""
    kernel, out, seen = build_kernel(), [], set()
    for linear in linears:
        shape = tuple(linear.weight.shape)
        if shape in seen:
            continue
        seen.add(shape)
        copies = max(1, int(200e6 // (2 * shape[0] * shape[1])))  # ~200 MB of bf16: beyond any cache here
        weights = [linear.weight.detach().clone() for _ in range(copies)]
        wide = [w.float() for w in weights]
        gb = 2 * shape[0] * shape[1] * copies / 1e9
        for rows in ALONE_ROWS:
            x = torch.randn(rows, shape[1], dtype=torch.bfloat16)
            x32 = x.float()
            times = {"widened_bf16": best_of(lambda x=x, ws=weights: [kernel(x, w, None) for w in ws], 3),
                     "fp32": best_of(lambda x=x32, ws=wide: [nn.functional.linear(x, w) for w in ws], 3)}
            # aten's bf16 path at many rows takes seconds per copy: timed on fewer copies, scaled
            few = weights[:max(1, copies // 8)] if rows > 16 else weights
            times["aten_bf16"] = best_of(lambda x=x, few=few: [nn.functional.linear(x, w) for w in few],
                                         1 if rows > 16 else 3) * len(weights) / len(few)
            row = {"shape": f"{shape[0]} x {shape[1]}", "rows": rows}
            for name, seconds in times.items():
                row[f"{name}_ms"] = round(1e3 * seconds / copies, 3)
                row[f"{name}_gbs"] = round(gb / seconds, 1)
            out.append(row)
            print(row, file=sys.stderr, flush=True)
    return out


def swap(model: nn.Module, to_widened: bool) -> None:
    """Put the model's linears back to `nn.Linear` (aten's bf16 path) or to `WidenedLinear`, the same weights."""
    for name, module in list(model.named_modules()):
        if to_widened and type(module) is nn.Linear:
            replacement: nn.Module = WidenedLinear(module)
        elif not to_widened and isinstance(module, WidenedLinear):
            replacement = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                    device="meta")
            replacement.weight, replacement.bias = module.weight, module.bias
        else:
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, replacement)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="steps per variant, case and round")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    args = ap.parse_args()
    if build_kernel() is None:
        raise SystemExit("no AVX2 widening kernel on this machine")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    bf16, _ = load_model(args.model, "bf16", prepack=False)
    fp32, _ = load_model(args.model, "fp32")
    output = bf16.get_output_embeddings()  # alone, aten's bf16 path would take minutes over its 151k rows
    alone = kernels_alone([m for m in bf16.modules() if type(m) is nn.Linear and m is not output])
    widen(bf16, anywhere=True)
    targets = {"bf16": Target(bf16), "fp32": Target(fp32)}
    rng = random.Random(0)

    def step(variant: str, rows: int, n: int) -> float:
        if variant != "fp32":
            swap(bf16, variant == "widened_bf16")
        target = targets["fp32" if variant == "fp32" else "bf16"]
        trees = [DraftTree.chain([rng.randrange(100, 20000) for _ in range(n)]) for _ in range(rows)]
        start = time.perf_counter()
        target.verify(trees)
        seconds = time.perf_counter() - start
        target.commit([[0]] * rows)
        return seconds

    samples: dict[str, dict[str, list[float]]] = {}
    with torch.inference_mode():
        for round_ in range(args.rounds):
            order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
            for rows, contexts, n in CASES:
                case = samples.setdefault(f"B={rows} n={n}", {v: [] for v in VARIANTS})
                swap(bf16, True)  # the prompts prefilled by the fast path; the cache is the same either way
                for target in targets.values():
                    target.prefill([[rng.randrange(100, 20000) for _ in range(c)] for c in contexts])
                for variant in order:
                    if round_ == 0:
                        step(variant, rows, n)  # untimed: a first forward of each shape
                    for _ in range(args.steps):
                        case[variant].append(step(variant, rows, n))
            print(f"round {round_ + 1} done", file=sys.stderr, flush=True)
    steps = [{"case": case, **{f"{v}_ms": round(1e3 * statistics.median(s[v]), 1) for v in VARIANTS}}
             for case, s in samples.items()]
    for row in steps:
        row["aten_over_widened"] = round(row["aten_bf16_ms"] / row["widened_bf16_ms"], 2)
        row["fp32_over_widened"] = round(row["fp32_ms"] / row["widened_bf16_ms"], 2)
    command = f"python bench/scripts/widen_study.py {args.out} --rounds {args.rounds} --steps {args.steps}"
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_label(), "model": args.model,
            "threads": torch.get_num_threads(), "command": command}
    (out.parent / f"{out.name}.json").write_text(json.dumps(
        {"meta": meta, "kernels_alone": alone, "steps": steps, "samples": samples}, indent=1) + "\n")
    lines = [f"# bf16 linears with no bf16 arithmetic: castspec's widening kernel, aten's bf16 path, fp32; "
             f"{args.model}", "", f"{meta['date']}, {meta['machine']}, {meta['threads']} threads.", "", "```",
             command, "```", "", "## The kernels alone (weights beyond the caches; GB/s of bf16 bytes)", "",
             "| weight shape | rows | widened bf16 ms (GB/s) | aten bf16 ms (GB/s) | fp32 ms (GB/s) |",
             "|---|---|---|---|---|",
             *[f"| {r['shape']} | {r['rows']} | {r['widened_bf16_ms']} ({r['widened_bf16_gbs']}) | "
               f"{r['aten_bf16_ms']} ({r['aten_bf16_gbs']}) | {r['fp32_ms']} ({r['fp32_gbs']}) |" for r in alone],
             "", "## Eager decode forwards of the target, alternated (median ms)", "",
             f"{args.rounds} rounds x {args.steps} steps per variant and case; B rows of n tree nodes each "
             "(n=128: a prompt's forward).", "",
             "| case | widened bf16 | aten bf16 | fp32 | aten bf16 / widened | fp32 / widened |",
             "|---|---|---|---|---|---|",
             *[f"| {r['case']} | {r['widened_bf16_ms']} | {r['aten_bf16_ms']} | {r['fp32_ms']} | "
               f"{r['aten_over_widened']}x | {r['fp32_over_widened']}x |" for r in steps],
             "", f"![plot]({out.name}.png)"]
    (out.parent / f"{out.name}.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.27
    for i, variant in enumerate(VARIANTS):
        ax.bar([j + (i - 1) * width for j in range(len(steps))], [r[f"{variant}_ms"] for r in steps], width,
               label=variant.replace("_", " "))
    ax.set_xticks(range(len(steps)), [r["case"] for r in steps])
    ax.set_yscale("log")
    ax.set_ylabel("ms per forward (log)")
    ax.set_title(f"{args.model}, {meta['machine']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.parent / f"{out.name}.png", dpi=120)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
