"""castspec bench-serve: a castspec server per method, loaded by streaming clients at fixed concurrency and rates."""

from __future__ import annotations

import sys
from pathlib import Path

from castspec.bench import PER_CLIENT
from castspec.cli.options import DEFAULT_DRAFT, DEFAULT_TARGET, command_line, int_list, prompt_rows
from castspec.errors import CastspecError


def register(sub) -> None:
    bserve = sub.add_parser("bench-serve", help="load benchmark over the HTTP API: a castspec serve per method, "
                                                "streaming clients at fixed concurrency and Poisson rates")
    bserve.add_argument("--model", default=DEFAULT_TARGET)
    bserve.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model for the methods whose drafter is 'draft'")
    bserve.add_argument("--head", help="EAGLE head for the methods whose drafter is 'head'")
    bserve.add_argument("--methods", default="ar;chain:draft:chain_length=4;eagle2:draft;cast:draft;cast:ngram",
                        help="';'-separated method items as in castspec bench")
    bserve.add_argument("--concurrency", default="1,2,4,8", help="fixed numbers of concurrent clients")
    bserve.add_argument("--rates", default="", help="Poisson arrival rates (requests/s), e.g. 0.1,0.3")
    bserve.add_argument("--sets", default="mtbench,humaneval,gsm8k")
    bserve.add_argument("--per-set", type=int, default=3, help="prompts taken from each set (each level sends all)")
    bserve.add_argument("--conversations", type=int, default=0,
                        help="the conversation benchmark instead of single prompts: N sessions (code edits, "
                             "revision, math, an agent loop) whose every turn resends the history; each level runs "
                             "them all from an empty prefix cache (0: single prompts from --sets)")
    bserve.add_argument("--turns", type=int, default=4, help="user turns per conversation (1..4, default 4)")
    bserve.add_argument("--max-tokens", type=int, default=64)
    bserve.add_argument("--per-client", type=int, default=PER_CLIENT,
                        help="a concurrency level cycles the prompts until each client has sent this many requests, "
                             "so that finished rows are replaced (steady load, not one draining wave)")
    bserve.add_argument("--max-batch-size", type=int, default=8)
    bserve.add_argument("--dtype", default="bf16")
    bserve.add_argument("--timeout", type=float, default=3600, help="seconds one level may take at most")
    bserve.add_argument("--replicas", help="comma-separated replica counts, each method served once per count "
                                          "(0 = one process without Ray; N = N Ray Serve replicas)")
    bserve.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs and torch threads per replica")
    bserve.add_argument("--out-dir", default="bench/serve")
    bserve.add_argument("--name", default="bench-serve")

    bserve.set_defaults(run=run_bench_serve)


def run_bench_serve(args) -> None:
    from castspec.bench.runner import _meta, parse_methods
    from castspec.bench.serving import run_bench_serve, save

    specs = parse_methods(args.methods, server=True)
    concurrency = int_list(args.concurrency, "--concurrency")
    rates = [float(r) for r in args.rates.split(",") if r.strip()] if args.rates else []
    if any(c < 1 for c in concurrency) or any(r <= 0 for r in rates):
        raise CastspecError("--concurrency levels and --rates must be positive")
    if args.max_tokens < 1 or args.per_set < 1 or args.per_client < 1:
        raise CastspecError("--max-tokens, --per-set and --per-client must be positive")
    replicas = None
    if args.replicas:
        try:
            replicas = [int(r) for r in args.replicas.split(",") if r.strip()]
        except ValueError:
            raise CastspecError(f"--replicas must be comma-separated integers, got {args.replicas!r}") from None
        if not replicas or any(r < 0 for r in replicas):
            raise CastspecError(f"--replicas counts must be 0 (one process) or more, got {args.replicas!r}")
    sessions = None
    if args.conversations:
        from castspec.bench.conversations import conversation_sessions

        if args.rates or args.replicas:
            raise CastspecError("--conversations runs at fixed --concurrency levels on one process (no --rates, "
                                "--replicas)")
        sessions = conversation_sessions(args.conversations, args.turns)
    prompts = prompt_rows(args.sets, args.per_set, 0)
    result = run_bench_serve(args.model, specs, prompts, concurrency, rates, args.max_tokens, args.dtype,
                             args.max_batch_size, args.draft, args.head, args.timeout, replicas,
                             args.replica_cpus, log=lambda line: print(line, file=sys.stderr, flush=True),
                             per_client=args.per_client, trace_dir=Path(args.out_dir) / f"{args.name}-traces",
                             sessions=sessions)
    meta = {**_meta(args.max_tokens, len(prompts)), "dtype": args.dtype, "max_batch_size": args.max_batch_size,
            "per_client": args.per_client}
    if replicas:
        meta["replica_cpus"] = args.replica_cpus
    if sessions:
        meta.update(conversations=len(sessions), turns=args.turns)
    command = command_line()
    what = f"{len(sessions)} conversations of {args.turns} turns" if sessions else f"{len(prompts)} prompts"
    save(result, Path(args.out_dir), args.name, command, f"castspec serve under load: {Path(args.model).name}, "
         f"{what} per level", meta)
    print(Path(args.out_dir) / f"{args.name}.md")
