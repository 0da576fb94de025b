"""The target model's side of a decoding step: prefill, verify a whole tree in one forward, commit the path."""

from __future__ import annotations

import torch

from castspec import kv
from castspec.tree import DraftTree


class Target:
    def __init__(self, model) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = kv.new_cache(model)

    @property
    def length(self) -> int:
        """Tokens in the KV cache (the accepted sequence minus the root, which is not processed yet)."""
        return kv.cache_length(self.cache)

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """Process the prompt; returns the logits that predict the first new token, [V]."""
        self.cache = kv.new_cache(self.model)
        tokens = torch.tensor([prompt_ids], device=self.device)
        positions = torch.arange(len(prompt_ids), device=self.device)[None]
        out = kv.forward(self.model, self.cache, tokens, positions, logits_to_keep=1)
        return out.logits[0, -1].float()

    def verify(self, tree: DraftTree, want_hidden: bool = False):
        """One forward over every node of `tree`; returns (logits [n, V], last hidden states [n, d] or None)."""
        past = self.length
        self._tree_start = past
        out = kv.forward(
            self.model,
            self.cache,
            tree.tokens[None].to(self.device),
            tree.position_ids(past)[None].to(self.device),
            tree.attention_mask(past).to(self.device),
            want_hidden=want_hidden,
        )
        hidden = out.hidden_states[-1][0] if want_hidden else None
        return out.logits[0].float(), hidden

    def commit(self, kept_nodes: list[int]) -> None:
        """Keep the KV entries of `kept_nodes` (root first, then the accepted path) of the tree verified last;
        drop the rest of that tree."""
        kv.keep_entries(self.cache, self._tree_start, torch.tensor(kept_nodes, device=self.device))
