"""Prompt-lookup / n-gram drafter: proposes the tokens that followed earlier occurrences of the current suffix.

Every n-gram (n = min_n..max_n) of the sequence so far is indexed with the counts of the tokens that followed
it. A node's children are the continuations of the longest suffix (of the sequence plus the node's path) that
occurred before; their probabilities are the continuation frequencies, so several matches give a tree. Each
node also reports its match length: how far back its context agrees with the latest earlier occurrence of the
n-gram (beyond max_n, up to MATCH_CAP), which is what CAST's calibration reads a lookup guess's chance from. It
costs microseconds, so it pays off wherever the output repeats its input (code edits, summaries, retrieval)."""

from __future__ import annotations

from collections import Counter, defaultdict

import torch

from castspec.decode.tree import TreePool
from castspec.drafters.base import MATCH_CAP, Candidates, Drafter
from castspec.errors import CastspecError


class _Index:
    """One sequence's n-grams and the counts of the tokens that followed them."""

    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n, self.min_n = max_n, min_n
        self.history: list[int] = []
        self.followers: dict[tuple[int, ...], Counter[int]] = defaultdict(Counter)
        self.last_end: dict[tuple[int, ...], int] = {}  # where the n-gram's latest followed occurrence ends

    def append(self, token: int) -> None:
        history = self.history
        for n in range(self.min_n, self.max_n + 1):
            if len(history) >= n:
                key = tuple(history[-n:])
                self.followers[key][token] += 1
                self.last_end[key] = len(history) - 1
        history.append(token)

    def propose(self, suffix_source: list[int], top_k: int) -> tuple[list[int], list[float], int]:
        """The continuations of the longest indexed suffix of `suffix_source` (the sequence's tail + a node's
        path), their frequencies, and the match length (0: no match)."""
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(suffix_source) < n:
                continue
            key = tuple(suffix_source[-n:])
            followers = self.followers.get(key)
            if followers:
                total = sum(followers.values())
                best = followers.most_common(top_k)
                return [t for t, _ in best], [c / total for _, c in best], self._match_length(suffix_source, key)
        return [], [], 0

    def _match_length(self, suffix_source: list[int], key: tuple[int, ...]) -> int:
        end, history = self.last_end[key], self.history
        length = len(key)
        while (length < MATCH_CAP and length < len(suffix_source) and end - length >= 0
               and history[end - length] == suffix_source[-1 - length]):
            length += 1
        return length


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
    def _candidates(proposals: list[tuple[list[int], list[float], int]], top_k: int) -> Candidates:
        tokens = torch.zeros(len(proposals), top_k, dtype=torch.long)
        probs = torch.zeros(len(proposals), top_k)
        for row, (toks, ps, _) in enumerate(proposals):
            tokens[row, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            probs[row, : len(ps)] = torch.tensor(ps)
        return Candidates(tokens, probs, matched=[length for _, _, length in proposals])

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
            tail = index.history[-MATCH_CAP:]  # enough to measure a match up to the cap
            proposals = [index.propose(tail + [pool.tokens[i] for i in pool.path_to(node)], top_k)
                         for node in frontier]
            out.append(self._candidates(proposals, top_k))
        return out

    def keep_rows(self, rows: list[int]) -> None:
        self.rows = [self.rows[r] for r in rows]

    def add_rows(self, count: int) -> None:
        self.rows += [_Index(self.max_n, self.min_n) for _ in range(count)]
