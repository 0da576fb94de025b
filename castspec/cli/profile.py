"""castspec profile: measure, validate or plot a cost table f(B, c, n) of this machine."""

from __future__ import annotations

import time

from castspec.cli.options import command_line, forward_args, int_list, wants_compile
from castspec.errors import CastspecError


def register(sub) -> None:
    prof = sub.add_parser("profile", help="measure, validate or plot a cost table f(B, c, n)")
    prof.add_argument("--model", help="target model (registry name, directory or hub id)")
    psrc = prof.add_mutually_exclusive_group()
    psrc.add_argument("--draft", help="draft model to profile as the drafter")
    psrc.add_argument("--drafter", help="a model-free drafter to profile: ngram | suffix")
    psrc.add_argument("--head", help="an EAGLE head to profile as the drafter (directory or hub id)")
    prof.add_argument("--batch-sizes", default="1,2,4,8")
    prof.add_argument("--contexts", default="128,256,512,1024,2048")
    prof.add_argument("--max-tokens", type=int, default=64)
    prof.add_argument("--repeats", type=int, default=3,
                      help="passes over the whole grid, each in a new random order; each point keeps its median")
    prof.add_argument("--dtype", default="bf16")
    prof.add_argument("--device", default="cpu")
    forward_args(prof)
    prof.add_argument("--out", help="where to write the table (JSON)")
    prof.add_argument("--quick", action="store_true", help="a small grid that finishes in about a minute")
    prof.add_argument("--validate", metavar="TABLE", help="measure held-out points and report the table's error")
    prof.add_argument("--points", type=int, default=20, help="held-out points for --validate")
    prof.add_argument("--plot", nargs=2, metavar=("TABLE", "OUT_PNG"), help="plot a table's cost curves")
    prof.add_argument("--compare", metavar="TABLE",
                      help="with --plot: draw this table (e.g. a learned one) over the plotted one's grid points")
    prof.add_argument("--force", action="store_true", help="use a table measured on another setup")

    prof.set_defaults(run=run_profile)


def run_profile(args) -> None:
    import torch
    from tqdm import tqdm

    from castspec.costs import profile as measure
    from castspec.costs.table import CostTable, device_name, setup_key
    from castspec.models import load_model

    if args.plot:
        table = CostTable.load(args.plot[0])
        measure.plot_table(table, args.plot[1], CostTable.load(args.compare) if args.compare else None)
        print(args.plot[1])
        return
    if args.repeats < 1:
        raise CastspecError(f"--repeats must be at least 1, got {args.repeats}")
    if args.validate:
        table = CostTable.load(args.validate)
        model = args.model or table.meta["target"].get("source")
        draft = args.draft or table.meta.get("draft", {}).get("source")
        drafter = args.drafter or table.meta.get("draft", {}).get("drafter")
        dtype = args.dtype if args.model else table.meta["target"].get("dtype_name", args.dtype)
    else:
        if not args.model or not args.out:
            raise CastspecError("profiling needs --model and --out (or use --validate / --plot)")
        model, draft, drafter, dtype = args.model, args.draft, args.drafter, args.dtype
    if drafter is not None and drafter not in ("ngram", "suffix") and not drafter.startswith("eagle-head:"):
        raise CastspecError(f"unknown drafter {drafter!r}; choose from ngram, suffix")
    head_source = args.head or (table.meta.get("draft", {}).get("source") if args.validate and drafter
                                and drafter.startswith("eagle-head:") else None)
    target, _ = load_model(model, dtype, args.device, prepack=args.prepack, compile=wants_compile(args))
    draft_model = load_model(draft, dtype, args.device, prepack=args.prepack)[0] if draft and not head_source else None
    # a profile times one forward per call and repeats the whole grid in random passes (measure_grids); a
    # validation point is timed once, so it takes the median of three forwards
    per_call = 3 if args.validate else 1
    timers = {"target": lambda b, c, n: measure.time_target_forward(target, b, c, n, per_call)}
    if head_source:
        from castspec.api import drafter_identity
        from castspec.drafters.eagle_head import load_eagle_head

        head = load_eagle_head(head_source, target)
        drafter = drafter_identity(None, head_source)
        timers["draft"] = lambda b, c, n: measure.time_head(head, target, b, c, n, per_call)
    elif draft_model is not None:
        timers["draft"] = lambda b, c, n: measure.time_forward(draft_model, b, c, n, per_call)
    elif drafter in ("ngram", "suffix"):
        timers["draft"] = lambda b, c, n: measure.time_ngram(n * b, c, per_call, drafter)

    if args.validate:
        expected = setup_key(target)
        table = CostTable.load(args.validate, expect=expected, force=args.force)
        points = measure.held_out_points(table.target, args.points)
        bar = tqdm(total=len(points) * len(timers), desc="validate", unit="pt")

        def counted(timer):
            def run(b, c, n):
                value = timer(b, c, n)
                bar.update()
                return value
            return run

        report = measure.validate(table, {k: counted(t) for k, t in timers.items()}, points)
        bar.close()
        for which, r in report.items():
            print(f"{which}: median error {r['median_ape'] * 100:.1f}%, p90 {r['p90_ape'] * 100:.1f}% "
                  f"over {len(r['points'])} held-out points")
        table.validation = {k: {"median_ape": v["median_ape"], "p90_ape": v["p90_ape"], "points": v["points"],
                                "date": time.strftime("%Y-%m-%d %H:%M")} for k, v in report.items()}
        table.save(args.validate)
        return

    if args.quick:
        batch_sizes, contexts, tokens = [1, 2], [64, 256], measure.token_grid(16)
    else:
        batch_sizes = int_list(args.batch_sizes, "--batch-sizes")
        contexts = int_list(args.contexts, "--contexts")
        tokens = measure.token_grid(args.max_tokens)
    meta = measure.table_meta(target, model, dtype, args.repeats, command_line(),
                       draft_model, draft)
    if draft_model is None and drafter:
        meta["draft"] = {"drafter": drafter, "model": drafter, "device": device_name(torch.device(args.device))}
        if head_source:
            meta["draft"]["source"] = head_source
    measure.measure_table(target, timers, batch_sizes, contexts, tokens, meta, args.repeats).save(args.out)
    print(args.out)
