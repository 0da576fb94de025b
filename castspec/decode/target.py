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

    def add_rows(self, prompts: list[list[int]], feature_layers: tuple[int, ...] = ()
                 ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Prefill the prompts (one new row each, in one forward of their own) and append their rows below the
        running ones. Returns the logits that predict each new row's first token [B', V] and, with
        `feature_layers`, each new row's features of its prompt tokens ([len(prompt), F] per row)."""
        cache = kv.new_cache(self.model)
        width = max(len(p) for p in prompts)
        tokens = torch.zeros(len(prompts), width, dtype=torch.long)
        positions = torch.zeros(len(prompts), width, dtype=torch.long)
        valid = torch.zeros(len(prompts), width, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            tokens[row, width - len(prompt):] = torch.tensor(prompt)
            positions[row, width - len(prompt):] = torch.arange(len(prompt))
            valid[row, width - len(prompt):] = True
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        mask = (causal[None] & valid[:, None, :]) | torch.eye(width, dtype=torch.bool)[None]
        out = kv.forward(self.model, cache, tokens.to(self.device), positions.to(self.device),
                         self._mask(mask) if len(prompts) > 1 else None, logits_to_keep=1,
                         want_hidden=bool(feature_layers))
        features = None
        if feature_layers:
            joined = join_features(out, feature_layers)
            features = [joined[row, width - len(p):] for row, p in enumerate(prompts)]
        self.cache, self.valid = kv.append_rows(self.cache, self.valid, cache, valid)
        self.lengths += [len(p) for p in prompts]
        return out.logits[:, -1].float(), features

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
