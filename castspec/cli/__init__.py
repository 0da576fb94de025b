"""Command line: castspec models | generate | explain | serve | bench | bench-serve | bench-combine | bench-index |
demo | tune | profile | train-head | head-vocab | regenerate. One module per command group; each registers its
commands' options and the function that runs them."""

from __future__ import annotations

import argparse
import os
import sys

from castspec.cli import bench, bench_serve, demo, generate, heads, models, profile, serve, tune
from castspec.errors import CastspecError

COMMAND_GROUPS = (models, generate, serve, bench, bench_serve, tune, profile, heads, demo)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="castspec", description=__doc__.split(".")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for group in COMMAND_GROUPS:
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        args.run(args)
    except CastspecError as e:
        print(f"castspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("castspec: interrupted", file=sys.stderr)
        return 130
    return 0
