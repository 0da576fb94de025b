"""CAST with one shared acceptance map against CAST with each row's own regime on top, new rows read as the shared map
or hedged by the newcomers before them (issue 37, no-regret tree sizes),
beside the grid of fixed trees over the same drafter, by exact replays (castspec.bench.replay: acceptance from the
target's greedy reference, verify forwards priced by a cost table this machine learnt, drafting timed).

As in `castspec bench`, one policy per method decodes every prompt in turn (the sets interleaved, the first prompt
once before as a warm-up), so what CAST learnt on one prompt is what it starts the next with. Per prompt set and
on the mix: each method's predicted speed-up over AR (AR's steps priced by the same table), and CAST's against the
best fixed tree of the column.

Run: .venv/bin/python bench/scripts/row_regimes.py bench/regret/NAME --costs COSTS.json
     [--references BENCH.json] [--sets mtbench,humaneval,gsm8k,repetitive] [--per-set 4] [--max-new-tokens 64]
     [--drafters ngram,suffix] [--draft qwen2.5-coder-0.5b --drafters draft]
COSTS.json: a learnt cost table of this target on this machine ($CASTSPEC_HOME/costs/online-*.json of a CAST run).
BENCH.json: a `castspec bench` run whose AR rows give the references (else AR decodes them here, and they are
kept in NAME-references.json for the next run). Writes NAME.json, NAME.md, NAME.png."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from castspec.api import Engine, make_policy
from castspec.bench.replay import replay
from castspec.bench.runner import encode_prompts, method_parts, parse_methods, policy_options
from castspec.cli.options import prompt_rows
from castspec.costs.online import OnlineCostTable
from castspec.costs.table import machine_label
from castspec.models import load_model
from castspec.policies.cast import CastPolicy

FIXED = ["chain:{d}:chain_length=2", "chain:{d}:chain_length=3", "chain:{d}:chain_length=4",
         "chain:{d}:chain_length=8", "chain:{d}:chain_length=16", "eagle2:{d}:top_k=2,depth=3,total_tokens=6",
         "eagle2:{d}:top_k=4,depth=4,total_tokens=16", "eagle2:{d}"]
# how each row's own evidence enters CAST: not at all, row regimes whose new rows read as the shared map (the code
# of 8d1d3c8-6cb6c6c), row regimes whose new rows read as the newcomers before them did (RowRegimes.newcomer_factor)
CAST_VARIANTS = {"cast, one map": "none", "cast, row regimes, no newcomers' hedge": "rows",
                 "cast, row regimes": "newcomers"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def references(args, engine: Engine, prompts: list[dict], ids: list[list[int]], out: Path) -> list[list[int]]:
    if args.references:
        rows = json.loads(Path(args.references).read_text())["rows"]
        by_id = {r["prompt_id"]: json.loads(r["output_ids"]) if isinstance(r["output_ids"], str) else r["output_ids"]
                 for r in rows if r["method"] == "ar"}
        missing = [p["id"] for p in prompts if p["id"] not in by_id]
        if missing:
            raise SystemExit(f"{args.references} has no AR output for {', '.join(missing)}")
        return [by_id[p["id"]] for p in prompts]
    kept = out.with_name(out.name + "-references.json")
    saved = json.loads(kept.read_text()) if kept.exists() else {}
    refs = []
    for number, (prompt, prompt_ids) in enumerate(zip(prompts, ids, strict=True), start=1):
        if prompt["id"] not in saved or len(saved[prompt["id"]]) < args.max_new_tokens:
            start = time.perf_counter()
            saved[prompt["id"]] = engine.generate(prompt_ids=prompt_ids, max_new_tokens=args.max_new_tokens).output_ids
            kept.write_text(json.dumps(saved))
            log(f"  reference {number}/{len(prompts)} ({prompt['id']}): {time.perf_counter() - start:.1f} s")
        refs.append(saved[prompt["id"]])
    return refs


def run_method(label: str, target, costs, prompts, ids, refs, max_new_tokens: int, row_regimes: str = "newcomers",
               draft_model=None):
    """Per prompt: (set, AR seconds priced, decode seconds, tokens, steps), one policy for every prompt in turn."""
    spec = parse_methods(label)[0]
    # a new drafter for each method
    drafter, _ = method_parts(parse_methods(f"chain:{spec.drafter}")[0], target, draft_model)
    policy = make_policy(spec.method, **policy_options(spec, costs))
    if isinstance(policy, CastPolicy) and policy.calibration is not None and row_regimes == "none":
        policy.calibration.regimes = None
    if isinstance(policy, CastPolicy) and policy.calibration is not None and row_regimes == "rows":
        policy.calibration.regimes.newcomer_factor = lambda band: 1.0  # a new row reads as the shared map
    replay(drafter, policy, ids[0], refs[0], costs, max_new_tokens)  # warm-up, as castspec bench does
    per_prompt = []
    for prompt, prompt_ids, ref in zip(prompts, ids, refs, strict=True):
        r = replay(drafter, policy, prompt_ids, ref, costs, max_new_tokens)
        per_prompt.append({"prompt": prompt["id"], "set": prompt["set"], "ar_s": r.ar_s, "decode_s": r.decode_s,
                           "tokens": r.new_tokens, "steps": len(r.accepted), "verified": sum(r.tree_sizes)})
    return per_prompt


def speedups(per_prompt: list[dict], sets: list[str]) -> dict:
    out = {}
    for column in [*sets, "all"]:
        rows = [p for p in per_prompt if column == "all" or p["set"] == column]
        out[column] = sum(p["ar_s"] for p in rows) / sum(p["decode_s"] for p in rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--costs", required=True)
    parser.add_argument("--references")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--sets", default="mtbench,humaneval,gsm8k,repetitive")
    parser.add_argument("--per-set", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--drafters", default="ngram,suffix", help="ngram, suffix, draft (needs --draft)")
    parser.add_argument("--draft", help="the draft model of the 'draft' drafter, e.g. qwen2.5-coder-0.5b")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = json.loads(Path(args.costs).read_text())
    kept_costs = out.with_name(out.name + "-costs.json")  # the table priced with, kept beside the results
    if Path(args.costs).resolve() != kept_costs.resolve():
        kept_costs.write_text(json.dumps(table))
    costs = OnlineCostTable.load_learned(kept_costs, table["meta"])
    target, tokenizer = load_model(args.model, args.dtype)
    draft_model = load_model(args.draft, args.dtype)[0] if args.draft else None
    engine = Engine(target, tokenizer)
    sets = [s for s in args.sets.split(",") if s]
    prompts = prompt_rows(args.sets, args.per_set, 0)
    for prompt, name in zip(prompts, [s for _ in range(args.per_set) for s in sets], strict=False):
        prompt["set"] = name  # prompt_rows interleaves the sets
    ids = encode_prompts(engine, prompts)
    refs = references(args, engine, prompts, ids, out)
    result = {"meta": {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_label(), "model": args.model,
                       "dtype": args.dtype, "costs": str(kept_costs), "costs_meta": table["meta"],
                       "references": args.references or "AR here", "prompts": [p["id"] for p in prompts],
                       "max_new_tokens": args.max_new_tokens, "command": "python " + " ".join(sys.argv)},
              "drafters": {}}
    for drafter in filter(None, args.drafters.split(",")):
        methods = {}
        for label in [f.format(d=drafter) for f in FIXED]:
            methods[label] = run_method(label, target, costs, prompts, ids, refs, args.max_new_tokens,
                                        draft_model=draft_model)
            log(f"{label}: {speedups(methods[label], sets)['all']:.3f}x")
        for name, row_regimes in CAST_VARIANTS.items():
            methods[name] = run_method(f"cast:{drafter}", target, costs, prompts, ids, refs, args.max_new_tokens,
                                       row_regimes, draft_model)
            log(f"{name} over {drafter}: {speedups(methods[name], sets)['all']:.3f}x")
        result["drafters"][drafter] = {"per_prompt": methods, "speedups": {m: speedups(p, sets)
                                                                          for m, p in methods.items()}}
    def named(suffix: str) -> Path:  # NAME.json etc.: with_suffix would cut a name like qwen1.5b at its dot
        return out.with_name(out.name + suffix)

    named(".json").write_text(json.dumps(result, indent=1))
    named(".md").write_text(report(result, sets))
    plot(result, sets, named(".png"))
    print(named(".md").read_text())


def report(result: dict, sets: list[str]) -> str:
    meta = result["meta"]
    lines = [f"# CAST, one acceptance map vs each row's regime, against fixed trees (replays): {meta['model']} "
             f"{meta['dtype']}, {meta['machine']}", "", f"`{meta['command']}` ({meta['date']}); "
             f"{len(meta['prompts'])} prompts x {meta['max_new_tokens']} tokens, references: {meta['references']}; "
             "verify priced by the learnt table, drafting timed. Cell: predicted speed-up over AR (x the best fixed "
             "tree of the column for the CAST rows).", ""]
    return "\n".join(lines + drafter_tables(result, sets)) + "\n"


def drafter_tables(result: dict, sets: list[str]) -> list[str]:
    """Per drafter, a markdown table: each method's speed-up per column, CAST rows also over the column's best
    fixed tree (starred)."""
    lines = []
    for drafter, d in result["drafters"].items():
        s = d["speedups"]
        fixed = [m for m in s if not m.startswith("cast")]
        best = {c: max(s[m][c] for m in fixed) for c in [*sets, "all"]}
        lines += [f"## {drafter}", "", "| method | " + " | ".join([*sets, "all"]) + " |",
                  "|---|" + "---|" * (len(sets) + 1)]
        for m, cols in s.items():
            cells = [f"{cols[c]:.2f}x" + (f" ({cols[c] / best[c]:.2f})" if m.startswith("cast") else "")
                     + ("*" if not m.startswith("cast") and cols[c] == best[c] else "") for c in [*sets, "all"]]
            lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
        lines += ["", "\\* the best fixed tree of the column.", ""]
    return lines


def plot(result: dict, sets: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [*sets, "all"]
    fig, axes = plt.subplots(1, len(result["drafters"]), figsize=(6 * len(result["drafters"]), 4), squeeze=False)
    for ax, (drafter, d) in zip(axes[0], result["drafters"].items(), strict=True):
        s = d["speedups"]
        fixed = [m for m in s if not m.startswith("cast")]
        best = [max(s[m][c] for m in fixed) for c in columns]
        for name, marker in zip(CAST_VARIANTS, "o^s", strict=True):
            ax.plot(columns, [s[name][c] / b for c, b in zip(columns, best, strict=True)], marker=marker, label=name)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(0.97, color="grey", lw=0.8, ls="--")
        ax.set_title(f"{drafter}: CAST / best fixed tree (replays)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
