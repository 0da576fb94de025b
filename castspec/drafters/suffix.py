"""Suffix-tree drafter: proposes what followed earlier occurrences of the current context's suffixes, of every
length from one token up, in the request itself and (opt-in) in earlier requests' outputs.

Per request, a suffix trie of bounded depth holds every substring of the prompt and the output (up to
`max_depth` tokens) with how often it occurred; it grows by one token in O(max_depth). Each step, the longest
suffix of (context + a tree node's path) found in the trie is the node's match; its continuations, with their
counts, are the node's children, so a context seen several times gives a tree of several continuations per node.
A continuation's score is its share of the match's occurrences, shrunk by how little evidence stands behind it:
one occurrence, or a match one token long, is a guess, not a sure thing (n / (N + 1) * l / (l + 1) for n of N
continuations after a match of l tokens). The scores are not acceptance probabilities: CAST calibrates them
against what the target accepts (`--cast-calibration`, on by default for this drafter), by score and by the match's
length, which goes with each node's candidates.

A `SharedSuffixTrie` (one per server process) holds the outputs of earlier requests that opted in, within a
token budget (the oldest outputs are evicted first), so that a repeated task family gets faster over time."""

from __future__ import annotations

import heapq
from collections import deque
from operator import itemgetter

import torch

from castspec.decode.tree import TreePool
from castspec.drafters.base import MATCH_CAP, Candidates, Drafter
from castspec.errors import CastspecError


class SuffixTrie:
    """Every substring of up to `max_depth` tokens of the sequences added, as trie nodes with occurrence counts.
    Node 0 is the empty string. `totals[n]` is how many occurrences of node n's string had a next token."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.children: list[dict[int, int] | None] = [None]
        self.counts, self.totals, self.depths = [0], [0], [0]
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self.counts) - len(self._free)

    def _new_node(self, depth: int) -> int:
        if self._free:
            node = self._free.pop()
            self.children[node], self.counts[node], self.totals[node], self.depths[node] = None, 0, 0, depth
            return node
        self.children.append(None)
        self.counts.append(0)
        self.totals.append(0)
        self.depths.append(depth)
        return len(self.counts) - 1

    def extend(self, ends: list[int], token: int) -> list[int]:
        """Add one token after a sequence whose suffixes (shortest first, the empty one included) are `ends`;
        returns the suffixes of the sequence with the token appended, in the same order."""
        out = [0]
        for node in ends:
            if self.depths[node] >= self.max_depth:
                continue
            kids = self.children[node]
            if kids is None:
                kids = self.children[node] = {}
            child = kids.get(token)
            if child is None:
                child = kids[token] = self._new_node(self.depths[node] + 1)
            self.counts[child] += 1
            self.totals[node] += 1
            out.append(child)
        return out

    def add(self, tokens: list[int]) -> None:
        ends = [0]
        for token in tokens:
            ends = self.extend(ends, token)

    def remove(self, tokens: list[int]) -> None:
        """Undo `add(tokens)`: every substring's count drops by one; nodes no longer seen are freed."""
        ends = [0]
        for token in tokens:
            out = [0]
            for node in ends:
                if self.depths[node] >= self.max_depth:
                    continue
                child = self.children[node][token]
                self.counts[child] -= 1
                self.totals[node] -= 1
                out.append(child)
            for parent, child in zip(ends, out[1:], strict=False):
                if self.counts[child] == 0:
                    del self.children[parent][token]
                    self._free.append(child)
            ends = out

    def follow(self, ends: list[int], token: int) -> list[int]:
        """Like `extend`, read-only: the suffixes of (sequence + token) that occur in the trie."""
        out = [0]
        for node in ends:
            kids = self.children[node]
            if kids is not None:
                child = kids.get(token)
                if child is not None:
                    out.append(child)
        return out

    def locate(self, tokens: list[int]) -> list[int]:
        """The suffixes of `tokens` (at most max_depth long) that occur in the trie, shortest first."""
        ends = [0]
        for token in tokens[-self.max_depth:]:
            ends = self.follow(ends, token)
        return ends

    def match_length(self, ends: list[int]) -> int:
        """The length of the longest match among `ends` that has continuations (0: none)."""
        for node in reversed(ends):
            if node != 0 and self.totals[node] > 0:
                return self.depths[node]
        return 0

    def continuations(self, ends: list[int], top_k: int, levels: int = 2) -> dict[int, float]:
        """Scored next tokens after the longest matches among `ends` that have continuations: the deepest such
        match, then `levels` - 1 shorter ones for tokens not proposed yet (a shorter match saw more, surer less)."""
        scores: dict[int, float] = {}
        for node in reversed(ends):
            if len(scores) >= top_k or levels == 0:
                break
            kids, total = self.children[node], self.totals[node]
            if node == 0 or not kids or total == 0:
                continue
            levels -= 1
            length = self.depths[node]
            shrink = length / (length + 1) / (total + 1)
            items = kids.items()
            best = heapq.nlargest(top_k, items, key=lambda kv: self.counts[kv[1]]) if len(kids) > top_k else items
            for token, child in best:
                if token not in scores:
                    scores[token] = self.counts[child] * shrink
        return scores


class SharedSuffixTrie:
    """Earlier requests' outputs, shared by every request that opts in, within `max_tokens` tokens: adding an
    output past the budget evicts the oldest. `version` changes with every change, so a reader knows its match
    positions are stale."""

    def __init__(self, max_tokens: int = 200_000, max_depth: int = 16) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise CastspecError(f"the shared suffix tree needs a positive token budget, got {max_tokens!r}")
        self.trie = SuffixTrie(max_depth)
        self.max_tokens = max_tokens
        self.outputs: deque[list[int]] = deque()
        self.tokens = 0
        self.version = 0

    def add(self, output: list[int]) -> None:
        output = output[-self.max_tokens:]
        if not output:
            return
        while self.outputs and self.tokens + len(output) > self.max_tokens:
            oldest = self.outputs.popleft()
            self.trie.remove(oldest)
            self.tokens -= len(oldest)
        self.trie.add(output)
        self.outputs.append(output)
        self.tokens += len(output)
        self.version += 1

    def clear(self) -> None:
        self.trie = SuffixTrie(self.trie.max_depth)
        self.outputs.clear()
        self.tokens = 0
        self.version += 1


class _Row:
    """One request: its own trie, its suffix ends in it (and in the shared trie), and its output so far."""

    def __init__(self, max_depth: int, share: bool) -> None:
        self.trie = SuffixTrie(max_depth)
        self.ends = [0]
        self.history: list[int] = []
        self.prompt_length: int | None = None
        self.share = share
        self.shared_ends = [0]
        self.shared_version = -1


class SuffixDrafter(Drafter):
    name = "suffix"

    def __init__(self, max_depth: int = 16, shared: SharedSuffixTrie | None = None, share: bool = False,
                 levels: int = 2) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or not 1 <= max_depth <= 256:
            raise CastspecError(f"the suffix tree's depth must be an integer in 1..256, got {max_depth!r}")
        if share and shared is None:
            raise CastspecError("sharing earlier outputs needs a shared suffix tree")
        self.max_depth, self.shared, self.share, self.levels = max_depth, shared, share, levels
        self._ends: list[dict[int, tuple[list[int], list[int]]]] = []
        self.reset()

    def reset(self, batch_size: int = 1) -> None:
        self.rows = [_Row(self.max_depth, self.share) for _ in range(batch_size)]

    @property
    def can_share(self) -> bool:
        return self.shared is not None

    def set_sharing(self, rows: list[int], share: list[bool]) -> None:
        if any(share) and self.shared is None:
            super().set_sharing(rows, share)
        for row, flag in zip(rows, share, strict=True):
            self.rows[row].share = flag

    def _shared_ends(self, row: _Row) -> list[int]:
        if not row.share or self.shared is None:
            return [0]
        if row.shared_version != self.shared.version:  # outputs were added or evicted: find the matches again
            row.shared_ends = self.shared.trie.locate(row.history)
            row.shared_version = self.shared.version
        return row.shared_ends

    def _propose(self, row: _Row, ends: list[int], shared_ends: list[int], top_k: int
                 ) -> tuple[list[int], list[float], int]:
        """A node's continuations, their scores and its match length (the longer of its own and the shared one)."""
        scores = row.trie.continuations(ends, top_k, self.levels)
        length = row.trie.match_length(ends)
        if len(shared_ends) > 1:
            for token, score in self.shared.trie.continuations(shared_ends, top_k, self.levels).items():
                scores[token] = max(score, scores.get(token, 0.0))
            length = max(length, self.shared.trie.match_length(shared_ends))
        best = sorted(scores.items(), key=itemgetter(1), reverse=True)[:top_k]
        return [t for t, _ in best], [s for _, s in best], length

    @staticmethod
    def _candidates(proposals: list[tuple[list[int], list[float], int]], top_k: int) -> Candidates:
        tokens = torch.zeros(len(proposals), top_k, dtype=torch.long)
        probs = torch.zeros(len(proposals), top_k)
        for i, (toks, ps, _) in enumerate(proposals):
            if toks:
                tokens[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
                probs[i, : len(ps)] = torch.tensor(ps)
        return Candidates(tokens, probs, matched=[min(length, MATCH_CAP) for _, _, length in proposals])

    def begin(self, new_tokens: list[list[int]], top_k: int, features=None) -> list[Candidates]:
        out = []
        self._ends = []
        for row, new in zip(self.rows, new_tokens, strict=True):
            if row.prompt_length is None:
                row.prompt_length = max(0, len(new) - 1)  # the first call brings the prompt and the first token
            shared = self.shared if row.share else None
            stale = shared is not None and row.shared_version != shared.version
            for token in new:
                row.ends = row.trie.extend(row.ends, token)
                row.history.append(token)
                if shared is not None and not stale:
                    row.shared_ends = shared.trie.follow(row.shared_ends, token)
            shared_ends = self._shared_ends(row)
            self._ends.append({0: (row.ends, shared_ends)})
            out.append(self._candidates([self._propose(row, row.ends, shared_ends, top_k)], top_k))
        return out

    def expand(self, pools: list[TreePool], frontiers: list[list[int]], top_k: int) -> list[Candidates]:
        out = []
        for row, pool, frontier, ends in zip(self.rows, pools, frontiers, self._ends, strict=True):
            reads_shared = row.share and self.shared is not None
            proposals = []
            for node in frontier:
                if node not in ends:
                    own, shared = ends[pool.parents[node]]
                    token = pool.tokens[node]
                    ends[node] = (row.trie.follow(own, token),
                                  self.shared.trie.follow(shared, token) if reads_shared else [0])
                proposals.append(self._propose(row, *ends[node], top_k))
            out.append(self._candidates(proposals, top_k))
        return out

    def end_step(self) -> None:
        self._ends = []

    def _finish(self, row: _Row) -> None:
        if row.share and self.shared is not None and row.prompt_length is not None:
            self.shared.add(row.history[row.prompt_length:])

    def keep_rows(self, rows: list[int]) -> None:
        kept = set(rows)
        for i, row in enumerate(self.rows):
            if i not in kept:
                self._finish(row)
        self.rows = [self.rows[r] for r in rows]

    def add_rows(self, count: int) -> None:
        self.rows += [_Row(self.max_depth, self.share) for _ in range(count)]
