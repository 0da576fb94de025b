"""Where one forward of the target goes (issue 38, item 1): an AR step (1 new token) and a 16-token verify of the
real model, through the same path the engine drives (stock `transformers` model, DynamicCache, a 4-D mask), timed
and profiled op by op, beside this machine's memory bandwidth: a decode forward reads every weight once, so
weight bytes / bandwidth is the floor no implementation goes under.

Categories (self CPU time of the profiled ops, summed over the forward): matrix multiplies (every nn.Linear, the
lm_head measured apart), attention (scaled_dot_product_attention and its kernels), concatenations and copies (the
KV cache's append, rotate_half, the mask), other element-wise work (norms, rotary, activation), and what no op
accounts for: Python and dispatch between the ops.

Run: .venv/bin/python bench/scripts/profile_forward.py bench/forward-profile/NAME [--model M] [--dtype bf16]
     [--context 256] (writes NAME.json and NAME.md)"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from castspec.costs.profile import chain_after, filled_cache
from castspec.costs.table import machine_label
from castspec.decode import kv
from castspec.models import load_model

CATEGORIES = (("matrix multiplies", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul",
                                     "mkldnn", "onednn")),
              ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
              ("concatenations and copies", ("aten::cat", "aten::copy_", "aten::index", "aten::slice", "aten::clone",
                                             "aten::contiguous", "aten::expand", "aten::gather")),
              ("element-wise (norms, rotary, activation)", ("aten::mul", "aten::add", "aten::rsqrt", "aten::pow",
                                                           "aten::mean", "aten::silu", "aten::neg", "aten::to",
                                                           "aten::_to_copy", "aten::cos", "aten::sin",
                                                           "aten::where", "aten::bitwise", "aten::__and__")))


def category(op: str) -> str:
    for name, keys in CATEGORIES:
        if any(key in op for key in keys):
            return name
    return "other ops"


def bandwidth_gb_s(gib: float = 1.0, repeats: int = 5) -> dict:
    """Read bandwidth (a float32 sum over `gib` GiB) and copy bandwidth (into a buffer written before, so that no
    page is touched for the first time), medians of `repeats`."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    y = torch.zeros_like(x)
    read, copy = [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        x.sum()
        read.append(time.perf_counter() - start)
        start = time.perf_counter()
        y.copy_(x)
        copy.append(time.perf_counter() - start)
    size = x.numel() * 4 / 1e9
    return {"read_gb_s": round(size / statistics.median(read[1:]), 2),
            "copy_gb_s": round(2 * size / statistics.median(copy[1:]), 2)}


def prepared(model, batch_size: int, context: int, tokens: int) -> tuple:
    device = next(model.parameters()).device
    cache = filled_cache(model, batch_size, context)
    ids = torch.randint(0, model.config.vocab_size, (batch_size, tokens), device=device)
    positions, mask = chain_after(batch_size, context, tokens, device)
    return cache, ids, positions, mask, context


@torch.inference_mode()
def one_forward(model, case: tuple) -> float:
    cache, ids, positions, mask, context = case
    start = time.perf_counter()
    kv.forward(model, cache, ids, positions, mask)
    seconds = time.perf_counter() - start
    kv.crop(cache, context)
    return seconds


@torch.inference_mode()
def profile_case(model, case: tuple, wall_ms: float, repeats: int = 8) -> dict:
    """The ops of `repeats` forwards of a prepared case, by category, against its unprofiled wall time."""
    cache, ids, positions, mask, context = case
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            kv.forward(model, cache, ids, positions, mask)
            kv.crop(cache, context)
    by_category: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        by_category[category(event.key)] += event.self_cpu_time_total / 1e3 / repeats
        by_op[event.key] += event.self_cpu_time_total / 1e3 / repeats
    # the lm_head alone, on the hidden states of the same number of tokens
    hidden = torch.randn(*ids.shape, model.config.hidden_size, dtype=next(model.parameters()).dtype)
    head = []
    for i in range(repeats + 2):
        start = time.perf_counter()
        model.lm_head(hidden)
        if i >= 2:
            head.append(time.perf_counter() - start)
    profiled_ms = sum(by_category.values())
    head_ms = statistics.median(head) * 1e3
    rows = {"lm_head (151k-token vocabulary, timed apart)": head_ms}
    for name, ms in sorted(by_category.items(), key=lambda kv_: -kv_[1]):
        rows[name] = ms - head_ms if name == "matrix multiplies" else ms
    # the profiler's own cost inflates its sum; the gap is read against the unprofiled wall time
    rows["Python, dispatch and what no op accounts for"] = max(wall_ms - profiled_ms, 0.0)
    return {"batch_size": ids.shape[0], "context": context, "tokens": ids.shape[1], "wall_ms": round(wall_ms, 2),
            "profiled_ms": round(profiled_ms, 2), "rows_ms": {k: round(v, 2) for k, v in rows.items()},
            "top_ops_ms": {k: round(v, 2) for k, v in sorted(by_op.items(), key=lambda kv_: -kv_[1])[:12]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=6, help="timed forwards of each case per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of bandwidth + forwards")
    parser.add_argument("--no-prepack", dest="prepack", action="store_false",
                        help="the weights as loaded (before decode.prepack, the only path of the first profiles)")
    args = parser.parse_args()
    print(f"loading {args.model} ({args.dtype}) ...", file=sys.stderr, flush=True)
    model, _ = load_model(args.model, args.dtype, prepack=args.prepack)
    # a decode forward reads every weight but the input embedding's table, of which it looks up one row a token
    embedding = model.get_input_embeddings().weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)
    names = {"AR step (1 token)": 1, "16-token verify": 16}
    prepared_cases = {name: prepared(model, 1, args.context, tokens) for name, tokens in names.items()}
    for case in prepared_cases.values():  # warm every shape
        one_forward(model, case)
    # this machine's memory bandwidth moves with its neighbours (7.8 to 20.4 GB/s within minutes here), so each
    # round measures it beside the forwards, and the forwards are read against the floor of their own round
    rounds = []
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}: bandwidth, then both cases alternated ...", file=sys.stderr, flush=True)
        bandwidth = bandwidth_gb_s(gib=0.5, repeats=3)
        walls: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.repeats):
            for name, case in prepared_cases.items():
                walls[name].append(one_forward(model, case))
        floor = weight_bytes / 1e9 / bandwidth["read_gb_s"] * 1e3
        rounds.append({"read_gb_s": bandwidth["read_gb_s"], "floor_ms": round(floor, 1),
                       **{name: round(statistics.median(w) * 1e3, 1) for name, w in walls.items()}})
    cases = []
    for name, case in prepared_cases.items():
        print(f"profiling {name} ...", file=sys.stderr, flush=True)
        wall = statistics.median(one_forward(model, case) for _ in range(args.repeats)) * 1e3
        cases.append({"case": name, **profile_case(model, case, wall)})
    result = {"meta": {"machine": machine_label(), "model": args.model, "dtype": args.dtype, "prepack": args.prepack,
                       "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "date": time.strftime("%Y-%m-%d %H:%M"), "context": args.context,
                       "command": "python " + " ".join(sys.argv)},
              "weight_gb": round(weight_bytes / 1e9, 3), "rounds": rounds, "cases": cases}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / f"{out.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Where one forward goes: {args.model} {args.dtype}, {result['meta']['machine']}", "",
             f"`{result['meta']['command']}` ({result['meta']['date']}, {result['meta']['threads']} threads, "
             f"B = 1, {args.context} tokens of context)", "",
             f"A decode forward reads {result['weight_gb']} GB of weights (all but the input embedding), so it "
             "cannot take less than that over the memory read bandwidth measured beside it:", "",
             "| round | read GB/s | floor ms | " + " | ".join(f"{n}, ms (x floor)" for n in names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for k, r in enumerate(rounds, start=1):
        lines.append(f"| {k} | {r['read_gb_s']} | {r['floor_ms']} | "
                     + " | ".join(f"{r[n]} ({r[n] / r['floor_ms']:.2f}x)" for n in names) + " |")
    lines += ["", "Op by op (self time per forward under the profiler, which slows every op; the last row is the "
              "unprofiled wall time minus the profiled ops, i.e. Python and dispatch, when the profiler's own "
              "cost does not exceed it):", "",
              "| where | " + " | ".join(f"{c['case']}, ms" for c in cases) + " |", "|---|" + "---|" * len(cases)]
    for name in cases[0]["rows_ms"]:
        lines.append(f"| {name} | " + " | ".join(f"{c['rows_ms'].get(name, 0):.1f}" for c in cases) + " |")
    lines.append("| **wall, unprofiled** | " + " | ".join(f"**{c['wall_ms']:.1f}**" for c in cases) + " |")
    lines += ["", "Largest ops (self time, ms per forward, profiled):", ""]
    for c in cases:
        lines.append(f"- {c['case']}: " + ", ".join(f"`{k}` {v}" for k, v in list(c["top_ops_ms"].items())[:8]))
    (out.parent / f"{out.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
