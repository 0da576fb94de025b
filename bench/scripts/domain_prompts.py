"""Training prompts from the benchmark's own task families, disjoint from every benchmark run.

`castspec bench` takes the first `--per-set` prompts of each set (at most 20 so far) and the replay tunes take
prompts 40 and on; this writes prompts `--offset` (default 40) and on of MT-bench, HumanEval and GSM8K as a JSONL
of {"id", "messages"} lines that `castspec regenerate --data FILE` answers with the target. `--copies K` writes
each prompt K times (ids differ), so that a sampled regeneration (`--temperature`) gives K different answers.

    .venv/bin/python bench/scripts/domain_prompts.py --offset 40 --out ~/.cache/castspec/data/domain-prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from castspec.bench.prompts import PROMPT_SETS, load_prompt_set


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offset", type=int, default=40, help="skip this many prompts of each set (default 40)")
    parser.add_argument("--copies", type=int, default=1, help="write each prompt this many times")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.offset < 20 or args.copies < 1:
        parser.error("--offset must be at least 20 (the benchmark runs use the first 20 of each set); --copies >= 1")
    rows = [row for name in PROMPT_SETS for row in load_prompt_set(name)[args.offset:]]
    out = Path(args.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as sink:
        for copy in range(args.copies):
            for row in rows:
                sink.write(json.dumps({"id": f"{row['id']}#{copy}", "messages": row["messages"]}) + "\n")
    counts = {name: sum(r["task"] == name for r in rows) for name in PROMPT_SETS}
    print(f"{len(rows) * args.copies} prompts ({counts}, x{args.copies}) -> {out}")


if __name__ == "__main__":
    main()
