"""Host bookkeeping before and after a change, on one machine in one sitting (issue 38: host <= 1 ms per step for
a 16-node tree at B = 1).

Two measurements, each run for the code at BASE (a git worktree made for it) and for the working tree, in
alternating order:
  1. `castspec bench --overhead` (random tiny models, the target compiled) in ROUNDS interleaved rounds; per method
     and batch size the median host ms per step and of its draft and verify phases. A 2-core shared machine moves
     these by +-20% from one run to the next, so the rounds alternate and the medians are compared.
  2. A microbenchmark of the two pieces of host work every step does: packing the verify forward
     (`ragged.plan`, at 1 and 16 nodes a row) and growing a 4-layer draft tree (`_add_layers`, 4 wide, top-4),
     at B = 1 and 8: no model forward in it, so it reads the same run after run.

Writes NAME.json (every row of every round, the microbenchmark), NAME.md and NAME.png.

Run: .venv/bin/python bench/scripts/overhead_ab.py BASE bench/overhead/NAME [--rounds 3]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
METHODS = ("ar;eagle2:draft:top_k=4,depth=4,total_tokens=16;eagle2:head:top_k=4,depth=4,total_tokens=16;"
           "cast:ngram")

MICRO = r'''
import json, random, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from castspec.decode import ragged
from castspec.decode.drafting import _add_layers, _Pool
from castspec.decode.tree import DraftTree
from castspec.drafters.base import Candidates

torch.set_num_threads(2)
model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2))
random.seed(0)
torch.manual_seed(0)

def tree(n):
    parents = [-1] + [random.randint(max(0, i - 4), i - 1) for i in range(1, n)]
    return DraftTree.from_lists(list(range(n)), parents, [1.0] * n)

def draft_layers(rows):
    pools = [_Pool(5) for _ in range(rows)]
    first = [Candidates(torch.tensor([[1, 2, 3, 4]]), torch.tensor([[0.5, 0.2, 0.1, 0.05]])) for _ in range(rows)]
    nodes, _ = _add_layers(pools, [[0]] * rows, first, None, 1)
    for layer in (2, 3, 4):
        cands = [Candidates(torch.randint(0, 100, (4, 4)), torch.rand(4, 4)) for _ in range(rows)]
        nodes, _ = _add_layers(pools, [n[:4] for n in nodes], cands, None, layer)

def timed(call, repeats):
    for _ in range(repeats // 20):
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return 1000 * (time.perf_counter() - start) / repeats

out = {}
for rows in (1, 8):
    for nodes in (1, 16):
        cache = ragged.SlotCache(model)
        cache.ensure(rows, 256)
        cache.fill = [100 + 3 * b for b in range(rows)]
        trees = [(b, tree(nodes)) for b in range(rows)]
        out[f"verify inputs (ragged.plan), B={rows}, {nodes} node(s) a row"] = timed(
            lambda: ragged.plan(cache, trees, [], torch.device("cpu")), 2000)
    out[f"4 draft layers (_add_layers, 4 wide, top-4), B={rows}"] = timed(lambda: draft_layers(rows), 500)
print(json.dumps(out))
'''


def run(code: Path, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=code, env={**os.environ, "PYTHONPATH": str(code)},
                          capture_output=True, text=True, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", help="git revision before the change")
    parser.add_argument("out", type=Path, help="bench/overhead/NAME (NAME.json / .md / .png are written)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from castspec.costs.table import machine_label

    scratch = Path(tempfile.mkdtemp(prefix="overhead-ab-"))
    base = scratch / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base), args.base], check=True)
    codes = {"before": base, "after": ROOT}
    rounds: list[dict] = []
    micro: dict[str, dict] = {}
    started = time.strftime("%Y-%m-%d %H:%M")
    try:
        for r in range(args.rounds):
            for label in (("before", "after") if r % 2 == 0 else ("after", "before")):
                name = f"{label}-r{r + 1}"
                run(codes[label], ["-m", "castspec.cli", "bench", "--overhead", "--methods", METHODS,
                                   "--batch-sizes", "1,8", "--max-new-tokens", "48", "--out-dir", str(scratch),
                                   "--name", name])
                rows = json.loads((scratch / f"{name}.json").read_text())["rows"]
                rounds.append({"code": label, "round": r + 1, "rows": rows})
                print(f"round {r + 1} {label}: done {time.strftime('%H:%M:%S')}", flush=True)
        for label in ("before", "after"):
            micro[label] = json.loads(run(codes[label], ["-c", MICRO]).stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)

    summary = []
    keys = sorted({(row["method"], row["batch_size"]) for rnd in rounds for row in rnd["rows"]
                   if row.get("host_phase_ms")}, key=lambda k: (k[1], k[0] != "ar", k[0]))
    for method, batch in keys:
        entry = {"method": method, "batch_size": batch}
        for label in ("before", "after"):
            rows = [row for rnd in rounds if rnd["code"] == label for row in rnd["rows"]
                    if row["method"] == method and row["batch_size"] == batch]
            entry[label] = {"host_ms": statistics.median(r["host_ms"] for r in rows),
                            "draft_ms": statistics.median(r["host_phase_ms"]["draft"] for r in rows),
                            "verify_ms": statistics.median(r["host_phase_ms"]["verify"] for r in rows),
                            "nodes": statistics.median(r["tree_nodes"] for r in rows),
                            "same_as_ar": all(r["same_as_ar"] in (True, None) for r in rows)}
        summary.append(entry)
    meta = {"machine": machine_label(), "base": args.base, "head": subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "rounds": args.rounds, "date": started, "command": " ".join(sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "micro": micro,
                                                         "rounds": rounds}, indent=1))
    lines = [f"# host bookkeeping before ({args.base}) and after: {meta['machine']}, {started}", "",
             f"`{meta['command']}`", "",
             f"## `castspec bench --overhead` (random tiny models, target compiled), median of {args.rounds} "
             "interleaved rounds", "",
             "| method | B | nodes | host ms before | host ms after | after / before | draft phase before / after "
             "| verify phase before / after | outputs = AR |", "|---|---|---|---|---|---|---|---|---|"]
    for e in summary:
        b, a = e["before"], e["after"]
        lines.append(f"| {e['method']} | {e['batch_size']} | {a['nodes']:.1f} | {b['host_ms']:.2f} | "
                     f"**{a['host_ms']:.2f}** | {a['host_ms'] / b['host_ms']:.2f} | {b['draft_ms']:.2f} / "
                     f"{a['draft_ms']:.2f} | {b['verify_ms']:.2f} / {a['verify_ms']:.2f} | "
                     f"{'yes' if a['same_as_ar'] and b['same_as_ar'] else 'NO'} |")
    lines += ["", "## Microbenchmark (no forward; ms a call)", "", "| piece | before | after | after / before |",
              "|---|---|---|---|"]
    for piece, before in micro["before"].items():
        after = micro["after"][piece]
        lines.append(f"| {piece} | {before:.3f} | **{after:.3f}** | {after / before:.2f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    labels = [f"{e['method'].split(':top_k')[0]}{' 16' if 'top_k' in e['method'] else ''} B={e['batch_size']}"
              for e in summary]
    x = range(len(summary))
    for offset, label, colour in ((-0.2, "before", "#999999"), (0.2, "after", "#2b7bba")):
        axes[0].bar([i + offset for i in x], [e[label]["host_ms"] for e in summary], 0.4, label=label, color=colour)
    axes[0].axhline(1.0, color="#c0392b", lw=1, ls="--", label="issue 38 bar (1 ms, 16 nodes, B=1)")
    axes[0].set_xticks(list(x), labels, rotation=30, ha="right", fontsize=8)
    axes[0].set_ylabel("host ms per step (median of rounds)")
    axes[0].set_title("castspec bench --overhead")
    axes[0].legend(fontsize=8)
    pieces = list(micro["before"])
    for offset, label, colour in ((-0.2, "before", "#999999"), (0.2, "after", "#2b7bba")):
        axes[1].barh([i + offset for i in range(len(pieces))], [micro[label][p] for p in pieces], 0.4, label=label,
                     color=colour)
    axes[1].set_yticks(range(len(pieces)), [p.replace(" (", "\n(") for p in pieces], fontsize=7)
    axes[1].set_xlabel("ms a call")
    axes[1].set_title("microbenchmark: verify inputs and draft layers")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"host bookkeeping, {meta['machine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=110)
    print(f"results: {args.out}.json / .md / .png")


if __name__ == "__main__":
    main()
