"""CAST against the grid of fixed trees over the same drafter, by exact replays (castspec.bench.replay: acceptance
from the target's greedy reference, verify forwards priced by a cost table this machine learnt, drafting timed),
for the code checked out: run it on two commits with the same table and references to see what a change did
(issue 37, no-regret tree sizes). One policy per method decodes every prompt in turn, as in `castspec bench`.

Run: .venv/bin/python bench/scripts/regret_replay.py bench/regret/NAME --costs COSTS.json
     [--references BENCH.json] [--offset 0] [--per-set 8] [--sets mtbench,humaneval,gsm8k,repetitive]
     [--max-new-tokens 64] [--drafters ngram,suffix] [--draft qwen2.5-coder-0.5b --drafters draft]
COSTS.json: a learnt cost table of this target ($CASTSPEC_HOME/costs/online-*.json of a CAST run).
References: BENCH.json's AR rows, else the kept references file (NAME-references.json, or --kept-references
X-references.json to share one between runs) if it holds them, else AR decodes them here (and keeps them there).
--offset: the prompts after the first OFFSET of each set (a held-out slice).
Writes NAME.json, NAME.md, NAME.png."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from row_regimes import FIXED, drafter_tables, log, references, run_method, speedups  # noqa: E402

from castspec.api import Engine  # noqa: E402
from castspec.bench.runner import encode_prompts  # noqa: E402
from castspec.cli.options import prompt_rows  # noqa: E402
from castspec.costs.online import OnlineCostTable  # noqa: E402
from castspec.costs.table import machine_label  # noqa: E402
from castspec.models import load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--costs", required=True)
    parser.add_argument("--references")
    parser.add_argument("--kept-references", help="a PREFIX-references.json shared between runs")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--sets", default="mtbench,humaneval,gsm8k,repetitive")
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--per-set", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--drafters", default="ngram,suffix", help="ngram, suffix, draft (needs --draft)")
    parser.add_argument("--draft", help="the draft model of the 'draft' drafter, e.g. qwen2.5-coder-0.5b")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = json.loads(Path(args.costs).read_text())
    costs = OnlineCostTable.load_learned(Path(args.costs), table["meta"])
    target, tokenizer = load_model(args.model, args.dtype)
    draft_model = load_model(args.draft, args.dtype)[0] if args.draft else None
    engine = Engine(target, tokenizer)
    sets = [s for s in args.sets.split(",") if s]
    prompts = prompt_rows(args.sets, args.per_set, args.offset)
    for prompt, name in zip(prompts, [s for _ in range(args.per_set) for s in sets], strict=False):
        prompt["set"] = name  # prompt_rows interleaves the sets
    ids = encode_prompts(engine, prompts)
    kept = Path(args.kept_references.removesuffix("-references.json")) if args.kept_references else out
    refs = references(args, engine, prompts, ids, kept)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    result = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_label(), "commit": commit,
                       "model": args.model, "dtype": args.dtype, "costs": args.costs,
                       "costs_device": table["meta"].get("target", {}).get("device"),
                       "prompts": [p["id"] for p in prompts], "max_new_tokens": args.max_new_tokens,
                       "command": "python " + " ".join(sys.argv)}, "drafters": {}}
    for drafter in filter(None, args.drafters.split(",")):
        methods = {}
        for label in [*(f.format(d=drafter) for f in FIXED), f"cast:{drafter}"]:
            methods[label] = run_method(label, target, costs, prompts, ids, refs, args.max_new_tokens,
                                        draft_model=draft_model)
            log(f"{label}: {speedups(methods[label], sets)['all']:.3f}x")
        result["drafters"][drafter] = {"per_prompt": methods,
                                       "speedups": {m: speedups(p, sets) for m, p in methods.items()}}

    def named(suffix: str) -> Path:  # NAME.json etc.: with_suffix would cut a name like qwen1.5b at its dot
        return out.with_name(out.name + suffix)

    named(".json").write_text(json.dumps(result, indent=1))
    named(".md").write_text(report(result, sets))
    plot(result, sets, named(".png"))
    print(named(".md").read_text())


def relative(speedups: dict, sets: list[str]) -> dict[str, float]:
    """CAST's speed-up over the best fixed tree's, per column."""
    fixed = [m for m in speedups if not m.startswith("cast")]
    cast = next(m for m in speedups if m.startswith("cast"))
    return {c: speedups[cast][c] / max(speedups[m][c] for m in fixed) for c in [*sets, "all"]}


def report(result: dict, sets: list[str]) -> str:
    meta = result["meta"]
    lines = [f"# CAST against fixed trees by replay, code at {meta['commit']}: {meta['model']} {meta['dtype']}, "
             f"verify priced by a table of {meta['costs_device']}", "",
             f"`{meta['command']}` ({meta['date']}, {meta['machine']}); {len(meta['prompts'])} prompts x "
             f"{meta['max_new_tokens']} tokens. Cell: predicted speed-up over AR (for CAST, x the best fixed tree "
             "of the column).", ""]
    return "\n".join(lines + drafter_tables(result, sets)) + "\n"


def plot(result: dict, sets: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [*sets, "all"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for drafter, d in result["drafters"].items():
        rel = relative(d["speedups"], sets)
        ax.plot(columns, [rel[c] for c in columns], marker="o", label=f"CAST over {drafter}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(0.97, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("CAST / best fixed tree (replay)")
    ax.set_title(f"code at {result['meta']['commit']}, table of {result['meta']['costs_device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
