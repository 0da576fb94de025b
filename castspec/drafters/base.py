"""The drafter interface: everything the tree-growing loop needs from a drafter, nothing more."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from castspec.tree import DraftTree


@dataclass(frozen=True)
class Candidates:
    """The best children proposed for each expanded node: row i belongs to the i-th node of the frontier.
    A probability of 0 marks an empty slot (an n-gram drafter may have fewer than k proposals)."""

    tokens: torch.Tensor  # [F, k] int64
    probs: torch.Tensor  # [F, k] float32, rows sorted in decreasing order


def top_candidates(logits: torch.Tensor, k: int) -> Candidates:
    probs = torch.softmax(logits.float(), dim=-1)
    top = probs.topk(min(k, probs.shape[-1]), dim=-1)
    return Candidates(top.indices, top.values)


class Drafter(ABC):
    """A drafter follows one sequence. Per decoding step the loop calls `begin` once with the tokens accepted
    since the previous step (the last of them is the new root), then `expand` once per further draft layer,
    then `end_step`, after which the drafter holds no trace of the rejected tree."""

    name: str = "drafter"

    @abstractmethod
    def reset(self) -> None:
        """Forget the sequence: the next `begin` receives the whole prompt."""

    @abstractmethod
    def begin(self, new_tokens: list[int], top_k: int) -> Candidates:
        """Absorb the newly accepted tokens and propose the root's children (one row)."""

    @abstractmethod
    def expand(self, pool: DraftTree, frontier: list[int], top_k: int) -> Candidates:
        """Propose children for the `frontier` nodes of `pool` (one row each, in frontier order)."""

    def end_step(self) -> None:  # noqa: B027 - stateless drafters need nothing here
        """Drop whatever the drafter kept of the current tree."""
