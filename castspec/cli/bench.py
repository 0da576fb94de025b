"""castspec bench | bench-combine | bench-index: methods side by side on the same prompts (per prompt, batched, or
the host overhead per step on random models), tables from several runs, and the index of bench/."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from castspec.cli.demo import DEMO_METHODS
from castspec.cli.options import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    command_line,
    forward_args,
    int_list,
    load_pair,
    prompt_rows,
    sampling_args,
    sampling_params,
    wants_compile,
)
from castspec.errors import CastspecError


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmark methods side by side (Spec-Bench protocol)")
    bench.add_argument("--model", default=DEFAULT_TARGET)
    bench.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model ('none': no draft model)")
    bench.add_argument("--head", help="EAGLE head for the methods whose drafter is 'head'")
    bench.add_argument("--methods", default=None,
                       help="';'-separated METHOD[:draft|ngram|head|draft+ngram|head+ngram][:k=v,...] items, plus "
                            "hf-assisted, hf-prompt-lookup; ngram items also take max_n and min_n (the n-gram "
                            "sizes looked up); X+ngram merges n-gram proposals into X's trees")
    bench.add_argument("--sets", default="mtbench,humaneval,gsm8k")
    bench.add_argument("--per-set", type=int, default=4, help="prompts taken from each set")
    bench.add_argument("--offset", type=int, default=0, help="skip this many prompts of each set (tuning splits)")
    bench.add_argument("--limit", type=int, default=0, help="keep at most this many prompts in all (0: no limit)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--dtype", default=None, help="bf16 | fp32 | fp16 (default bf16; --overhead: fp32 on a CPU, "
                                                      "where bf16 would time conversions, bf16 on a GPU)")
    forward_args(bench)
    bench.add_argument("--out-dir", default="bench")
    bench.add_argument("--name", default="bench")
    bench.add_argument("--resume", action="store_true",
                       help="continue an interrupted run of the same --name: prompts finished with every method "
                            "are kept (from NAME.partial.jsonl), the rest are run")
    bench.add_argument("--rounds", type=int, default=1,
                       help="run every prompt's methods this many times, every other round in reverse order; "
                            "tokens/s per prompt and method is the median over the rounds (a shared CPU's speed "
                            "drifts by tens of percent within minutes); --resume can add rounds to a finished run")
    bench.add_argument("--batch-sizes", help="throughput mode: decode in batches of each size, e.g. 1,2,4,8 "
                                             "(speed-up over batched AR per batch size)")
    bench.add_argument("--overhead", action="store_true",
                       help="host overhead per step: random-weight models made on the fly (no download), per method "
                            "and batch size the time in target and drafter forwards and the host's bookkeeping by "
                            "phase, HF greedy and assisted beside (default methods: chain, EAGLE-2 16 and 60 "
                            "nodes from a draft model and a head, CAST; default --batch-sizes 1,8)")
    bench.add_argument("--overhead-size", default="tiny", help="random model size for --overhead: tiny (2 layers, "
                                                               "64 wide), small, or 8b (Llama-3-8B geometry, GPU)")
    bench.add_argument("--device", default="cpu", help="device for --overhead (cpu, cuda)")
    sampling_args(bench)

    bench.set_defaults(run=run_bench)

    index = sub.add_parser("bench-index", help="regenerate bench/README.md (the index of every study and run) "
                                               "from the runs' JSON files")
    index.add_argument("--bench-dir", default="bench")
    index.set_defaults(run=run_bench_index)
    combine = sub.add_parser("bench-combine", help="one table and plot from benchmark runs on the same prompts, "
                                                   "each method over its own run's AR")
    combine.add_argument("runs", nargs="+", help="finished runs' JSON files (bench/NAME.json)")
    combine.add_argument("--out-dir", default="bench")
    combine.add_argument("--name", required=True)
    combine.add_argument("--title", help="plot and page title (default: the runs' model and prompt count)")

    combine.set_defaults(run=run_bench_combine)


def run_bench(args) -> None:
    from castspec.bench.runner import RunFiles, parse_methods, run_benchmark, save_results
    from castspec.costs.table import machine_label

    if args.overhead:
        run_bench_overhead(args)
        return
    if args.rounds < 1:
        raise CastspecError(f"--rounds must be at least 1 (got {args.rounds})")
    if args.rounds > 1 and args.batch_sizes:
        raise CastspecError("--rounds repeats the per-prompt benchmark; the throughput mode (--batch-sizes) runs once")
    args.methods, args.dtype = args.methods or DEMO_METHODS, args.dtype or "bf16"
    specs = parse_methods(args.methods)
    sampling = sampling_params(args)
    if not sampling.greedy and sampling.seed is None:
        sampling = dataclasses.replace(sampling, seed=0)  # every method draws from the same seed per prompt
    args.compile = wants_compile(args)  # the settings say what ran
    keys = ("model", "draft", "head", "methods", "max_new_tokens", "dtype", "prepack", "compile", "temperature",
            "top_p", "sample_top_k", "seed", "draft_sampling")
    settings = {k: getattr(args, k) for k in keys}
    # sittings on another kind of machine would mix speeds that do not compare (a CPU with native bf16 runs 3x faster)
    settings["machine"] = machine_label()
    files = RunFiles(Path(args.out_dir), args.name)
    if args.resume:
        if args.batch_sizes:
            raise CastspecError("--resume continues a per-prompt benchmark; the throughput mode starts afresh")
        files.resume(settings)
    if args.batch_sizes:
        if not sampling.greedy:
            raise CastspecError("the throughput mode measures greedy decoding; leave out --temperature")
        sizes = int_list(args.batch_sizes, "--batch-sizes")
    target, tokenizer, draft = load_pair(args.model, args.draft, args.dtype, args.prepack, args.compile)
    head = None
    if args.head:
        from castspec.drafters.eagle_head import load_eagle_head

        head = (load_eagle_head(args.head, target), args.head)
    prompts = prompt_rows(args.sets, args.per_set, args.offset)
    if args.limit > 0:
        prompts = prompts[: args.limit]
    if not args.resume:
        files.start(settings)
    command = command_line()
    if args.batch_sizes:
        from castspec.bench.runner import run_throughput, throughput_table

        result = run_throughput(target, tokenizer, draft, specs, prompts, args.max_new_tokens, sizes, files.partial,
                                head)
        files.clear()
        title = (f"{args.model} ({args.dtype}), draft {args.draft}{f', head {args.head}' if args.head else ''}, "
                 f"{len(prompts)} prompts, "
                 f"{args.max_new_tokens} new tokens, batched")
        save_results(result, Path(args.out_dir), args.name, command, title, throughput=True)
        print(throughput_table(result["summary"]))
        print(f"results: {Path(args.out_dir) / args.name}.json / .md / .png")
        return
    result = run_benchmark(target, tokenizer, draft, specs, prompts, args.max_new_tokens, partial=files.partial,
                           sampling=sampling, draft_sampling=args.draft_sampling, head=head, resume=args.resume,
                           rounds=args.rounds)
    result["meta"]["settings"] = settings
    files.clear()
    title = (f"{args.model} ({args.dtype}), draft {args.draft}{f', head {args.head}' if args.head else ''}, "
             f"{len(prompts)} prompts, {args.max_new_tokens} new tokens")
    if not sampling.greedy:
        title += f", T={sampling.temperature:g}"
    save_results(result, Path(args.out_dir), args.name, command, title)
    from castspec.bench.runner import markdown_table

    print(markdown_table(result["summary"]))
    print(f"results: {Path(args.out_dir) / args.name}.json / .md / .png")


def run_bench_overhead(args) -> None:
    import torch

    from castspec.bench.overhead import DEFAULT_METHODS, overhead_table, plot_overhead, random_models, run_overhead
    from castspec.bench.runner import parse_methods
    from castspec.costs.table import machine_label
    from castspec.models import DTYPES

    specs = parse_methods(args.methods or DEFAULT_METHODS)
    sizes = int_list(args.batch_sizes or "1,8", "--batch-sizes")
    if args.dtype is not None and args.dtype not in DTYPES:
        raise CastspecError(f"unknown dtype {args.dtype!r}; choose from {', '.join(DTYPES)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CastspecError(f"--device {args.device}: no CUDA device is available here")
    dtype = DTYPES[args.dtype or ("fp32" if args.device == "cpu" else "bf16")]
    models = random_models(args.overhead_size, args.device, dtype)
    if wants_compile(args):  # the path a server runs (its compile time said in one line)
        from castspec.decode.compiled import compile_target

        compile_target(models.target, print)
    result = run_overhead(models, specs, sizes, max_new_tokens=args.max_new_tokens, progress=print)
    result["meta"]["machine"] = machine_label()
    command = command_line()
    result["meta"]["command"] = command
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    table = overhead_table(result["rows"])
    meta = result["meta"]
    title = (f"host overhead per step: random {meta['size']} models, {meta['dtype']} on {meta['device']}, "
             f"target {'compiled' if meta['compiled'] else 'eager'} "
             f"({meta['machine']}), {meta['prompts']} prompts x {meta['max_new_tokens']} tokens, {meta['date']}")
    (out / f"{args.name}.md").write_text(
        f"# {title}\n\n`{command}`\n\nms per decoding step (HF rows: per target forward). host = wall - target "
        "forwards - drafter forwards; the phase columns split it (draft: pools, drafter inputs and masks; verify: "
        "tree masks, positions, logits; accept; outputs: stop checks, text; policy: CAST's observations and the "
        "online cost model; commit: the KV commit).\n\n" + table + "\n")
    plot_overhead(result["rows"], out / f"{args.name}.png", title)
    print(table)
    print(f"results: {out / args.name}.json / .md / .png")


def run_bench_combine(args) -> None:
    from castspec.bench.runner import combine_runs, save_combined, wide_table

    results = []
    for path in map(Path, args.runs):
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise CastspecError(f"cannot read benchmark run {path}: {e}") from e
        if not isinstance(results[-1], dict) or "rows" not in results[-1] or "meta" not in results[-1]:
            raise CastspecError(f"{path} is not a finished benchmark run (no rows/meta)")
    names = [Path(p).stem for p in args.runs]
    combined = combine_runs(results, names)
    m = combined["meta"]
    title = args.title or (f"{m.get('settings', {}).get('model', 'target')} ({m.get('settings', {}).get('dtype', '')}),"
                           f" {m['prompts']} prompts, {m['max_new_tokens']} new tokens, {len(names)} runs")
    command = command_line()
    save_combined(combined, Path(args.out_dir), args.name, command, title)
    print(wide_table(combined["summary"]))
    print(f"results: {Path(args.out_dir) / args.name}.json / .md / .png")


def run_bench_index(args) -> None:
    from castspec.bench.index import write_index

    bench = Path(args.bench_dir)
    if not bench.is_dir():
        raise CastspecError(f"{bench} is not a directory")
    try:
        print(write_index(bench))
    except (ValueError, json.JSONDecodeError) as e:
        raise CastspecError(f"bench index: {e}") from e
