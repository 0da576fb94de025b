"""What the commands share: the engine, tree-policy and sampling options, prompt sets, model pairs, the
command line as results record it."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from castspec.errors import CastspecError

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


def policy_args(p: argparse.ArgumentParser) -> None:
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
                   help="cast: thresholds from the goodput of recent steps (auto) or fixed C1/C2/C3 (paper)")
    g.add_argument("--cast-c1", type=float, default=4.0, help="cast paper mode: breadth threshold")
    g.add_argument("--cast-c2", type=float, default=3.0, help="cast paper mode: depth threshold")
    g.add_argument("--cast-c3", type=float, default=2.5, help="cast paper mode: verify threshold")
    g.add_argument("--cast-calibration", choices=["on", "off"],
                   help="cast: learn P(accepted | draft score) from the verified trees and use it as the utility "
                        "(for drafters whose scores are not probabilities of acceptance; default: on for the "
                        "n-gram and suffix drafters, off otherwise)")
    g.add_argument("--cast-payoff", choices=["on", "off"],
                   help="cast: draft only while drafting has paid lately, priced by the cost table (default: on in "
                        "auto mode or with calibration, off in paper mode)")
    g.add_argument("--cast-r", type=int, default=8, help="cast: depth-ratio FIFO size R")
    g.add_argument("--cast-max-depth", type=int,
                   help="cast: hard maximum depth (default 8; 24 over the suffix drafter, whose layers cost "
                        "microseconds)")
    g.add_argument("--trace", help="write each step's tree decisions to this JSONL file")


def engine_args(p: argparse.ArgumentParser) -> None:
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
    forward_args(p)


def forward_args(p: argparse.ArgumentParser) -> None:
    """How the models' forwards run: weights pre-packed, the target's decode forward compiled."""
    p.add_argument("--no-prepack", dest="prepack", action="store_false",
                   help="keep bf16 / fp16 linear weights in their loaded layout (by default they are reordered once "
                        "for the CPU's matrix units, which streams them faster; fp32 is never reordered)")
    p.add_argument("--no-compile", dest="compile", action="store_const", const=False, default=None,
                   help="run the target's eager forward (by default its decode forward is compiled once per "
                        "process with torch.compile; CASTSPEC_COMPILE=0 makes this the default)")


def wants_compile(args) -> bool:
    """--no-compile, else on unless CASTSPEC_COMPILE=0 (the test suite sets it: each test process would compile
    its models again)."""
    return args.compile if args.compile is not None else os.environ.get("CASTSPEC_COMPILE", "1") != "0"


def engine_options(args) -> dict:
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
                prepack=args.prepack, compile=wants_compile(args), cost_table=args.cost_table,
                force_table=args.force_table, cost_model=args.cost_model, **options)


def load_engine(args):
    """The Engine the generate and serve commands share, from their engine and policy arguments."""
    from castspec.api import Engine

    return Engine.load(**engine_options(args))


def trace_path(path: str | None) -> str | None:
    """A --trace file that can be written, its folder made if missing; refused in one line before the slow model
    load (a missing folder used to end a server's start-up, minutes in, with a traceback)."""
    if path is None:
        return None
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "a"):
            pass
    except OSError as e:
        raise CastspecError(f"--trace {path}: cannot write there ({e.strerror or e})") from None
    return str(target)


def sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (default: greedy)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    g.add_argument("--sample-top-k", type=int, default=0,
                   help="sample among the k most likely tokens (0 = all; --top-k is the eagle2 tree option)")
    g.add_argument("--seed", type=int, help="random seed: the same seed repeats the same output")
    g.add_argument("--draft-sampling", choices=["topk", "sample"], default="topk",
                   help="drafter proposes its top-k (default) or draws candidates from its own distribution")


def sampling_params(args):
    from castspec.decode.sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_p, args.sample_top_k, args.seed)


def load_pair(model: str, draft: str | None, dtype: str, prepack: bool = True, compile: bool = False):
    from castspec.drafters.draft_model import check_compatible
    from castspec.models import load_model

    target, tokenizer = load_model(model, dtype, prepack=prepack, compile=compile)
    if draft in (None, "", "none"):
        return target, tokenizer, None
    draft_model, draft_tokenizer = load_model(draft, dtype, prepack=prepack)
    check_compatible(target, tokenizer, draft_model, draft_tokenizer)
    return target, tokenizer, draft_model


def prompt_rows(sets: str, per_set: int, offset: int) -> list[dict]:
    from castspec.bench.prompts import load_prompt_set

    per_name = [load_prompt_set(name)[offset: offset + per_set] for name in filter(None, sets.split(","))]
    # interleaved, so that a --limit keeps the sets balanced
    return [rows[i] for i in range(per_set) for rows in per_name if i < len(rows)]


def int_list(text: str, what: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError as e:
        raise CastspecError(f"{what} must be comma-separated integers, got {text!r}") from e
    if not values or values[0] < 1:
        raise CastspecError(f"{what} must be positive integers, got {text!r}")
    return values


def command_line() -> str:
    """This invocation as results record it, quoted so that it can be pasted back."""
    return "castspec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
