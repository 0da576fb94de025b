"""castspec demo: the default models, plain AR against fixed speculative trees and CAST, on a few prompts."""

from __future__ import annotations

from castspec.cli.options import DEFAULT_DRAFT, DEFAULT_TARGET, load_pair, prompt_rows
from castspec.errors import CastspecError

DEMO_METHODS = "ar;chain:draft:chain_length=2;eagle2:draft:top_k=2,depth=3,total_tokens=6;eagle2:ngram"


def register(sub) -> None:
    demo = sub.add_parser("demo", help="fetch the default models and compare AR with speculative decoding")
    demo.add_argument("--model", default=DEFAULT_TARGET)
    demo.add_argument("--draft", default=DEFAULT_DRAFT)
    demo.add_argument("--prompts", type=int, default=1, help="prompts per set (MT-bench, HumanEval, GSM8K)")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.set_defaults(run=run_demo)


def run_demo(args) -> None:
    from castspec.bench.runner import markdown_table, parse_methods, run_benchmark

    print(f"castspec demo: {args.model} (bf16) with {args.draft} as drafter, on this machine's CPU", flush=True)
    if args.draft in (None, "", "none"):
        raise CastspecError("the demo drafts with a draft model: give one with --draft")
    target, tokenizer, draft = load_pair(args.model, args.draft, "bf16")
    prompts = prompt_rows("mtbench,humaneval,gsm8k", args.prompts, 0)
    result = run_benchmark(target, tokenizer, draft, parse_methods(DEMO_METHODS + ";cast:draft"), prompts,
                           args.max_new_tokens)
    print(markdown_table([r for r in result["summary"] if r["task"] == "all"]))
    print("speed-up = tokens/s over plain AR measured in this run; tau = mean tokens per target forward; "
          "'same as AR' counts outputs identical to AR (bf16 may flip near-ties; exactness is proven in fp32 tests)")
