"""Where a server's decode time went, from its step trace (`castspec serve --trace`, e.g. the traces that
`peer_vllm.py --trace-dir` keeps): per batch size, the steps that verified a drafted tree and those that verified
no drafted node (one token a row, as AR does), with their tokens, seconds, tokens per second and seconds per step.
Steps that also prefilled prompt tokens are counted apart (their time is mostly the prompt's).

Read beside the AR server's trace of the same sitting, it separates what a speculative server's trees bought from
what its steps without a tree cost (issue 37: CAST against AR under load).

Run: .venv/bin/python bench/scripts/serve_trace_steps.py TRACE.jsonl [TRACE.jsonl ...]   (prints markdown)"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def step_kinds(path: Path) -> dict[tuple[int, str], list[float]]:
    """(rows, kind) -> [steps, tokens, seconds]; kind: 'tree', 'no tree' or 'with prompt tokens'."""
    totals: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for line in path.read_text().splitlines():
        step = json.loads(line)
        if step["kind"] != "decode":
            continue
        kind = ("with prompt tokens" if step["prompt_tokens"] else
                "tree" if any(step["tree_sizes"]) else "no tree")
        cell = totals[step["batch_size"], kind]
        cell[0] += 1
        cell[1] += sum(step["accepted"])
        cell[2] += step["seconds"]
    return totals


def table(path: Path) -> str:
    lines = [f"`{path.name}`", "", "| rows | steps | count | tokens | seconds | tok/s | s a step |",
             "|---|---|---|---|---|---|---|"]
    for (rows, kind), (count, tokens, seconds) in sorted(step_kinds(path).items()):
        lines.append(f"| {rows} | {kind} | {count} | {tokens} | {seconds:.1f} | {tokens / seconds:.1f} | "
                     f"{seconds / count:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    args = parser.parse_args()
    print("\n\n".join(table(path) for path in args.traces))


if __name__ == "__main__":
    main()
