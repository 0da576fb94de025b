"""A before / after forward study's summary: per case, the medians of both sides and of the per-pair ratios (its
table rows), and the plot: two bars of ms per forward, the ratio written above."""

from __future__ import annotations

import statistics
from pathlib import Path


def paired_rows(samples: dict[str, dict[str, list[float]]], before: str, after: str) -> list[dict]:
    """One row per case of `samples` (case -> side -> seconds of alternated steps): ms medians of both sides,
    the median of before / after over the pairs, and how many pairs `after` won."""
    rows = []
    for case, s in samples.items():
        ratios = [b / a for b, a in zip(s[before], s[after], strict=True)]
        rows.append({"case": case, f"{before}_ms": round(1000 * statistics.median(s[before]), 1),
                     f"{after}_ms": round(1000 * statistics.median(s[after]), 1),
                     f"{before}_over_{after}": round(statistics.median(ratios), 3),
                     f"pairs_{after}_faster": f"{sum(r > 1 for r in ratios)}/{len(ratios)}"})
    return rows


def paired_table(rows: list[dict], before: str, after: str, labels: tuple[str, str]) -> list[str]:
    """The markdown table of `paired_rows`, the sides named by `labels`."""
    return [f"| case | {labels[0]} ms | {labels[1]} ms | {labels[0]} / {labels[1]} (median of pairs) | "
            f"pairs {labels[1]} faster |", "|---|---|---|---|---|",
            *[f"| {r['case']} | {r[f'{before}_ms']} | {r[f'{after}_ms']} | {r[f'{before}_over_{after}']:.3f}x | "
              f"{r[f'pairs_{after}_faster']} |" for r in rows]]


def paired_bars(rows: list[dict], keys: tuple[str, str], labels: tuple[str, str], ratio_key: str | None,
                path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(rows))
    for shift, key, label in ((-0.2, keys[0], labels[0]), (0.2, keys[1], labels[1])):
        ax.bar([i + shift for i in x], [r[key] for r in rows], 0.4, label=label)
    if ratio_key:
        for i, r in enumerate(rows):
            ax.text(i, max(r[keys[0]], r[keys[1]]), f"{r[ratio_key]:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [r["case"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("ms per forward (median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
