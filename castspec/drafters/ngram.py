"""Prompt-lookup / n-gram drafter: proposes the tokens that followed earlier occurrences of the current suffix.

Every n-gram (n = min_n..max_n) of the sequence so far is indexed with the counts of the tokens that followed
it. A node's children are the continuations of the longest suffix (of the sequence plus the node's path) that
occurred before; their probabilities are the continuation frequencies, so several matches give a tree. It costs
microseconds, so it pays off wherever the output repeats its input (code edits, summaries, retrieval)."""

from __future__ import annotations

from collections import Counter, defaultdict

import torch

from castspec.decode.tree import TreePool
from castspec.drafters.base import Candidates, Drafter
from castspec.errors import CastspecError


class _Index:
    """One sequence's n-grams and the counts of the tokens that followed them."""

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.history: list[int] = []
        self.followers: dict[tuple[int, ...], Counter[int]] = defaultdict(Counter)

    def append(self, token: int) -> None:
        history = self.history
        for n in range(self.min_n, self.max_n + 1):
            if len(history) >= n:
                self.followers[tuple(history[-n:])][token] += 1
        history.append(token)

    def propose(self, suffix_source: list[int], top_k: int) -> tuple[list[int], list[float]]:
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(suffix_source) < n:
                continue
            followers = self.followers.get(tuple(suffix_source[-n:]))
            if followers:
                total = sum(followers.values())
                best = followers.most_common(top_k)
                return [t for t, _ in best], [c / total for _, c in best]
        return [], []


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 2) -> None:
        if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n):
            raise CastspecError(f"n-gram sizes need integers 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.reset()

    def reset(self, batch_size: int = 1) -> None:
        self.rows = [_Index(self.max_n, self.min_n) for _ in range(batch_size)]

    @staticmethod
    def _candidates(proposals: list[tuple[list[int], list[float]]], top_k: int) -> Candidates:
        tokens = torch.zeros(len(proposals), top_k, dtype=torch.long)
        probs = torch.zeros(len(proposals), top_k)
        for row, (toks, ps) in enumerate(proposals):
            tokens[row, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            probs[row, : len(ps)] = torch.tensor(ps)
        return Candidates(tokens, probs)

    def begin(self, new_tokens: list[list[int]], top_k: int, features=None) -> list[Candidates]:
        out = []
        for index, new in zip(self.rows, new_tokens, strict=True):
            for token in new:
                index.append(token)
            out.append(self._candidates([index.propose(index.history, top_k)], top_k))
        return out

    def expand(self, pools: list[TreePool], frontiers: list[list[int]], top_k: int) -> list[Candidates]:
        out = []
        for index, pool, frontier in zip(self.rows, pools, frontiers, strict=True):
            tail = index.history[-self.max_n:]
            proposals = [index.propose(tail + [pool.tokens[i] for i in pool.path_to(node)], top_k)
                         for node in frontier]
            out.append(self._candidates(proposals, top_k))
        return out

    def keep_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]

    def add_rows(self, count: int) -> None:
        self.rows += [_Index(self.max_n, self.min_n) for _ in range(count)]
