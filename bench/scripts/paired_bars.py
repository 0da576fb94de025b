"""The plot of a before / after forward study: per case, two bars of ms per forward, the ratio written above."""

from __future__ import annotations

from pathlib import Path


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
