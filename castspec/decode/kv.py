"""Driving a stock Hugging Face causal LM through a rectangular `DynamicCache` (the draft model's): tree-masked
forwards, rows joining and leaving, holes compacted. The target keeps its own layout (`ragged`).

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
    for layer in _filled_layers(cache):
        layer.keys, layer.values = layer.keys[rows], layer.values[rows]


def _filled_layers(cache: DynamicCache) -> list:
    """The cache's layers that hold entries (a layer that never ran holds nothing yet)."""
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]


@torch.inference_mode()
def append_rows(cache: DynamicCache, valid: torch.Tensor, other: DynamicCache | None, other_valid: torch.Tensor
                ) -> tuple[DynamicCache, torch.Tensor]:
    """The rows of `other` (None: rows with no entries yet) appended below `cache`'s. The narrower of the two is
    left-padded with holes, so that both keep their last column last; positions are per row, so no token moves.
    Returns the joined cache and its `valid` [B + B', T]."""
    width = max(valid.shape[1], other_valid.shape[1])
    rows = valid.shape[0] + other_valid.shape[0]
    joined_valid = torch.zeros(rows, width, dtype=torch.bool)
    joined_valid[: valid.shape[0], width - valid.shape[1]:] = valid
    joined_valid[valid.shape[0]:, width - other_valid.shape[1]:] = other_valid
    mine = _filled_layers(cache)
    theirs = _filled_layers(other) if other is not None else []
    if not mine and not theirs:
        return cache, joined_valid
    if mine and theirs and len(mine) != len(theirs):
        raise ValueError("caches of different models cannot be joined")

    def padded(entries: torch.Tensor | None, batch: int, template: torch.Tensor) -> torch.Tensor:
        if entries is None or batch == 0:
            return template.new_zeros(batch, template.shape[1], width, template.shape[3])
        missing = width - entries.shape[2]
        if missing == 0:
            return entries
        return torch.cat([entries.new_zeros(batch, entries.shape[1], missing, entries.shape[3]), entries], dim=2)

    target = mine if mine else theirs
    for i, layer in enumerate(target):
        template = layer.keys
        a_keys, a_values = (mine[i].keys, mine[i].values) if mine else (None, None)
        b_keys, b_values = (theirs[i].keys, theirs[i].values) if theirs else (None, None)
        keys = torch.cat([padded(a_keys, valid.shape[0], template), padded(b_keys, other_valid.shape[0], template)])
        values = torch.cat([padded(a_values, valid.shape[0], template),
                            padded(b_values, other_valid.shape[0], template)])
        layer.keys, layer.values = keys, values
    if not mine:  # the running cache had never run a forward: the newcomers' layers become it
        return other, joined_valid
    return cache, joined_valid


def needs_compaction(valid: torch.Tensor) -> bool:
    """Whether the holes in a cache [B, T] are worth a gather of the whole cache: when the columns exceed the
    longest row by more than a quarter of it (and 32). Rows that accept fewer tokens than their neighbours gain a
    hole per step; without this a long-lived row's cache would grow with its neighbours' acceptances."""
    if valid.shape[0] == 0:
        return valid.shape[1] > 0
    longest = int(valid.sum(dim=1).max())
    return valid.shape[1] - longest > 32 + longest // 4


@torch.inference_mode()
def compact(cache: DynamicCache, valid: torch.Tensor) -> torch.Tensor:
    """Squeeze the holes out: every row's entries move, in order, to the right end of a cache as wide as the
    longest row (shorter rows get holes on the left). Returns the new `valid`. Positions are per row, so the
    attention over a row's entries is unchanged; only the holes other rows' commits left behind are freed."""
    counts = valid.sum(dim=1)
    width = int(counts.max()) if valid.numel() else 0
    if width == valid.shape[1]:
        return valid
    # per row: the column of its j-th entry, placed at width - count + j; left padding repeats the first entry
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices  # valid columns first, in order
    shift = (width - counts)[:, None]
    slot = (torch.arange(width)[None] - shift).clamp(min=0)
    columns = order.gather(1, slot)
    new_valid = torch.arange(width)[None] >= shift
    for layer in _filled_layers(cache):
        index = columns.to(layer.keys.device)[:, None, :, None]
        layer.keys = layer.keys.gather(2, index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
        layer.values = layer.values.gather(2, index.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
    return new_valid
