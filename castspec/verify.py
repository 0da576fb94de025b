"""Verification: which drafted nodes the target accepts. Pure tensor code, no model."""

from __future__ import annotations

import torch

from castspec.tree import DraftTree


def greedy_accept(tree: DraftTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Walk down from the root, each time into the child holding the target's argmax at the current node.

    Returns the accepted path (node indices, root excluded) and the bonus token: the target's argmax at the
    last accepted node. Emitting path tokens + bonus is exactly what greedy decoding would emit."""
    choice = target_logits.argmax(dim=-1).tolist()
    child_of: dict[tuple[int, int], int] = {}
    for node, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True)):
        if node > 0:
            child_of.setdefault((parent, token), node)
    path, node = [], 0
    while (node, choice[node]) in child_of:
        node = child_of[(node, choice[node])]
        path.append(node)
    return path, choice[node]
