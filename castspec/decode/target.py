"""The target model's side of a decoding step, for a batch of sequences: prefill, verify one tree per row in a
single forward, commit each row's accepted path.

Rows have different lengths, so the KV cache is a rectangle with holes: `valid[b, j]` says whether column j
holds one of row b's tokens. Prompts are left-padded (holes on the left) so that the last column is every row's
last prompt token; each verify appends as many columns as the largest tree; each commit keeps, per row, the root
and the accepted path, padded to the longest kept path with holes. Rows join between steps (prefilled on their
own, then appended with holes on the left) and leave between steps; when holes pile up the cache is compacted.
Positions are per row (`lengths`), so holes never shift a token's position; masking makes them invisible. A hole
attends to itself only, so that its (discarded) attention output stays finite."""

from __future__ import annotations

import torch

from castspec.decode import kv
from castspec.decode.prefix_cache import PrefixHit
from castspec.decode.tree import DraftTree, ancestor_masks, padded_rows


class Target:
    def __init__(self, model) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = kv.new_cache(model)
        self.valid = torch.zeros(0, 0, dtype=torch.bool)
        self.lengths: list[int] = []

    @property
    def length(self) -> int:
        """Columns in the KV cache (holes included): what a forward attends over."""
        return kv.cache_length(self.cache)

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def prefill(self, prompts: list[list[int]], feature_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Start afresh with the prompts (one per row); returns what `add_rows` returns."""
        self.cache = kv.new_cache(self.model)
        self.valid = torch.zeros(0, 0, dtype=torch.bool)
        self.lengths = []
        return self.add_rows(prompts, feature_layers)

    def add_rows(self, prompts: list[list[int]], feature_layers: tuple[int, ...] = (),
                 prefixes: list[PrefixHit | None] | None = None) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Prefill the prompts (one new row each, in one forward of their own) and append their rows below the
        running ones. Returns the logits that predict each new row's first token [B', V] and, with
        `feature_layers`, each new row's features of its prompt tokens ([len(prompt), F] per row). `prefixes[b]`:
        the cached entries of prompt b's first tokens (a prefix-cache hit), which are not computed again."""
        pending = self.start_rows(prompts, feature_layers, prefixes)
        while not self.prefill_chunk(pending):
            pass
        return self.join_rows(pending)

    def start_rows(self, prompts: list[list[int]], feature_layers: tuple[int, ...] = (),
                   prefixes: list[PrefixHit | None] | None = None) -> PendingRows:
        """Rows to prefill by chunks (`prefill_chunk`) while the running rows go on decoding, then `join_rows`."""
        return PendingRows(self.model, prompts, feature_layers, prefixes or [None] * len(prompts), self.device)

    def prefill_chunk(self, pending: PendingRows, columns: int | None = None) -> bool:
        """Prefill the next `columns` prompt columns of the pending rows (None: all that are left) in one forward;
        returns whether their prefill is complete."""
        pending.step(self._mask, columns)
        return pending.done

    def join_rows(self, pending: PendingRows) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Append the prefilled rows below the running ones; returns what `add_rows` returns."""
        self.cache, self.valid = kv.append_rows(self.cache, self.valid, pending.cache, pending.valid)
        self.lengths += [len(p) for p in pending.prompts]
        return pending.first_logits, pending.row_features()

    def row_entries(self, row: int, tree_nodes: list[int] = ()) -> tuple[int, torch.Tensor]:
        """Row `row`'s committed KV entries in order, then those of `tree_nodes` of the tree verified last (not
        committed): (count, [layers, 2, kv_heads, count, head_dim])."""
        columns = self.valid[row].nonzero().flatten()
        if tree_nodes:
            columns = torch.cat([columns, self._tree_start + torch.tensor(tree_nodes, dtype=torch.long)])
        columns = columns.to(self.device)
        layers = [torch.stack([layer.keys[row, :, columns], layer.values[row, :, columns]])
                  for layer in self.cache.layers]
        return len(columns), torch.stack(layers)

    def _mask(self, mask: torch.Tensor) -> torch.Tensor:
        return mask[:, None].to(self.device)

    def verify(self, trees: list[DraftTree], feature_layers: tuple[int, ...] = ()
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over every row's tree (padded to the largest); returns (logits [B, n, V] in the model's
        dtype, features [B, n, F] of `feature_layers` or None). Row b's node i is at [b, i]."""
        past, width = self.length, max(len(t) for t in trees)
        self._tree_start = past
        tokens = padded_rows([t.tokens for t in trees], width, 0)
        lengths = torch.tensor(self.lengths, dtype=torch.long)[:, None]
        positions = padded_rows([t.depths for t in trees], width, 0) + lengths
        real = torch.arange(width)[None] < torch.tensor([len(t) for t in trees])[:, None]  # [B, width]
        # every node sees its row's cached entries and its own ancestors; padding nodes see only themselves
        mask = torch.cat([self.valid[:, None, :] & real[:, :, None], ancestor_masks(trees, width)], dim=2)
        out = kv.forward(self.model, self.cache, tokens.to(self.device), positions.to(self.device),
                         self._mask(mask), want_hidden=bool(feature_layers))
        return out.logits, join_features(out, feature_layers) if feature_layers else None

    def commit(self, kept_nodes: list[list[int]]) -> None:
        """Per row, keep the KV entries of `kept_nodes` (root first, then the accepted path) of the trees
        verified last; drop the rest of those trees."""
        width = max(len(k) for k in kept_nodes)
        offsets = torch.tensor([k + [k[-1]] * (width - len(k)) for k in kept_nodes])
        kv.gather_entries(self.cache, self._tree_start, offsets.to(self.device))
        new_valid = torch.arange(width)[None] < torch.tensor([len(k) for k in kept_nodes])[:, None]
        self.valid = torch.cat([self.valid[:, : self._tree_start], new_valid], dim=1)
        self.lengths = [length + len(k) for length, k in zip(self.lengths, kept_nodes, strict=True)]
        self.compact_if_sparse()

    def keep_rows(self, rows: list[int]) -> None:
        """Only `rows` go on (the others finished or left)."""
        if not rows:  # nothing left: free the whole cache
            self.cache, self.valid, self.lengths = kv.new_cache(self.model), torch.zeros(0, 0, dtype=torch.bool), []
            return
        kv.keep_rows(self.cache, torch.tensor(rows, dtype=torch.long, device=self.device))
        self.valid = self.valid[torch.tensor(rows, dtype=torch.long)]
        self.lengths = [self.lengths[r] for r in rows]  # the next commit frees the columns they leave

    def compact_if_sparse(self) -> None:
        """Free the holes once they make up a large part of the cache (see `kv.needs_compaction`)."""
        if kv.needs_compaction(self.valid):
            self.valid = kv.compact(self.cache, self.valid)


def join_features(out, layers: tuple[int, ...]) -> torch.Tensor:
    """The hidden states of `layers` side by side (index -1: the last layer's, after the final norm)."""
    return torch.cat([out.hidden_states[i] for i in layers], dim=-1)


class PendingRows:
    """Rows being prefilled, in a KV cache of their own: [cached prefix region | prompt region] per row. Prefixes
    are right-aligned in the first region and prompts left-padded in the second (holes masked), so each row's
    tokens stay in order with per-row positions. Prefilled by column chunks; the last gives the first logits."""

    def __init__(self, model, prompts: list[list[int]], feature_layers: tuple[int, ...],
                 prefixes: list[PrefixHit | None], device: torch.device) -> None:
        self.model, self.prompts, self.feature_layers, self.device = model, prompts, feature_layers, device
        self.prefixes = prefixes
        hit = [p.length if p is not None else 0 for p in prefixes]
        self.cached = sum(hit)
        past = max(hit)
        width = max(len(prompt) - h for prompt, h in zip(prompts, hit, strict=True))
        self.past, self.width, self.done_columns = past, width, 0
        self.tokens = torch.zeros(len(prompts), width, dtype=torch.long)
        self.positions = torch.zeros(len(prompts), width, dtype=torch.long)
        self.valid = torch.zeros(len(prompts), past + width, dtype=torch.bool)
        for row, (prompt, h) in enumerate(zip(prompts, hit, strict=True)):
            rest = prompt[h:]
            self.tokens[row, width - len(rest):] = torch.tensor(rest)
            self.positions[row, width - len(rest):] = torch.arange(h, len(prompt))
            self.valid[row, past - h: past] = True
            self.valid[row, past + width - len(rest):] = True
        self.cache = kv.new_cache(model)
        if past:
            self._seed(prefixes, past)
        self.first_logits: torch.Tensor | None = None
        self.feature_chunks: list[torch.Tensor] = []

    @property
    def done(self) -> bool:
        return self.done_columns >= self.width

    @property
    def rows(self) -> int:
        return len(self.prompts)

    def _seed(self, prefixes: list[PrefixHit | None], past: int) -> None:
        template = next(p.kv for p in prefixes if p is not None)
        layers, _, heads, _, dim = template.shape
        entries = template.new_zeros(layers, 2, len(prefixes), heads, past, dim)
        for row, prefix in enumerate(prefixes):
            if prefix is not None:
                entries[:, :, row, :, past - prefix.length:] = prefix.kv
        entries = entries.to(self.device)
        for layer in range(layers):
            self.cache.update(entries[layer, 0], entries[layer, 1], layer)

    @torch.inference_mode()
    def step(self, device_mask, columns: int | None) -> None:
        start = self.done_columns
        end = self.width if columns is None else min(self.width, start + max(1, columns))
        keys = self.past + end
        mask = None
        if self.rows > 1:
            # a prompt token sees its row's cached prefix and its row's earlier prompt tokens; a hole only itself
            query_valid = self.valid[:, self.past + start: self.past + end]
            causal = torch.ones(end - start, keys, dtype=torch.bool).tril(self.past + start)
            eye = torch.zeros(end - start, keys, dtype=torch.bool)
            eye[torch.arange(end - start), self.past + torch.arange(start, end)] = True
            mask = device_mask((causal[None] & self.valid[:, None, :keys] & query_valid[:, :, None]) | eye[None])
        out = kv.forward(self.model, self.cache, self.tokens[:, start:end].to(self.device),
                         self.positions[:, start:end].to(self.device), mask, logits_to_keep=1,
                         want_hidden=bool(self.feature_layers))
        if self.feature_layers:
            self.feature_chunks.append(join_features(out, self.feature_layers))
        self.done_columns = end
        if self.done:
            self.first_logits = out.logits[:, -1].float()

    def row_features(self) -> list[torch.Tensor] | None:
        """Each row's features of its prompt tokens: the cached prefix's, then the prefilled ones."""
        if not self.feature_layers:
            return None
        computed = torch.cat(self.feature_chunks, dim=1)
        rows = []
        for row, (prompt, prefix) in enumerate(zip(self.prompts, self.prefixes, strict=True)):
            hit = prefix.length if prefix is not None else 0
            mine = computed[row, self.width - (len(prompt) - hit):]
            if hit:
                if prefix.features is None:
                    raise ValueError("a prefix-cache hit without features for a drafter that reads them")
                mine = torch.cat([prefix.features.to(mine.device, mine.dtype), mine])
            rows.append(mine)
        return rows
