"""A separate, smaller causal LM with the target's tokenizer as drafter.

Its KV cache always holds the accepted sequence up to and including the current root. `begin` absorbs the
newly accepted tokens in one causal forward whose last logits already give the root's children (the catch-up
and the first draft layer share one forward); each `expand` runs a whole frontier in one tree-masked forward
against the cache; `end_step` crops the tree's entries away again."""

from __future__ import annotations

import torch

from castspec import kv
from castspec.drafters.base import Candidates, Drafter, sampled_candidates, top_candidates
from castspec.errors import CastspecError
from castspec.tree import DraftTree


def check_compatible(target_model, target_tokenizer, draft_model, draft_tokenizer) -> None:
    """Refuse a draft whose token ids would mean something else to the target."""
    t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if t_vocab != d_vocab:
        only_t = len(set(t_vocab) - set(d_vocab))
        only_d = len(set(d_vocab) - set(t_vocab))
        raise CastspecError(
            f"the draft model's tokenizer differs from the target's ({len(d_vocab)} vs {len(t_vocab)} tokens; "
            f"{only_t} only in the target, {only_d} only in the draft): a draft model must share the tokenizer"
        )
    t_rows = target_model.get_output_embeddings().weight.shape[0]
    d_rows = draft_model.get_output_embeddings().weight.shape[0]
    if d_rows > t_rows:
        raise CastspecError(f"the draft model predicts {d_rows} token ids, the target only {t_rows}")


class DraftModelDrafter(Drafter):
    name = "draft-model"

    def __init__(self, model) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.reset()

    def sample_candidates(self, params, generator) -> None:
        self.sampling = (params, generator) if params is not None and not params.greedy else None

    def _candidates(self, logits: torch.Tensor, top_k: int) -> Candidates:
        if self.sampling is None:
            return top_candidates(logits, top_k)
        return sampled_candidates(logits, top_k, *self.sampling)

    def reset(self) -> None:
        self.cache = kv.new_cache(self.model)
        self.base = 0  # cache length with the root included: where this step's tree entries begin
        self.cached_nodes: dict[int, int] = {}  # pool node -> its column in the cache

    def begin(self, new_tokens: list[int], top_k: int) -> Candidates:
        start = kv.cache_length(self.cache)
        tokens = torch.tensor([new_tokens], device=self.device)
        positions = torch.arange(start, start + len(new_tokens), device=self.device)[None]
        out = kv.forward(self.model, self.cache, tokens, positions, logits_to_keep=1)
        self.base = start + len(new_tokens)
        self.cached_nodes = {0: self.base - 1}
        return self._candidates(out.logits[0, -1:], top_k)

    def expand(self, pool: DraftTree, frontier: list[int], top_k: int) -> Candidates:
        past = kv.cache_length(self.cache)
        n = len(frontier)
        mask = torch.zeros(n, past + n, dtype=torch.bool)
        mask[:, : self.base] = True
        for row, node in enumerate(frontier):
            for ancestor in pool.path_to(node)[:-1]:
                mask[row, self.cached_nodes[ancestor]] = True
            mask[row, past + row] = True
        root_position = self.base - 1
        positions = pool.depths[frontier] + root_position
        out = kv.forward(
            self.model,
            self.cache,
            pool.tokens[frontier][None].to(self.device),
            positions[None].to(self.device),
            mask[None, None].to(self.device),
        )
        for row, node in enumerate(frontier):
            self.cached_nodes[node] = past + row
        return self._candidates(out.logits[0], top_k)

    def end_step(self) -> None:
        kv.crop(self.cache, self.base)
