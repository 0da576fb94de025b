"""castspec serve: one process with continuous batching, or Ray Serve replicas behind one endpoint."""

from __future__ import annotations

import argparse
import sys

from castspec.cli.options import engine_args, engine_options, load_engine, policy_args, trace_path
from castspec.costs.prefill import PREFILL_AT_ONCE, PREFILL_SLACK, prefill_schedule
from castspec.errors import CastspecError

PREFIX_CACHE_GB = 2.0
PREFILL_CHUNK = "auto"  # a chunk sized by time: a fixed count is right on one CPU only (bench/prefix-cache)


def prefill_chunk(text: str) -> int | str:
    """--prefill-chunk's value: 'auto' or a number of tokens >= 0."""
    if text == "auto":
        return text
    try:
        tokens = int(text)
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise argparse.ArgumentTypeError(f"a number of tokens >= 0 or 'auto', got {text!r}")
    return tokens


def register(sub) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible server (continuous batching, streaming, metrics)")
    engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch-size", type=int, default=8, help="rows decoded together at most (default 8)")
    serve.add_argument("--max-waiting", type=int, default=256,
                       help="requests queued for a place in the batch before new ones get 429 (default 256)")
    serve.add_argument("--prefix-cache-gb", type=float, default=PREFIX_CACHE_GB,
                       help="GiB of earlier requests' KV kept so that prompts sharing a prefix with them (later "
                            f"turns of a conversation) prefill only the rest; 0: off (default {PREFIX_CACHE_GB:g})")
    serve.add_argument("--prefill-chunk", type=prefill_chunk, default=PREFILL_CHUNK,
                       help="prompt tokens prefilled per step while other requests decode, so that a long prompt "
                            "joining delays them by a chunk per step; 'auto': as many as keep such a step within "
                            "--prefill-slack decode steps, learnt from the steps' times; 0: a whole prompt at once "
                            f"(default {PREFILL_CHUNK})")
    serve.add_argument("--prefill-slack", type=float, default=PREFILL_SLACK,
                       help="with --prefill-chunk auto: how many decode steps' time a step carrying prompt tokens "
                            "may take, i.e. the running requests' worst gap between tokens "
                            f"(default {PREFILL_SLACK:g})")
    serve.add_argument("--prefill-at-once", type=float, default=PREFILL_AT_ONCE,
                       help="with --prefill-chunk auto: a joining prompt whose prefill costs at most this many decode "
                            "steps goes in one step (a place in the batch waits for no chunks); longer ones by "
                            f"chunks; 0: every prompt by chunks (default {PREFILL_AT_ONCE:g})")
    serve.add_argument("--served-model-name", help="the model name clients send (default: --model as given)")
    policy_args(serve)
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

    serve.set_defaults(run=run_serve)


def run_serve(args) -> None:
    import uvicorn

    from castspec.serve.app import Server, build_app
    from castspec.serve.loop import EngineLoop, in_passing_thread
    from castspec.serve.metrics import ServerMetrics

    for name in ("max_batch_size", "max_waiting"):
        if getattr(args, name) < 1:
            raise CastspecError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.prefix_cache_gb < 0:
        raise CastspecError(f"--prefix-cache-gb must be >= 0 (0: off), got {args.prefix_cache_gb:g}")
    # a bad schedule is refused here in one line, before minutes of loading
    prefill_schedule(args.prefill_chunk, args.prefill_slack, args.prefill_at_once)
    if not 0 < args.port < 65536:
        raise CastspecError(f"--port must be in 1..65535, got {args.port}")
    args.trace = trace_path(args.trace)
    name = args.served_model_name or args.model
    if args.replicas is not None or args.ray_address is not None:
        return _serve_on_ray(args, name)
    def load():  # the engine thread is then the only one with torch's OpenMP workers (in_passing_thread)
        engine = load_engine(args)
        return engine, engine.stepper(args.max_batch_size, args.max_waiting, args.prefix_cache_gb,
                                      args.prefill_chunk, args.prefill_slack, args.prefill_at_once)

    engine, stepper = in_passing_thread(load)
    loop = EngineLoop(stepper, ServerMetrics(name), args.trace)
    server = Server(loop, engine.tokenizer, name, engine.target.max_positions, args.max_waiting)
    joining = {"auto": f"whole when they cost <= {args.prefill_at_once:g} decode steps, else by chunks sized by "
                       f"time (<= {args.prefill_slack:g} decode steps)", 0: "whole"}.get(
        args.prefill_chunk, f"by chunks of {args.prefill_chunk} tokens")
    print(f"castspec: serving {name!r} on http://{args.host}:{args.port}/v1; {engine.choice}"
          + (f" ({engine.policy.describe()})" if engine.policy else "") + f"; prompts join {joining}",
          file=sys.stderr, flush=True)
    uvicorn.run(build_app(server), host=args.host, port=args.port, log_level="warning")


def _serve_on_ray(args, name: str) -> None:
    from castspec.serve.ray_app import ReplicaConfig, ScaleConfig, serve_forever

    if args.replica_cpus <= 0:
        raise CastspecError(f"--replica-cpus must be positive (it is also the replica's torch threads), got "
                            f"{args.replica_cpus}")
    config = ReplicaConfig(engine_options(args), name, args.max_batch_size, args.max_waiting,
                           threads=max(1, int(args.replica_cpus)), trace=args.trace,
                           prefix_cache_gb=args.prefix_cache_gb, prefill_chunk=args.prefill_chunk,
                           prefill_slack=args.prefill_slack, prefill_at_once=args.prefill_at_once)
    replicas = 1 if args.replicas is None else args.replicas  # --ray-address alone: one replica on the cluster
    scale = ScaleConfig(replicas, args.replica_cpus, args.replica_gpus, args.max_ongoing_requests, args.min_replicas,
                        args.max_replicas, args.target_ongoing_requests)
    serve_forever(config, scale, args.host, args.port, args.ray_address,
                  log=lambda line: print(line, file=sys.stderr, flush=True))
