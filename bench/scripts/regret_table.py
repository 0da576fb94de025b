"""CAST's regret against fixed trees over the same drafter, from one `castspec bench` run (methods interleaved per
prompt, so every ratio is side by side): per drafter and prompt set, CAST's speed-up over the best fixed tree of
that column, and on the mix ('all') over every single fixed tree.

Run: .venv/bin/python bench/scripts/regret_table.py bench/DIR/NAME.json bench/DIR/NAME-regret
(writes NAME-regret.json, .md and .png). The bench run it reads holds, per drafter, chain and EAGLE-2 grids and
`cast:DRAFTER`, e.g. (issue 37's grid, about 30 min on a 2-core CPU):

    M=ar; for d in draft ngram suffix; do for L in 2 3 4 8 16; do M="$M;chain:$d:chain_length=$L"; done
      M="$M;eagle2:$d:top_k=2,depth=3,total_tokens=6;eagle2:$d:top_k=4,depth=4,total_tokens=16;eagle2:$d;cast:$d"
    done
    CASTSPEC_HOME=$(mktemp -d) castspec bench --methods "$M" --sets mtbench,humaneval,gsm8k,repetitive \
        --per-set 1 --max-new-tokens 48 --out-dir bench/regret --name NAME

(an empty home holds no models: link its `models` to the fetched ones first, or let castspec fetch them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from castspec.bench.runner import method_family


def family(method: str) -> tuple[str, str]:
    """('chain' | 'eagle2' | 'cast' | 'ar', drafter) of a method label like 'chain:draft:chain_length=4'."""
    kind, drafter = method_family(method)
    return kind, drafter or ""


def regret(summary: list[dict]) -> dict:
    tasks = list(dict.fromkeys(r["task"] for r in summary))
    drafters = list(dict.fromkeys(family(r["method"])[1] for r in summary if family(r["method"])[0] == "cast"))
    out = {}
    for drafter in drafters:
        columns = {}
        for task in tasks:
            rows = [r for r in summary if r["task"] == task and family(r["method"])[1] == drafter]
            fixed = [r for r in rows if family(r["method"])[0] in ("chain", "eagle2")]
            cast = next(r for r in rows if family(r["method"])[0] == "cast")
            if not fixed:  # no fixed tree over this drafter in the run: nothing to regret against
                break
            best = max(fixed, key=lambda r: r["speedup"])
            columns[task] = {"cast": cast["speedup"], "best_fixed": best["method"],
                             "best_fixed_speedup": best["speedup"],
                             "ratio": round(cast["speedup"] / best["speedup"], 3),
                             "fixed": {r["method"]: r["speedup"] for r in fixed}}
        if columns and len(columns) == len(tasks):
            out[drafter] = columns
    return out


def plot(table: dict, out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafters = list(table)
    tasks = list(next(iter(table.values())))
    fig, ax = plt.subplots(figsize=(8, 3.2))
    width = 0.8 / len(drafters)
    for k, drafter in enumerate(drafters):
        ax.bar([i + k * width for i in range(len(tasks))], [table[drafter][t]["ratio"] for t in tasks], width=width,
               label=f"CAST over {drafter}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(0.97, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks([i + width * (len(drafters) - 1) / 2 for i in range(len(tasks))], tasks)
    ax.set_ylabel("CAST / best fixed tree (same drafter)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)
    plt.close(fig)


def main(source: str, out: str) -> None:
    run = json.loads(Path(source).read_text())
    table = regret(run["summary"])
    meta = run["meta"]
    title = (f"CAST vs the best fixed tree per drafter, {meta.get('machine', '?')}, {meta.get('prompts')} prompts x "
             f"{meta.get('max_new_tokens')} tokens")
    Path(out + ".json").write_text(json.dumps({"source": source, "meta": meta, "regret": table}, indent=1) + "\n")
    tasks = list(next(iter(table.values())))
    lines = [f"# {title}", "", f"From `{source}` ({meta.get('date')}). Cell: CAST's speed-up over AR / the best fixed "
             "tree's over the same drafter in that column (which one below); bar: >= 0.97 per column, and on 'all' "
             "above every single fixed tree.", "",
             "| drafter | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for drafter, columns in table.items():
        lines.append(f"| {drafter} | " + " | ".join(
            f"**{c['ratio']:.2f}** ({c['cast']:.2f}x vs {c['best_fixed_speedup']:.2f}x)" for c in columns.values())
            + " |")
    lines += ["", "Best fixed tree per column:", ""]
    for drafter, columns in table.items():
        lines.append(f"- {drafter}: " + "; ".join(f"{t}: `{c['best_fixed']}`" for t, c in columns.items()))
    Path(out + ".md").write_text("\n".join(lines) + "\n")
    plot(table, out, title)
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
