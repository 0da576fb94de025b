"""Pre-packed linear weights against the weights as loaded (issue 38): the same bf16 models in one process, both
setups loaded side by side and measured in alternating order, so that this machine's drift (its memory
bandwidth moves 2-5x within minutes) hits both alike.

1. One forward of the target (and of the draft model) for B x n = 1x1 (an AR step), 1x16 (a tree verify), 4x1
   and 8x1 (batched decode), in rounds: each round measures the memory read bandwidth, then times every case of
   both setups `--repeats` times in alternating order, and keeps each case's median; a round's ratio is
   as-loaded over packed time, and the floor is the weights' bytes over that round's bandwidth.
2. Generation: AR and CAST over the draft model (online cost model, from an empty $CASTSPEC_HOME per setup: each
   probes its own table) on the same prompts, both setups per prompt in alternating order; tokens per second per
   generation, and whether each setup's CAST output equals its own AR output.

Run: .venv/bin/python bench/scripts/prepack_study.py bench/forward-profile/NAME [--rounds 12] [--per-set 2]
     (writes NAME.json, NAME.md and NAME.png)"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from castspec.costs.table import machine_label

CASES = ((1, 1), (1, 16), (4, 1), (8, 1))


def read_gb_s(tensor: torch.Tensor) -> float:
    start = time.perf_counter()
    tensor.sum()
    return tensor.numel() * tensor.element_size() / (time.perf_counter() - start) / 1e9


def weight_gb(model) -> float:
    """Bytes a decode forward reads: every weight but the input embedding's table (one row a token)."""
    embedding = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding) / 1e9


def forward_rounds(models: dict, rounds: int, repeats: int, context: int, log) -> list[dict]:
    from profile_forward import one_forward, prepared

    cases = {(setup, b, n): prepared(model, b, context, n) for setup, model in models.items() for b, n in CASES}
    for key, case in cases.items():  # warm every shape
        one_forward(models[key[0]], case)
    probe = torch.ones(1 << 27, dtype=torch.float32)  # 0.5 GiB
    out = []
    for r in range(rounds):
        bandwidth = statistics.median(read_gb_s(probe) for _ in range(3))
        times: dict = {key: [] for key in cases}
        order = list(cases) if r % 2 == 0 else list(cases)[::-1]
        for _ in range(repeats):
            for key in order:
                times[key].append(one_forward(models[key[0]], cases[key]))
        row = {"read_gb_s": round(bandwidth, 1)}
        for b, n in CASES:
            loaded, packed = (statistics.median(times[(s, b, n)]) * 1e3 for s in ("as loaded", "packed"))
            row[f"{b}x{n}"] = {"as_loaded_ms": round(loaded, 1), "packed_ms": round(packed, 1),
                               "ratio": round(loaded / packed, 3)}
        out.append(row)
        log(f"round {r + 1}/{rounds}: {bandwidth:.1f} GB/s, "
            + ", ".join(f"{k} {v['as_loaded_ms']}/{v['packed_ms']} ms" for k, v in row.items() if k != "read_gb_s"))
    return out


def generation(target: str, draft: str, prompts: list[dict], max_new_tokens: int, log) -> dict:
    from castspec import Engine

    engines = {}
    for setup, prepack in (("as loaded", False), ("packed", True)):
        home = tempfile.mkdtemp(prefix=f"castspec-prepack-{prepack}-")
        models_dir = Path(os.environ.get("CASTSPEC_HOME", Path.home() / ".cache" / "castspec")) / "models"
        os.symlink(models_dir, Path(home) / "models")  # the fetched weights; costs start empty
        os.environ["CASTSPEC_HOME"] = home
        log(f"loading {setup}: CAST over {draft} (probing its costs from an empty home) ...")
        cast = Engine.load(target, method="cast", draft=draft, dtype="bf16", prepack=prepack)
        engines[(setup, "cast")] = cast
        engines[(setup, "ar")] = Engine(cast.model, cast.tokenizer)
    rows = []
    for i, prompt in enumerate(prompts):
        order = list(engines) if i % 2 == 0 else list(engines)[::-1]
        outputs, speeds = {}, {}
        for key in order:
            result = engines[key].generate(messages=prompt["messages"], max_new_tokens=max_new_tokens)
            outputs[key], speeds[key] = result.output_ids, len(result.output_ids) / result.wall_s
        rows.append({"prompt": prompt["id"], "tokens_per_s": {f"{s} {m}": round(v, 3) for (s, m), v in speeds.items()},
                     "cast_equals_own_ar": {s: outputs[(s, "cast")] == outputs[(s, "ar")]
                                            for s in ("as loaded", "packed")}})
        log(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(f"{k} {v}" for k, v in rows[-1]["tokens_per_s"].items()))
    return {"rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sets", default="mtbench,humaneval,gsm8k")
    parser.add_argument("--per-set", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from castspec.cli.options import prompt_rows
    from castspec.models import load_model

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    result = {"meta": {"machine": machine_label(), "model": args.model, "draft": args.draft, "dtype": "bf16",
                       "threads": torch.get_num_threads(), "torch": torch.__version__,
                       "date": time.strftime("%Y-%m-%d %H:%M"), "context": args.context,
                       "command": "python " + " ".join(sys.argv)}}
    for name in (args.model, args.draft):
        models = {"as loaded": load_model(name, "bf16", prepack=False)[0], "packed": load_model(name, "bf16")[0]}
        log(f"{name}: forwards, {args.rounds} rounds ...")
        result[name] = {"weight_gb": round(weight_gb(models["as loaded"]), 3),
                        "rounds": forward_rounds(models, args.rounds, args.repeats, args.context, log)}
        del models
    prompts = prompt_rows(args.sets, args.per_set, 0)
    result["generation"] = generation(args.model, args.draft, prompts, args.max_new_tokens, log)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / f"{out.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out.parent / f"{out.name}.md").write_text(report(result, args) + "\n")
    plot(result, args, out.parent / f"{out.name}.png")
    print(report(result, args))


def report(result: dict, args) -> str:
    meta = result["meta"]
    lines = [f"# Pre-packed linear weights against the weights as loaded: {args.model} bf16, {meta['machine']}", "",
             f"`{meta['command']}` ({meta['date']}, {meta['threads']} threads, {args.context} tokens of context)", ""]
    for name in (args.model, args.draft):
        rounds = result[name]["rounds"]
        lines += [f"## One forward of {name} ({result[name]['weight_gb']} GB of weights read per forward)", "",
                  "Median over rounds (each round: the median of its repeats), and the median of the rounds' "
                  "ratios; the floor is the weights over the round's read bandwidth:", "",
                  "| B x n | as loaded, ms | packed, ms | as loaded / packed (rounds' median, range) | "
                  "packed / floor |", "|---|---|---|---|---|"]
        for b, n in CASES:
            key = f"{b}x{n}"
            ratios = [r[key]["ratio"] for r in rounds]
            floors = [r[key]["packed_ms"] / (result[name]["weight_gb"] / r["read_gb_s"] * 1e3) for r in rounds]
            lines.append(f"| {key} | {statistics.median(r[key]['as_loaded_ms'] for r in rounds):.1f} | "
                         f"{statistics.median(r[key]['packed_ms'] for r in rounds):.1f} | "
                         f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) | "
                         f"{statistics.median(floors):.2f}x |")
        lines += ["", "Read bandwidth per round, GB/s: " + ", ".join(str(r["read_gb_s"]) for r in rounds), ""]
    rows = result["generation"]["rows"]
    keys = list(rows[0]["tokens_per_s"])
    lines += ["## Generation (bf16, greedy, tokens per second per generation)", "",
              "| method | as loaded, tok/s (median) | packed, tok/s (median) | packed / as loaded (median of "
              "per-prompt ratios) |", "|---|---|---|---|"]
    for method in ("ar", "cast"):
        loaded = [r["tokens_per_s"][f"as loaded {method}"] for r in rows]
        packed = [r["tokens_per_s"][f"packed {method}"] for r in rows]
        ratio = statistics.median(p / q for p, q in zip(packed, loaded, strict=True))
        lines.append(f"| {'AR' if method == 'ar' else 'CAST over ' + args.draft} | {statistics.median(loaded):.2f} "
                     f"| {statistics.median(packed):.2f} | **{ratio:.2f}x** |")
    same = {s: sum(r["cast_equals_own_ar"][s] for r in rows) for s in ("as loaded", "packed")}
    lines += ["", f"CAST's output equals the same setup's AR output on {same['as loaded']}/{len(rows)} prompts "
              f"as loaded and {same['packed']}/{len(rows)} packed (bf16: a verify of many rows and an AR step of "
              "one round differently on either setup; exactness is tested in fp32, tests/test_prepack.py). "
              "Prompts: " + ", ".join(r["prompt"] for r in rows) + f"; columns per prompt in {keys}."]
    return "\n".join(lines)


def plot(result: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name in zip(axes, (args.model, args.draft), strict=True):
        rounds = result[name]["rounds"]
        for k, (b, n) in enumerate(CASES):
            key = f"{b}x{n}"
            xs = [r["read_gb_s"] for r in rounds]
            ax.scatter(xs, [r[key]["ratio"] for r in rounds], label=f"B x n = {key}", marker="osD^"[k], alpha=0.7)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("memory read bandwidth in the round, GB/s")
        ax.set_ylabel("forward time: as loaded / packed")
        ax.set_title(f"{name}, bf16")
        ax.legend(fontsize=8)
    fig.suptitle(f"Pre-packed linear weights, one round per point ({result['meta']['machine']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
