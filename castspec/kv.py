"""Driving a stock Hugging Face causal LM through its KV cache: tree-masked forwards and KV commits.

No model code is copied: trees are expressed with a 4-D boolean attention mask (used as given by the sdpa and
eager attention of stock models) and explicit position ids."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


@torch.inference_mode()
def forward(
    model,
    cache: DynamicCache,
    tokens: torch.Tensor,  # [B, n]
    positions: torch.Tensor,  # [B, n]
    mask: torch.Tensor | None = None,  # [B, 1, n, past + n] bool, None for causal
    logits_to_keep: int = 0,
    want_hidden: bool = False,
):
    return model(
        input_ids=tokens,
        position_ids=positions,
        attention_mask=mask,
        cache=cache,
        use_cache=True,
        logits_to_keep=logits_to_keep,
        output_hidden_states=want_hidden,
    )


def crop(cache: DynamicCache, length: int) -> None:
    excess = cache_length(cache) - length
    if excess > 0:
        cache.crop(-excess)


@torch.inference_mode()
def keep_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only the batch rows `rows` (finished sequences leave the batch)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:  # a layer that never ran holds nothing yet
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]


@torch.inference_mode()
def gather_entries(cache: DynamicCache, start: int, offsets: torch.Tensor) -> None:
    """Batched KV commit: row b keeps, of its entries from `start` on, those at `offsets[b]` [B, K] (ascending),
    moved to columns start..start+K-1; everything after them is dropped. Rows that keep fewer than K entries
    repeat one and mask the extra columns as holes."""
    index = (start + offsets)[:, None, :, None]

    def commit(entries: torch.Tensor) -> torch.Tensor:
        picked = entries.gather(2, index.expand(-1, entries.shape[1], -1, entries.shape[3]))
        return torch.cat([entries[:, :, :start], picked], dim=2)

    for layer in cache.layers:
        layer.keys, layer.values = commit(layer.keys), commit(layer.values)


@torch.inference_mode()
def keep_entries(cache: DynamicCache, start: int, keep: torch.Tensor) -> None:
    """Keep, of the entries from `start` on, only those at offsets `keep` (ascending), moved to be contiguous
    right after `start`; everything after them is dropped. This commits an accepted tree path."""
    end = start + keep.numel()
    is_prefix = bool((keep == torch.arange(keep.numel())).all())
    for layer in cache.layers:
        if not is_prefix:
            # the right-hand side is gathered into a new tensor before the write, so overlap is safe
            layer.keys[..., start:end, :] = layer.keys[..., start + keep, :]
            layer.values[..., start:end, :] = layer.values[..., start + keep, :]
        layer.keys = layer.keys[..., :end, :]
        layer.values = layer.values[..., :end, :]
