"""A prefix cache for the target: the KV entries (and drafter features) of sequences seen before, kept by blocks
of tokens, so that a request whose prompt starts like an earlier sequence prefills only the rest.

Blocks are keyed by their tokens and their parent block (a radix tree with `block_tokens` tokens per edge), so a
block means the same tokens at the same positions after the same prefix. What is stored is only ever a row's
committed KV: its prompt and the tokens it accepted, speculative or not, which are the tokens plain decoding would
have produced; rejected draft nodes never reach the cache. A hit is copied into the joining rows' cache, so an
entry is never in use by a running request and eviction (least recently used leaves first, so a block goes only
after its descendants) can never pull KV from under one. Bounded by bytes (`--prefix-cache-gb`)."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import torch

from castspec.errors import CastspecError

BLOCK_TOKENS = 16  # tokens per block: hits count in whole blocks (vLLM's default block size too)


@dataclass
class PrefixHit:
    """The cached entries of a prompt's first `length` tokens: `kv` [layers, 2, kv_heads, length, head_dim] (keys
    then values) and, where features were stored, `features` [length, F]."""

    length: int
    kv: torch.Tensor
    features: torch.Tensor | None


@dataclass
class _Block:
    key: tuple[int, tuple[int, ...]]  # (parent block id, tokens)
    id: int
    parent: _Block | None
    kv: torch.Tensor  # [layers, 2, kv_heads, block, head_dim]
    features: torch.Tensor | None  # [block, F]
    last_used: int
    children: int = 0

    @property
    def nbytes(self) -> int:
        extra = self.features.numel() * self.features.element_size() if self.features is not None else 0
        return self.kv.numel() * self.kv.element_size() + extra


class PrefixCache:
    def __init__(self, capacity_bytes: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if capacity_bytes < 0 or block_tokens < 1:
            raise CastspecError(f"a prefix cache needs a capacity >= 0 bytes and blocks of >= 1 token, got "
                                f"{capacity_bytes} and {block_tokens}")
        self.capacity_bytes, self.block_tokens = capacity_bytes, block_tokens
        self._blocks: dict[tuple[int, tuple[int, ...]], _Block] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count()
        self._leaves: list[tuple[int, int, _Block]] = []  # heap of (last_used, id, block), checked when popped
        self.nbytes = 0
        # vLLM's meanings: tokens looked up, tokens found; evicted blocks
        self.queries = self.hits = self.evictions = 0

    def clear(self) -> None:
        """Drop every block (the counters go on: they count since the start, as Prometheus counters do)."""
        self._blocks.clear()
        self._leaves.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, tokens: list[int], limit: int | None = None) -> PrefixHit | None:
        """The longest cached prefix of `tokens` in whole blocks, at most `limit` tokens (a prompt keeps at least
        its last token to prefill, whose logits give the first new token). Counts a query of len(tokens)."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        self.queries += len(tokens)
        chain, parent_id, size = [], 0, self.block_tokens
        for start in range(0, limit - size + 1, size):
            block = self._blocks.get((parent_id, tuple(tokens[start: start + size])))
            if block is None:
                break
            chain.append(block)
            parent_id = block.id
        if not chain:
            return None
        for block in reversed(chain):  # the deepest first, so that a parent is never older than its children
            self._touch(block)
        self.hits += len(chain) * size
        features = None
        if all(b.features is not None for b in chain):
            features = torch.cat([b.features for b in chain])
        return PrefixHit(len(chain) * size, torch.cat([b.kv for b in chain], dim=3), features)

    def insert(self, tokens: list[int], kv: torch.Tensor, features: torch.Tensor | None = None) -> int:
        """Store the entries of `tokens` (kv [layers, 2, kv_heads, len(tokens), head_dim], features [len, F]) by
        whole blocks; blocks already held are only marked used. Returns the blocks added."""
        size, added, parent, parent_id = self.block_tokens, 0, None, 0
        path = []
        for start in range(0, len(tokens) - size + 1, size):
            key = (parent_id, tuple(tokens[start: start + size]))
            block = self._blocks.get(key)
            if block is None:
                block = _Block(key, next(self._ids), parent, kv[:, :, :, start: start + size].clone(),
                               None if features is None else features[start: start + size].clone(), 0)
                if block.nbytes > self.capacity_bytes:
                    break
                self._blocks[key] = block
                self.nbytes += block.nbytes
                if parent is not None:
                    parent.children += 1
                added += 1
            elif block.features is None and features is not None:
                block.features = features[start: start + size].clone()
                self.nbytes += block.features.numel() * block.features.element_size()
            path.append(block)
            parent, parent_id = block, block.id
        for block in reversed(path):
            self._touch(block)
        self._evict(keep=set(id(b) for b in path))
        return added

    def _touch(self, block: _Block) -> None:
        block.last_used = next(self._clock)
        if block.children == 0:
            heapq.heappush(self._leaves, (block.last_used, block.id, block))

    def _evict(self, keep: set[int]) -> None:
        """Drop least recently used leaves until the cache fits (blocks of the sequence just stored go last)."""
        spared = []
        while self.nbytes > self.capacity_bytes and self._leaves:
            last_used, _, block = heapq.heappop(self._leaves)
            if block.last_used != last_used or block.children or self._blocks.get(block.key) is not block:
                continue  # a stale heap entry: used again since, or no longer a leaf, or gone
            if id(block) in keep and len(self._leaves) > 0:
                spared.append(block)
                continue
            del self._blocks[block.key]
            self.nbytes -= block.nbytes
            self.evictions += 1
            if block.parent is not None:
                block.parent.children -= 1
                if block.parent.children == 0:
                    heapq.heappush(self._leaves, (block.parent.last_used, block.parent.id, block.parent))
        for block in spared:
            heapq.heappush(self._leaves, (block.last_used, block.id, block))


def gigabytes(value: float) -> int:
    """`--prefix-cache-gb` as bytes."""
    return int(value * (1 << 30))
