"""Does the online cost model follow the machine? CAST decodes prompts one after another (batch 1) from a fresh
probe; between two step numbers a competing CPU load of our own runs (one thread of matrix products, also
bounded in time); every step's measured and predicted verify and draft times, the tree CAST chose and the
curve's shifts are recorded. JSON + markdown + plot under bench/cost-online/.

    python bench/scripts/cost_drift.py --model qwen2.5-coder-1.5b --drafter ngram --dtype fp32 \\
        --steps 160 --load-from 50 --load-to 110 --name drift-qwen1.5b-ngram-fp32-avx2
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from castspec.api import Engine, drafter_identity, make_policy, online_cost_model
from castspec.bench.prompts import load_prompt_set
from castspec.costs.table import device_name
from castspec.decode.engine import RequestParams
from castspec.drafters.draft_model import DraftModelDrafter
from castspec.drafters.ngram import NgramDrafter
from castspec.models import load_model

COMPETITOR = """
import time, torch
torch.set_num_threads(1)
a = torch.randn(1024, 1024)
end = time.time() + {seconds}
while time.time() < end:
    a = (a @ a).tanh()
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", help="draft model (default: the n-gram drafter)")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--load-from", type=int, default=50)
    ap.add_argument("--load-to", type=int, default=110)
    ap.add_argument("--load-seconds", type=float, default=120.0, help="the competitor's own time limit")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--name", default="drift")
    ap.add_argument("--out-dir", default="bench/cost-online")
    args = ap.parse_args()

    target, tokenizer = load_model(args.model, args.dtype)
    draft_model = load_model(args.draft, args.dtype)[0] if args.draft else None
    drafter = DraftModelDrafter(draft_model) if draft_model is not None else NgramDrafter()
    costs = online_cost_model(target, drafter, drafter_identity(draft_model), fresh=True)
    engine = Engine(target, tokenizer, drafter, make_policy("cast", cost_table=costs))
    stepper = engine.stepper(max_batch_size=1)
    prompts = [p for name in ("humaneval", "mtbench", "gsm8k") for p in load_prompt_set(name)[:20]]
    rows, competitor, next_prompt = [], None, 0
    try:
        while len(rows) < args.steps:
            if not stepper.has_unfinished():
                p = prompts[next_prompt % len(prompts)]
                ids = engine.encode(messages=p["messages"]) if "messages" in p else engine.encode(prompt=p["prompt"])
                stepper.add_request(None, ids, RequestParams(max_tokens=args.max_tokens))
                next_prompt += 1
            if len(rows) == args.load_from and competitor is None:
                competitor = subprocess.Popen([sys.executable, "-c",
                                               COMPETITOR.format(seconds=args.load_seconds)])
            if len(rows) == args.load_to and competitor is not None:
                competitor.kill()
                competitor.wait()
            stepper.step()
            info = stepper.last_step
            if info is None or info.kind != "decode":
                continue
            timing = info.record.decisions.get("timing", {})
            rows.append({"step": len(rows), "load": args.load_from <= len(rows) < args.load_to,
                         "tree_size": info.tree_sizes[0], "accepted": info.accepted[0],
                         "depth": info.record.depth, "shifts": costs.target_curve.shifts,
                         "draft_shifts": costs.draft_curve.shifts, **timing})
            print(f"\rstep {len(rows)}/{args.steps} verify {timing.get('verify_s', 0) * 1e3:.0f} ms "
                  f"(predicted {timing.get('verify_predicted_s', 0) * 1e3:.0f}) tree {info.tree_sizes[0]}",
                  end="", file=sys.stderr, flush=True)
    finally:
        if competitor is not None and competitor.poll() is None:
            competitor.kill()
    print(file=sys.stderr)
    report = summarise(rows, args)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"report": report, "steps": rows}, indent=1))
    (out / f"{args.name}.md").write_text(markdown(report, args))
    plot(rows, args, out / f"{args.name}.png")
    print(markdown(report, args))


def summarise(rows: list[dict], args) -> dict:
    def phase(selected: list[dict]) -> dict:
        if not selected:
            return {}
        err = [abs(r["verify_predicted_s"] / r["verify_s"] - 1) for r in selected]
        return {"steps": len(selected), "verify_ms": statistics.median(r["verify_s"] for r in selected) * 1e3,
                "predicted_verify_ms": statistics.median(r["verify_predicted_s"] for r in selected) * 1e3,
                "median_prediction_error": statistics.median(err),
                "mean_tree_size": statistics.fmean(r["tree_size"] for r in selected),
                "drafting_steps": sum(1 for r in selected if r["depth"] > 0) / len(selected),
                "tau": statistics.fmean(r["accepted"] for r in selected)}

    before = [r for r in rows if r["step"] < args.load_from]
    during = [r for r in rows if args.load_from <= r["step"] < args.load_to]
    after = [r for r in rows if r["step"] >= args.load_to]
    settle = args.load_from + 12
    return {"machine": f"{device_name(torch.device('cpu'))}, {torch.get_num_threads()} threads",
            "date": time.strftime("%Y-%m-%d %H:%M"), "model": args.model, "drafter": args.draft or args.drafter,
            "dtype": args.dtype, "command": "python " + " ".join(sys.argv),
            "before": phase(before), "during": phase(during),
            "during_after_first_12": phase([r for r in during if r["step"] >= settle]), "after": phase(after),
            "shift_steps": [r["step"] for a, r in itertools.pairwise(rows) if r["shifts"] != a["shifts"]]}


def markdown(report: dict, args) -> str:
    lines = [f"# Online cost model under a competing load: {report['model']} ({report['dtype']}), "
             f"drafter {report['drafter']}", "", f"{report['date']}, {report['machine']}", "", "```",
             report["command"], "```", "",
             f"Competing load (1 thread of matrix products) from step {args.load_from} to step {args.load_to}.", "",
             "| phase | steps | verify ms (median) | predicted ms | median prediction error | mean tree | "
             "drafting steps | tau |", "|---|---|---|---|---|---|---|---|"]
    for name in ("before", "during", "during_after_first_12", "after"):
        p = report[name]
        if p:
            lines.append(f"| {name.replace('_', ' ')} | {p['steps']} | {p['verify_ms']:.0f} | "
                         f"{p['predicted_verify_ms']:.0f} | {p['median_prediction_error'] * 100:.1f}% | "
                         f"{p['mean_tree_size']:.2f} | {p['drafting_steps'] * 100:.0f}% | {p['tau']:.2f} |")
    lines += ["", f"Whole-curve shifts of the target's curve at steps: {report['shift_steps'] or 'none'}."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(steps, [r["verify_s"] * 1e3 for r in rows], ".", color="tab:blue", label="verify, measured")
    top.plot(steps, [r["verify_predicted_s"] * 1e3 for r in rows], "-", color="tab:orange",
             label="verify, predicted before the step")
    top.set_ylabel("ms per verify forward")
    top.legend(fontsize=8)
    bottom.step(steps, [r["tree_size"] for r in rows], where="mid", color="tab:green", label="verified tree size")
    bottom.set_ylabel("drafted nodes verified")
    bottom.set_xlabel("decoding step")
    for ax in (top, bottom):
        ax.axvspan(args.load_from, args.load_to, color="grey", alpha=0.15, label="competing load")
        ax.grid(alpha=0.3)
    bottom.legend(fontsize=8)
    fig.suptitle(f"online cost model, {args.model} {args.dtype}, drafter {args.draft or args.drafter}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
