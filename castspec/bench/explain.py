"""Pictures of CAST's decisions: one step's verified tree (tokens, draft scores, the accepted path) beside the
widths, depth and verify budget the policy chose and the costs behind them; and tree size, depth and accepted
length over a whole generation."""

from __future__ import annotations

from dataclasses import dataclass

from castspec.decode.tree import DraftTree
from castspec.errors import CastspecError


@dataclass
class ExplainedStep:
    tree: DraftTree  # the verified tree (root = the token the step starts from)
    path: list[int]  # accepted nodes, root excluded
    stats: object  # the step's StepStats: timings, context, the policy's DraftRecord


def generate_explained(engine, prompt: str | None = None, messages: list[dict] | None = None,
                       max_new_tokens: int = 64) -> tuple[object, list[ExplainedStep]]:
    """Greedy generation that also keeps every step's verified tree and accepted path."""
    if engine.policy is None:
        raise CastspecError("explain draws draft trees: choose a speculative method, not ar")
    trees: list[tuple[DraftTree, list[int]]] = []
    listen = engine.policy.observe_tree

    def keep(tree: DraftTree, path: list[int], row=None) -> None:  # the policy's own per-row hook sees every tree
        trees.append((tree, list(path)))
        listen(tree, path, row)

    engine.policy.observe_tree = keep
    try:
        generation = engine.generate(prompt, messages, max_new_tokens=max_new_tokens)
    finally:
        del engine.policy.observe_tree
    steps = [ExplainedStep(tree, path, stats) for (tree, path), stats in zip(trees, generation.steps, strict=True)]
    return generation, steps


def _layout(tree: DraftTree) -> dict[int, tuple[float, float]]:
    """x = depth, y = leaf order (a parent sits at the mean of its children), so paths read left to right."""
    parents = tree.parents.tolist()
    children: dict[int, list[int]] = {i: [] for i in range(len(parents))}
    for node, parent in enumerate(parents[1:], start=1):
        children[parent].append(node)
    for kids in children.values():
        kids.sort(key=lambda n: -float(tree.scores[n]))
    where: dict[int, tuple[float, float]] = {}
    next_leaf = [0.0]

    def place(node: int) -> float:
        kids = children[node]
        if kids:
            y = sum(place(k) for k in kids) / len(kids)
        else:
            y, next_leaf[0] = next_leaf[0], next_leaf[0] + 1
        where[node] = (float(tree.depths[node]), -y)
        return y

    place(0)
    return where


def _token_text(tokenizer, token: int) -> str:
    text = tokenizer.decode([token]).replace("\n", "\\n")
    return repr(text)[1:-1][:12] or "''"


def _decision_lines(record) -> list[str]:
    lines = [f"drafted per layer: {record.layer_sizes}", f"expanded per layer: {record.widths}",
             f"verify budget: {record.verify_budget} nodes"]
    for layer in record.decisions.get("layers", []):
        costs = layer.get("costs") or []
        line = (f"layer {layer['layer']}: width {layer.get('width')} of {layer.get('candidates')}"
                + (f", c1 {layer['c1']:.2f}" if "c1" in layer else "")
                + (f", cost ratio {costs[0]:.3f}" if costs else "")
                + (f", depth value {layer['depth_value']:.2f} vs c2 {layer['c2']:.2f}" if "depth_value" in layer
                   else ""))
        if layer.get("stop"):
            line += f" (stop: {layer['stop']})"
        lines.append(line)
    decisions = record.decisions
    if "c3" in decisions:
        lines.append(f"verify threshold c3 {decisions['c3']:.2f}")
    utilities, costs = decisions.get("verify_utilities") or [], decisions.get("verify_costs") or []
    if utilities and costs:
        lines.append("verify k nodes: utility / cost (in AR steps)")
        pairs = list(zip(utilities, costs, strict=False))[:12]
        lines += [f"  k={k}: {u:.2f} / {c:.2f}" for k, (u, c) in enumerate(pairs, start=1)]
    if "drafting_payoff" in decisions:
        lines.append(f"drafting payoff lately: {decisions['drafting_payoff']:.2f}")
    timing = decisions.get("timing") or {}
    if "verify_predicted_s" in timing:
        lines.append(f"verify predicted {1000 * timing['verify_predicted_s']:.0f} ms, took "
                     f"{1000 * timing['verify_s']:.0f} ms")
    return lines


def draw_step(step: ExplainedStep, tokenizer, out: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tree, accepted = step.tree, {0, *step.path}
    where = _layout(tree)
    lines = _decision_lines(step.stats.draft)
    height = max(4.0, 0.45 * (1 - min(y for _, y in where.values())) + 1.5, 0.17 * (len(lines) + 4) + 1)
    fig, (ax, notes) = plt.subplots(1, 2, figsize=(15, height), gridspec_kw={"width_ratios": [2.2, 1]})
    for node in range(1, len(tree)):
        parent = int(tree.parents[node])
        (x0, y0), (x1, y1) = where[parent], where[node]
        on_path = node in accepted and parent in accepted
        ax.plot([x0, x1], [y0, y1], color="#2a9d5c" if on_path else "#b8b8b8", lw=2.4 if on_path else 1, zorder=1)
    for node, (x, y) in where.items():
        colour = "#2a9d5c" if node in accepted else "#e8e8e8"
        label = _token_text(tokenizer, int(tree.tokens[node]))
        score = "(root)" if node == 0 else f"{float(tree.scores[node]):.2f}"
        ax.annotate(f"{label}\n{score}", (x, y), ha="center", va="center", fontsize=8, zorder=2,
                    color="white" if node in accepted else "black",
                    bbox={"boxstyle": "round,pad=0.3", "fc": colour, "ec": "#666666", "lw": 0.6})
    ax.set_xlabel("depth (layer of drafted nodes)")
    ax.set_yticks([])
    ax.set_xlim(-0.5, max(x for x, _ in where.values()) + 0.5)
    ax.set_ylim(min(y for _, y in where.values()) - 0.7, 0.7)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"{len(tree) - 1} verified nodes (token, draft score); accepted path in green: "
                 f"{len(step.path)} drafted + 1 bonus token", fontsize=10)
    notes.axis("off")
    stats = step.stats
    notes.text(0, 1, "\n".join([f"context {stats.context_length} tokens, batch {stats.batch_size}",
                                f"draft {1000 * stats.draft_s:.0f} ms, verify {1000 * stats.verify_s:.0f} ms", "",
                                *lines]), va="top", family="monospace", fontsize=8, transform=notes.transAxes)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def draw_generation(steps: list[ExplainedStep], out: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numbers = list(range(len(steps)))
    fig, axes = plt.subplots(3, 1, figsize=(10, 6.5), sharex=True)
    series = [("verified nodes", [len(s.tree) - 1 for s in steps]),
              ("tree depth", [int(s.tree.depths.max()) for s in steps]),
              ("tokens accepted (tau)", [len(s.path) + 1 for s in steps])]
    for ax, (label, values) in zip(axes, series, strict=True):
        ax.bar(numbers, values, color="#3b6ea8")
        ax.set_ylabel(label, fontsize=9)
        mean = sum(values) / max(len(values), 1)
        ax.axhline(mean, color="#c0392b", lw=1, ls="--")
        ax.text(1.0, mean, f" mean {mean:.2f}", transform=ax.get_yaxis_transform(), va="center", fontsize=8)
    axes[-1].set_xlabel("step")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def pick_step(steps: list[ExplainedStep], step: int | None) -> int:
    """The step asked for, or the one with the largest verified tree (the most to explain)."""
    if not steps:
        raise CastspecError("the generation ended at its first token: nothing was drafted")
    if step is None:
        return max(range(len(steps)), key=lambda i: (len(steps[i].tree), len(steps[i].path)))
    if not 0 <= step < len(steps):
        raise CastspecError(f"--step {step} is not a step of this generation (it has steps 0..{len(steps) - 1})")
    return step
