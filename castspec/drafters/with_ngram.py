"""A model drafter (draft model or EAGLE head) with a model-free drafter's proposals (n-gram or suffix tree)
merged in.

Where the output copies its input (code rewritten from the prompt, quoted text), the model-free index proposes
the copied continuation at no cost, often further than a small drafter would trust its own guess; elsewhere it
proposes nothing and the model drafter's tree is unchanged. Both drafters see every node of the tree: the
model drafter runs its forward over the whole frontier, n-gram nodes included, so their subtrees get its
proposals too. A token both propose appears once, with the larger of the two probabilities."""

from __future__ import annotations

import torch

from castspec.decode.tree import TreePool
from castspec.drafters.base import Candidates, Drafter
from castspec.drafters.ngram import NgramDrafter
from castspec.drafters.suffix import SuffixDrafter
from castspec.errors import CastspecError


def merge_candidates(model: Candidates, ngram: Candidates) -> Candidates:
    """Row by row: the union of both proposals, a shared token keeping its larger probability, best first,
    padded with empty slots (probability 0) to the width of both."""
    rows, width = model.tokens.shape[0], model.tokens.shape[1] + ngram.tokens.shape[1]
    tokens = torch.zeros(rows, width, dtype=torch.long)
    probs = torch.zeros(rows, width)
    for row in range(rows):
        best: dict[int, float] = {}
        for source in (model, ngram):
            for token, prob in zip(source.tokens[row].tolist(), source.probs[row].tolist(), strict=True):
                if prob > 0:
                    best[token] = max(prob, best.get(token, 0.0))
        ranked = sorted(best.items(), key=lambda item: -item[1])
        if ranked:
            tokens[row, : len(ranked)] = torch.tensor([t for t, _ in ranked])
            probs[row, : len(ranked)] = torch.tensor([p for _, p in ranked])
    return Candidates(tokens, probs)


class NgramAugmentedDrafter(Drafter):
    """`primary`'s candidates with `ngram`'s (an n-gram or a suffix drafter) merged in; deterministic (top-k)
    drafting only."""

    def __init__(self, primary: Drafter, ngram: NgramDrafter | SuffixDrafter | None = None) -> None:
        if isinstance(primary, NgramDrafter | SuffixDrafter | NgramAugmentedDrafter):
            raise CastspecError("a model-free drafter (n-gram, suffix) is merged into a model drafter (draft model "
                                "or EAGLE head), not into another model-free drafter")
        self.primary, self.ngram = primary, ngram or NgramDrafter()
        self.name = f"{primary.name}+{self.ngram.name}"
        self.feature_layers = primary.feature_layers

    def sample_candidates(self, params, generator) -> None:
        if params is not None and not params.greedy:
            raise CastspecError(f"a drafter with {self.ngram.name} proposals merged in proposes deterministically (its "
                                "candidates are not draws from one distribution); sampled drafting needs a draft "
                                "model alone")
        self.primary.sample_candidates(None, None)
        self.sampling = None

    def reset(self, batch_size: int = 1) -> None:
        self.primary.reset(batch_size)
        self.ngram.reset(batch_size)

    def begin(self, new_tokens: list[list[int]], top_k: int,
              features: list[torch.Tensor] | None = None) -> list[Candidates]:
        model = self.primary.begin(new_tokens, top_k, features)
        ngram = self.ngram.begin(new_tokens, top_k)
        return [merge_candidates(m, g) for m, g in zip(model, ngram, strict=True)]

    def expand(self, pools: list[TreePool], frontiers: list[list[int]], top_k: int) -> list[Candidates]:
        model = self.primary.expand(pools, frontiers, top_k)
        ngram = self.ngram.expand(pools, frontiers, top_k)
        return [merge_candidates(m, g) for m, g in zip(model, ngram, strict=True)]

    def end_step(self) -> None:
        self.primary.end_step()
        self.ngram.end_step()

    def keep_rows(self, rows: list[int]) -> None:
        self.primary.keep_rows(rows)
        self.ngram.keep_rows(rows)

    def add_rows(self, count: int) -> None:
        self.primary.add_rows(count)
        self.ngram.add_rows(count)

    @property
    def can_share(self) -> bool:
        return self.ngram.can_share

    def set_sharing(self, rows: list[int], share: list[bool]) -> None:
        self.ngram.set_sharing(rows, share)
