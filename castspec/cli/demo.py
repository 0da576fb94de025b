"""castspec demo: the default models, plain AR against fixed speculative trees and CAST over the same drafters
(the draft model and a model-free n-gram drafter), on a few prompts; the fastest row first."""

from __future__ import annotations

import json
from pathlib import Path

from castspec.cli.options import DEFAULT_DRAFT, DEFAULT_TARGET, forward_args, load_pair, prompt_rows, wants_compile
from castspec.errors import CastspecError

# fixed trees over each drafter, then CAST over the same drafter: CAST must beat every one of them
DEMO_METHODS = ("ar;chain:draft:chain_length=2;chain:draft:chain_length=4;eagle2:draft:top_k=2,depth=3,total_tokens=6;"
                "cast:draft;chain:ngram:chain_length=4;eagle2:ngram;cast:ngram")


def register(sub) -> None:
    demo = sub.add_parser("demo", help="fetch the default models and race AR, fixed speculative trees and CAST")
    demo.add_argument("--model", default=DEFAULT_TARGET)
    demo.add_argument("--draft", default=DEFAULT_DRAFT)
    demo.add_argument("--prompts", type=int, default=1, help="prompts per set (MT-bench, HumanEval, GSM8K)")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument("--json", metavar="PATH", help="also write the rows and CAST's choices as JSON here")
    forward_args(demo)
    demo.set_defaults(run=run_demo)


def run_demo(args) -> None:
    from castspec.bench.runner import markdown_table, parse_methods, run_benchmark

    print(f"castspec demo: {args.model} (bf16) with {args.draft} as drafter, on this machine's CPU", flush=True)
    if args.draft in (None, "", "none"):
        raise CastspecError("the demo drafts with a draft model: give one with --draft")
    target, tokenizer, draft = load_pair(args.model, args.draft, "bf16", args.prepack, wants_compile(args))
    prompts = prompt_rows("mtbench,humaneval,gsm8k", args.prompts, 0)
    result = run_benchmark(target, tokenizer, draft, parse_methods(DEMO_METHODS), prompts, args.max_new_tokens)
    rows = sorted((r for r in result["summary"] if r["task"] == "all"), key=lambda r: -(r["speedup"] or 0))
    print(markdown_table(rows))
    print("speed-up = tokens/s over plain AR measured in this run; tau = mean tokens per target forward; "
          "'same as AR' counts outputs identical to AR (bf16 may flip near-ties; exactness is proven in fp32 tests)")
    choices = cast_choices(rows)
    for line in choices:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "cast_choices": choices}, indent=1) + "\n")


def cast_choices(rows: list[dict]) -> list[str]:
    """One line per drafter: CAST's speed beside the best fixed tree over the same drafter, and what it chose."""
    from castspec.bench.runner import method_family

    lines = []
    for cast in (r for r in rows if method_family(r["method"])[0] == "cast"):
        drafter = method_family(cast["method"])[1]
        fixed = [r for r in rows if method_family(r["method"]) in (("chain", drafter), ("eagle2", drafter))]
        line = f"CAST over {drafter}: {cast['speedup']:.2f}x AR"
        if fixed:
            best = max(fixed, key=lambda r: r["speedup"])
            line += (f", {cast['speedup'] / best['speedup']:.2f}x the best fixed tree over the same drafter "
                     f"({best['method']}, {best['speedup']:.2f}x)")
        share = cast.get("drafted_share")
        if share is not None:
            line += (f"; it verified drafted tokens on {share:.0%} of its steps, {cast['mean_tree_size']:.1f} per step "
                     f"to depth {cast['mean_depth']:.1f} on average, trees sized from this machine's measured costs")
        lines.append(line)
    return lines
