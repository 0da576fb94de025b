"""castspec tune: the best fixed tree on a tuning split, by replaying every grid point and measuring the best few."""

from __future__ import annotations

from pathlib import Path

from castspec.cli.options import DEFAULT_TARGET, command_line, load_pair, prompt_rows
from castspec.errors import CastspecError


def register(sub) -> None:
    tune = sub.add_parser("tune", help="find the best fixed tree (EAGLE-2 grid or chain lengths) on a tuning split: "
                                       "replay every grid point, measure the best few")
    tune.add_argument("--model", default=DEFAULT_TARGET)
    tsrc = tune.add_mutually_exclusive_group()
    tsrc.add_argument("--draft", help="draft model (default: the n-gram drafter)")
    tsrc.add_argument("--drafter", default="ngram", help="a model-free drafter: ngram (the default)")
    tsrc.add_argument("--head", help="an EAGLE head as the drafter (directory or hub id); replays read the "
                                     "target's features of each reference")
    tune.add_argument("--method", default="eagle2", help="eagle2 | chain")
    tune.add_argument("--grid", help="';'-separated KEY=v1,v2,... (default eagle2: top_k=2,4,8,10;"
                                     "depth=2,3,4,5,6,7;total_tokens=8,16,32,60; chain: chain_length=1,2,3,4,5,6,8)")
    tune.add_argument("--sets", default="mtbench,humaneval,gsm8k")
    tune.add_argument("--per-set", type=int, default=3, help="tuning prompts taken from each set")
    tune.add_argument("--offset", type=int, default=40,
                      help="skip this many prompts of each set (default 40: disjoint from bench's first 40)")
    tune.add_argument("--max-new-tokens", type=int, default=64)
    tune.add_argument("--measure", type=int, default=3, help="best replayed grid points to measure for real "
                                                             "(0: replay only)")
    tune.add_argument("--dtype", default="bf16")
    tune.add_argument("--out-dir", default="bench")
    tune.add_argument("--name", default="tune")

    tune.set_defaults(run=run_tune)


def run_tune(args) -> None:
    from castspec.api import drafter_identity, find_cost_table
    from castspec.bench.tune import parse_grid, run_tune, save_tune, tune_markdown
    from castspec.costs.table import setup_key
    from castspec.drafters.draft_model import DraftModelDrafter
    from castspec.drafters.ngram import NgramDrafter

    grid = parse_grid(args.method, args.grid)
    if args.draft is None and args.drafter != "ngram":
        raise CastspecError(f"unknown drafter {args.drafter!r}: give --drafter ngram or --draft MODEL")
    for name in ("per_set", "max_new_tokens"):
        if getattr(args, name) <= 0:
            raise CastspecError(f"--{name.replace('_', '-')} must be positive")
    if args.measure < 0 or args.offset < 0:
        raise CastspecError("--measure and --offset must not be negative")
    target, tokenizer, draft = load_pair(args.model, args.draft, args.dtype)
    head = None
    if args.head:
        from castspec.drafters.eagle_head import EagleHeadDrafter, load_eagle_head

        head = (load_eagle_head(args.head, target), args.head)
    costs = find_cost_table(setup_key(target), drafter_identity(draft, args.head))
    if costs is None:
        source = (f"--head {args.head}" if args.head else f"--draft {args.draft}" if draft is not None
                  else "--drafter ngram")
        raise CastspecError("tune prices verify forwards from a cost table of this setup and drafter; make one "
                            f"with castspec profile --model {args.model} {source} --dtype {args.dtype}")
    prompts = prompt_rows(args.sets, args.per_set, args.offset)
    if not prompts:
        raise CastspecError(f"no prompts left after --offset {args.offset}")
    if head is not None:
        drafter, make_drafter = "head", lambda: EagleHeadDrafter(head[0], target)
    elif draft is not None:
        drafter, make_drafter = "draft", lambda: DraftModelDrafter(draft)
    else:
        drafter, make_drafter = "ngram", NgramDrafter
    result = run_tune(target, tokenizer, draft, args.method, drafter, grid, prompts, args.max_new_tokens, costs,
                      make_drafter, args.measure, head)
    command = command_line()
    save_tune(result, Path(args.out_dir), args.name, command)
    print(tune_markdown(result, command))
    print(f"results: {Path(args.out_dir) / args.name}.json / .md / .png")
