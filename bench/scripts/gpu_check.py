"""GPU check: cost curves, host overhead per step and lossless decoding on a CUDA device, with random weights made
on the device (nothing large travels). On a CPU with --size tiny it is the smoke test CI runs.

1. profile: f(B, c, n) of the target, the draft model and the EAGLE head on a small grid (seconds per forward);
2. overhead: `castspec bench --overhead`'s measurement at B = 1 and 8 (chain / EAGLE-2 16 and 60 nodes / CAST,
   from the draft model and the head, HF greedy and assisted beside);
3. exactness: every method's greedy output against AR's, in fp32 at the `small` size (in bf16 the random models'
   near-uniform logits make ties that tree and single-token attention round apart).

Run on the GPU machine:  python bench/scripts/gpu_check.py --device cuda --size 8b --out $OUT/gpu-check
Smoke test on a CPU:     python bench/scripts/gpu_check.py --device cpu --size tiny --quick --out /tmp/gpu-check"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from castspec.bench.overhead import DEFAULT_METHODS, overhead_table, plot_overhead, random_models, run_overhead
from castspec.bench.runner import parse_methods
from castspec.costs import profile as cost
from castspec.costs.table import device_name


def profile(models, batch_sizes: list[int], contexts: list[int], tokens: list[int]) -> dict:
    timers = {
        "target": lambda b, c, n: cost.time_target_forward(models.target, b, c, n, repeats=3, warmup=1),
        "draft": lambda b, c, n: cost.time_forward(models.draft, b, c, n, repeats=3, warmup=1),
        "head": lambda b, c, n: cost.time_head(models.head, models.target, b, c, n, repeats=3, warmup=1),
    }
    grids = cost.measure_grids(timers, batch_sizes, contexts, tokens, passes=1)
    return {name: {"batch_sizes": g.batch_sizes, "contexts": g.contexts, "tokens": g.tokens, "seconds": g.seconds}
            for name, g in grids.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="8b", help="random model size for profile and overhead (tiny, small, 8b)")
    parser.add_argument("--quick", action="store_true", help="a few tokens and grid points (smoke test)")
    parser.add_argument("--out", default="bench/gpu-check")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device_label = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else device_name(
        torch.device("cpu"))
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    report: dict = {"device": device_label, "size": args.size, "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d %H:%M")}
    start = time.perf_counter()

    models = random_models(args.size, args.device, dtype)
    print(f"[{time.perf_counter() - start:.0f} s] models made on {device_label} ({dtype})", flush=True)
    grid = ([1, 8], [256], [1, 16]) if args.quick else ([1, 8, 32], [512, 2048], [1, 4, 16, 64, 128])
    report["profile"] = profile(models, *grid)
    print(f"[{time.perf_counter() - start:.0f} s] cost curves profiled", flush=True)
    for name, g in report["profile"].items():
        print(f"  {name}: B={g['batch_sizes'][0]} c={g['contexts'][0]}: "
              + ", ".join(f"n={n} {s * 1e3:.2f} ms" for n, s in zip(g["tokens"], g["seconds"][0][0], strict=True)))

    methods = ("ar;chain:draft:chain_length=4;eagle2:head:top_k=4,depth=4,total_tokens=16;cast:draft" if args.quick
               else DEFAULT_METHODS)
    tokens = 12 if args.quick else 64
    overhead = run_overhead(models, parse_methods(methods), [1, 8], prompts=2 if args.quick else 4,
                            prompt_length=32 if args.quick else 128, max_new_tokens=tokens,
                            hf=not args.quick, progress=lambda msg: print("  " + msg, flush=True))
    report["overhead"] = overhead
    print(f"[{time.perf_counter() - start:.0f} s] overhead measured", flush=True)
    del models
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()

    exact_models = random_models("tiny" if args.quick else "small", args.device, torch.float32)
    exact = run_overhead(exact_models, parse_methods(methods), [1, 4], prompts=4, prompt_length=32,
                         max_new_tokens=tokens, hf=False, progress=lambda msg: print("  " + msg, flush=True))
    report["exactness"] = [{"method": r["method"], "batch_size": r["batch_size"], "same_as_ar": r["same_as_ar"]}
                           for r in exact["rows"]]
    ok = all(r["same_as_ar"] is not False for r in report["exactness"])
    report["all_equal_to_ar"] = ok
    report["seconds"] = round(time.perf_counter() - start, 1)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1) + "\n")
    title = f"gpu check: random {args.size} models on {device_label}, {report['date']}"
    (out / "gpu-check.md").write_text(f"# {title}\n\nhost overhead per step (ms):\n\n"
                                      + overhead_table(overhead["rows"])
                                      + f"\n\nfp32 outputs equal to AR's (every method, B = 1 and 4): {ok}\n")
    plot_overhead(overhead["rows"], out / "gpu-check-overhead.png", title)
    print(overhead_table(overhead["rows"]))
    print(f"fp32 outputs equal to AR's: {ok}; results in {out} ({report['seconds']} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
