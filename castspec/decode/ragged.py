"""Ragged forwards: rows of different lengths, each with its own number of new tokens, in one forward of a stock
Hugging Face model, so that a prompt joining a running batch is prefilled in the same forward (one read of the
weights) as the running rows' trees, with no padding.

The new tokens of all rows are packed into one sequence ([1, Q]) with their own position ids. Each row's KV lives
in a slot of a buffer per layer ([slots, kv_heads, capacity, head_dim]), its entries in position order in columns
[0, fill): no holes, so a row's past is a view, never a copy. The model gets this cache and a `RaggedBatch` (a
keyword that stock models hand on to their attention function); the cache's `update` writes every new token's
key and value at its row's next columns, and the attention function (`castspec_ragged`, the model's
implementation for the length of the forward, so that no mask is built) reads the batch: rows with few new tokens
(a verify tree, an AR step) go through one batched attention over their slots, padded to the widest tree; a row
with many (a prompt chunk) through one of its own, causal over its slot."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from castspec.decode.tree import DraftTree, ancestor_masks

ATTENTION = "castspec_ragged"
# a row with more new tokens than this is attended on its own (a prompt chunk); fewer, with the batch's trees
OWN_ATTENTION_TOKENS = 64
_CAPACITY_STEP = 128


@dataclass
class _Group:
    """The rows attended together: slots 0..rows-1 (slots without a tree see one key and are ignored). Its sizes
    are the mask's: rows, query_group * width (the widest tree; queries are padded to it) and keys (columns read:
    the largest fill + width), so that a compiled forward reads them as shapes."""

    packed: torch.Tensor  # [q] where each of the group's tokens sits in the packed sequence
    slot: torch.Tensor  # [q] its slot
    node: torch.Tensor  # [q] its index among its row's new tokens
    mask: torch.Tensor  # [rows, 1, query_group * width, keys] bool (one copy per query head of a key head)


@dataclass
class _Chunks:
    """Rows attended on their own (prompt chunks, a long chain): chunk i is packed tokens start..end of slot `slot`,
    causal after its first `past` entries; `bounds` holds (start, end, slot, past) for each, one after another, and
    `masks` their masks ([query_group * (end - start), past + end - start] bool each) flattened one after another.
    Plain tensors, so that a compiled forward reads any number of chunks (none included) as data, not as shapes."""

    bounds: torch.Tensor  # [4 * chunks] int64, on the CPU
    masks: torch.Tensor  # [sum of the masks' sizes] bool


@dataclass
class RaggedBatch:
    """What one forward writes and reads: each packed token's slot and column, and how rows are attended."""

    token_slots: torch.Tensor  # [Q]
    token_columns: torch.Tensor  # [Q]
    group: _Group  # the trees attended together (no tokens in a forward of prompt chunks alone)
    chunks: _Chunks

    @property
    def has_trees(self) -> bool:
        return self.group.packed.numel() > 0


class SlotCache:
    """Per layer, keys and values of every row: [slots, kv_heads, capacity, head_dim]. `fill[s]`: entries of
    slot s (columns 0..fill-1, in position order). The buffers grow by whole steps when a forward needs more
    columns or slots, and are freed by `release`."""

    def __init__(self, model) -> None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        param = next(model.parameters())
        self.layer_count = config.num_hidden_layers
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.query_group = config.num_attention_heads // config.num_key_value_heads  # query heads per key head
        self.dtype, self.device = param.dtype, param.device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.fill: list[int] = []
        self.batch: RaggedBatch | None = None
        self.release()

    # ---- the Cache protocol the models call ------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the forward's new entries ([1, kv_heads, Q, head_dim]) at their rows' columns; the attention
        reads the whole layer with the `RaggedBatch`."""
        batch = self.batch
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[batch.token_slots, :, batch.token_columns] = key_states[0].transpose(0, 1)
        values[batch.token_slots, :, batch.token_columns] = value_states[0].transpose(0, 1)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.fill, default=0)

    # ---- room ------------------------------------------------------------------------------------------------
    @property
    def slots(self) -> int:
        return len(self.fill)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def release(self) -> None:
        """Drop every entry and the buffers' memory."""
        self.keys, self.values, self.fill = [], [], []
        self._allocate(0, 0)

    @torch.inference_mode()
    def ensure(self, slots: int, columns: int) -> None:
        """Room for `slots` slots of `columns` columns (existing entries kept)."""
        if slots <= self.slots and columns <= self.capacity:
            return
        new_slots = max(slots, self.slots)
        new_columns = self.capacity
        if columns > self.capacity:  # doubling, so that a growing row copies its cache O(log) times
            new_columns = max(columns, 2 * self.capacity)
            new_columns = -(-new_columns // _CAPACITY_STEP) * _CAPACITY_STEP
        old_keys, old_values = self.keys, self.values
        self._allocate(new_slots, new_columns)
        for layer, (k, v) in enumerate(zip(old_keys, old_values, strict=True)):
            self.keys[layer][: k.shape[0], :, : k.shape[2]] = k
            self.values[layer][: v.shape[0], :, : v.shape[2]] = v
        self.fill += [0] * (new_slots - len(self.fill))

    @torch.inference_mode()
    def shrink_to(self, columns: int) -> None:
        """Give back columns past `columns` (rounded up a step) once the rows are that short."""
        columns = -(-max(columns, 1) // _CAPACITY_STEP) * _CAPACITY_STEP
        if columns < self.capacity:
            self.keys = [k[:, :, :columns].clone() for k in self.keys]
            self.values = [v[:, :, :columns].clone() for v in self.values]

    @torch.inference_mode()  # always: a compiled forward guards on how its inputs were made
    def _allocate(self, slots: int, columns: int) -> None:
        shape = (slots, self.kv_heads, columns, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layer_count)]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layer_count)]

    # ---- entries ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def write_prefix(self, slot: int, entries: torch.Tensor) -> None:
        """Put cached entries [layers, 2, kv_heads, n, head_dim] at the start of `slot`."""
        count = entries.shape[3]
        self.ensure(slot + 1, count)
        entries = entries.to(self.device, self.dtype)
        for layer in range(self.layer_count):
            self.keys[layer][slot, :, :count] = entries[layer, 0]
            self.values[layer][slot, :, :count] = entries[layer, 1]
        self.fill[slot] = count

    @torch.inference_mode()
    def move(self, slots: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor) -> None:
        """Entry `sources[i]` of slot `slots[i]` goes to column `targets[i]` (read before any is written)."""
        for layer in range(self.layer_count):
            for buffer in (self.keys[layer], self.values[layer]):
                buffer[slots, :, targets] = buffer[slots, :, sources]

    def entries(self, slot: int, columns: torch.Tensor) -> torch.Tensor:
        """[layers, 2, kv_heads, len(columns), head_dim] of slot `slot` at `columns`."""
        columns = columns.to(self.device)
        return torch.stack([torch.stack([k[slot, :, columns], v[slot, :, columns]])
                            for k, v in zip(self.keys, self.values, strict=True)])


def plan(cache: SlotCache, trees: list[tuple[int, DraftTree]], chunks: list[tuple[int, list[int], int]],
         device: torch.device) -> tuple[torch.Tensor, torch.Tensor, RaggedBatch]:
    """Pack one forward: `trees` (slot, tree) are verified after their slots' entries; `chunks` (slot, tokens,
    start position) are prompt tokens appended to their slots. Returns (tokens [1, Q], positions [1, Q],
    batch); tree tokens come first, in the order given, then the chunks."""
    # slots and columns as plain lists, one tensor each at the end (a step has a few; per-tree tensors cost more)
    tokens, positions, slots, columns = [], [], [], []
    for slot, tree in trees:
        fill = cache.fill[slot]
        tokens.append(tree.tokens)
        positions.append(tree.depths + fill)
        slots += [slot] * len(tree)
        columns += range(fill, fill + len(tree))
    for slot, chunk, start in chunks:
        tokens.append(torch.tensor(chunk, dtype=torch.long))
        positions.append(torch.arange(start, start + len(chunk)))
        slots += [slot] * len(chunk)
        columns += range(start, start + len(chunk))
    need = max(columns) + 1
    small, bounds, masks, offset = [], [], [], 0
    for slot, tree in trees:
        if len(tree) > OWN_ATTENTION_TOKENS:  # a long chain (a profile or a wide budget) is attended alone
            bounds.append((offset, offset + len(tree), slot, cache.fill[slot]))
            masks.append(_own_mask(len(tree), cache.fill[slot], tree.ancestor_mask(), cache.query_group))
        else:
            small.append((offset, slot, tree))
        offset += len(tree)
    for slot, chunk, start in chunks:
        bounds.append((offset, offset + len(chunk), slot, start))
        masks.append(_own_mask(len(chunk), start, torch.ones(len(chunk), len(chunk), dtype=torch.bool).tril(),
                               cache.query_group))
        offset += len(chunk)
    if small:  # the batched attention reads every row of it as wide as the widest tree
        need = max(need, max(cache.fill[slot] for _, slot, _ in small) + max(len(t) for _, _, t in small))
    cache.ensure(max(slots) + 1, need)
    alone = _Chunks(torch.tensor(bounds, dtype=torch.long).reshape(-1),
                    torch.cat(masks).to(device) if masks else torch.zeros(0, dtype=torch.bool, device=device))
    batch = RaggedBatch(torch.tensor(slots, dtype=torch.long, device=device),
                        torch.tensor(columns, dtype=torch.long, device=device), _group(cache, small, device), alone)
    return torch.cat(tokens)[None].to(device), torch.cat(positions)[None].to(device), batch


def _own_mask(count: int, past: int, causal: torch.Tensor, group: int) -> torch.Tensor:
    """A chunk's mask, flat: every one of its `past` entries, then `causal` among its own tokens, for each of the
    `group` query heads of a key head."""
    return torch.cat([torch.ones(count, past, dtype=torch.bool), causal], dim=1).repeat(group, 1).reshape(-1)


def _group(cache: SlotCache, rows: list[tuple[int, int, DraftTree]], device) -> _Group:
    """`rows`: (packed offset, slot, tree) of the trees attended together (maybe none)."""
    if not rows:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return _Group(empty, empty, empty, torch.zeros(0, 1, 0, 0, dtype=torch.bool, device=device))
    slot_ids = [slot for _, slot, _ in rows]
    trees = [tree for _, _, tree in rows]
    lengths = [len(tree) for tree in trees]
    width = max(lengths)
    fills = [cache.fill[slot] for slot in slot_ids]
    keys = max(fills) + width
    # row r's query i sees its slot's entries before `fill` and its own tree's ancestors after it; few tensor
    # ops whatever the batch (each small op costs microseconds of dispatch on a CPU, a step has one such mask)
    start = torch.tensor(fills)[:, None, None]
    real = torch.arange(width)[None, :, None] < torch.tensor(lengths)[:, None, None]  # [R, width, 1]
    seen = (torch.arange(keys) < start) & real  # [R, width, keys]: the prefix
    seen.scatter_(2, (start + torch.arange(width)).expand(-1, width, -1), ancestor_masks(trees, width))
    if slot_ids == list(range(len(slot_ids))):
        mask = seen[:, None]
    else:
        mask = torch.zeros(max(slot_ids) + 1, 1, width, keys, dtype=torch.bool)
        mask[:, :, :, 0] = True  # slots without a tree in the window: one key, so their (unused) rows stay finite
        mask[torch.tensor(slot_ids), 0] = seen
    packed = torch.tensor([offset + i for offset, _, tree in rows for i in range(len(tree))], dtype=torch.long)
    slot = torch.tensor([s for _, s, tree in rows for _ in range(len(tree))], dtype=torch.long)
    node = torch.tensor([i for length in lengths for i in range(length)], dtype=torch.long)
    mask = mask.repeat(1, 1, cache.query_group, 1)  # as `_attend` stacks each key head's query heads
    return _Group(packed.to(device), slot.to(device), node.to(device), mask.to(device))


def ragged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     dropout: float = 0.0, scaling: float | None = None, ragged: RaggedBatch | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """The attention of a ragged forward (query [1, heads, Q, head_dim], key / value the cache's whole layer)."""
    if ragged is None:
        raise RuntimeError("castspec_ragged attention runs inside castspec.decode.ragged.forward only")
    group, chunks = ragged.group, ragged.chunks
    # one opaque op: a compiled forward calls it as it is, whatever the trees' and chunks' shapes and count
    out = torch.ops.castspec.attend(query, key, value, group.packed, group.slot, group.node, group.mask,
                                    chunks.bounds, chunks.masks, scaling)
    return out[None], None


@torch.library.custom_op("castspec::attend", mutates_args=())
def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed: torch.Tensor, slot: torch.Tensor,
           node: torch.Tensor, mask: torch.Tensor, chunk_bounds: torch.Tensor, chunk_masks: torch.Tensor,
           scaling: float | None) -> torch.Tensor:
    """Every packed token's attention, [Q, heads, head_dim]: the trees of a `_Group` (slots 0..rows-1) attended
    together, padded to the widest, and each chunk of `_Chunks` on its own, causal over its slot."""
    heads, dim = query.shape[1], query.shape[3]
    group_size = heads // key.shape[1]
    out = query.new_empty(query.shape[2], heads, dim)
    if packed.numel():
        rows, keys = mask.shape[0], mask.shape[3]
        width = mask.shape[2] // group_size
        padded = query.new_zeros(rows, heads, width, dim)
        padded[slot, :, node] = query[0][:, packed].transpose(0, 1)
        attended = _attend(padded, key[:rows, :, :keys], value[:rows, :, :keys], mask, scaling)
        out[packed] = attended[slot, :, node]
    offset = 0
    for start, end, row, past in chunk_bounds.view(-1, 4).tolist():
        count, keys = end - start, past + end - start
        chunk_mask = chunk_masks[offset: offset + group_size * count * keys].view(1, 1, group_size * count, keys)
        offset += group_size * count * keys
        attended = _attend(query[:, :, start: end], key[row: row + 1, :, :keys], value[row: row + 1, :, :keys],
                           chunk_mask, scaling)
        out[start: end] = attended[0].transpose(0, 1)
    return out


@attend.register_fake
def _(query, key, value, packed, slot, node, mask, chunk_bounds, chunk_masks, scaling):
    return query.new_empty(query.shape[2], query.shape[1], query.shape[3])


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
            scaling: float | None) -> torch.Tensor:
    """sdpa over grouped-query heads without copying the keys: each key head's query heads are stacked along the
    query axis ([B, kv_heads, group * n, dim]); `mask` is already repeated to match ([B, 1, group * n, keys])."""
    batch, heads, n, dim = query.shape
    query = query.reshape(batch, key.shape[1], heads // key.shape[1] * n, dim)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, n, dim)


@torch.inference_mode()
def forward(model, cache: SlotCache, tokens: torch.Tensor, positions: torch.Tensor, batch: RaggedBatch,
            logits_to_keep: torch.Tensor, want_hidden: bool = False):
    """One ragged forward of a stock model: its attention is `ragged_attention` for this call only (other callers
    of the same model, a plain `generate`, keep theirs), and no mask is built for it. A model compiled by
    `decode.compiled` runs its compiled forward when the forward has trees (decode steps, and prompt chunks
    carried by them); a forward of prompt chunks alone (a first prompt, a batch starting) runs eagerly."""
    AttentionInterface.register(ATTENTION, ragged_attention)
    config = model.config
    saved = config._attn_implementation
    config._attn_implementation = ATTENTION
    cache.batch = batch
    compiled = getattr(model, "castspec_compiled", None)
    run = compiled if compiled is not None and batch.has_trees else model
    try:
        return run(input_ids=tokens, position_ids=positions, cache=cache, use_cache=True, ragged=batch,
                   logits_to_keep=logits_to_keep, output_hidden_states=want_hidden)
    finally:
        config._attn_implementation = saved
        cache.batch = None
