"""A separate, smaller causal LM with the target's tokenizer as drafter.

Its KV cache always holds the accepted sequence up to and including the current root. `begin` absorbs the
newly accepted tokens in one causal forward whose last logits already give the root's children (the catch-up
and the first draft layer share one forward); each `expand` runs a whole frontier in one tree-masked forward
against the cache; `end_step` crops the tree's entries away again."""

from __future__ import annotations

import torch

from castspec.decode import kv
from castspec.decode.tree import TreePool
from castspec.drafters.base import Candidates, Drafter, empty_candidates, sampled_candidates, top_candidates
from castspec.errors import CastspecError


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

    def reset(self, batch_size: int = 1) -> None:
        self.cache = kv.new_cache(self.model)
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool)  # which cache columns hold a row's tokens
        self.lengths = [0] * batch_size  # tokens absorbed per row (the next one's position)
        self.base = 0  # cache columns up to this step's roots: where the trees' entries begin
        self.cached_nodes: list[dict[int, int]] = [{} for _ in range(batch_size)]  # pool node -> cache column

    def _paired(self, new_tokens: list[list[int]], features: list[torch.Tensor] | None) -> list[list[int]]:
        """The tokens this drafter absorbs (a feature-level head drops the one with no feature before it)."""
        return new_tokens

    @torch.inference_mode()
    def _run(self, tokens, positions, mask, features, last_only: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, the hidden states later nodes take as input, or None) of one forward against the cache."""
        out = kv.forward(self.model, self.cache, tokens, positions, mask, logits_to_keep=1 if last_only else 0)
        return out.logits, None

    def _remember_roots(self, hidden: torch.Tensor) -> None:
        """Keep what the roots' children will need as input ([B, d]; nothing, for a draft model)."""

    def _remember_frontier(self, frontiers: list[list[int]], hidden: torch.Tensor) -> None:
        """Keep what the frontier nodes' children will need ([B, width, d], slot i of row b = frontiers[b][i])."""

    def _frontier_features(self, pools: list[TreePool], frontiers: list[list[int]], width: int) -> torch.Tensor:
        """[B, width, d]: the input each frontier node takes besides its token (its parent's hidden state)."""
        raise NotImplementedError

    def begin(self, new_tokens: list[list[int]], top_k: int,
              features: list[torch.Tensor] | None = None) -> list[Candidates]:
        new_tokens = self._paired(new_tokens, features)
        # rows absorb different numbers of tokens: right-align them (holes on the left) so that the last column
        # is every row's root and one logits row per sequence suffices
        start, width, rows = kv.cache_length(self.cache), max(len(t) for t in new_tokens), len(new_tokens)
        holes = [width - len(new) for new in new_tokens]
        ids = torch.tensor([[0] * hole + list(new) for hole, new in zip(holes, new_tokens, strict=True)]
                           + [[0] * hole + list(range(self.lengths[row], self.lengths[row] + len(new)))
                              for row, (hole, new) in enumerate(zip(holes, new_tokens, strict=True))])
        tokens, positions = ids[:rows], ids[rows:]
        inputs = None if not self.feature_layers else torch.zeros(rows, width, features[0].shape[-1],
                                                                    dtype=features[0].dtype)
        for row, new in enumerate(new_tokens):
            if inputs is not None:
                inputs[row, holes[row]:] = features[row].cpu()
            self.lengths[row] += len(new)
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        chunk_valid = torch.tensor([[False] * hole + [True] * (width - hole) for hole in holes])
        mask = torch.cat([self.valid[:, None, :].expand(-1, width, -1), causal[None] & chunk_valid[:, None, :]], dim=2)
        if any(holes):  # a hole sees only itself (with none, always so at B = 1, the chunk is causal as it stands)
            mask &= chunk_valid[:, :, None]
            mask[:, :, start:] |= torch.eye(width, dtype=torch.bool)
        logits, hidden = self._run(tokens.to(self.device), positions.to(self.device), mask[:, None].to(self.device),
                                   None if inputs is None else inputs.to(self.device), last_only=True)
        self.valid = torch.cat([self.valid, chunk_valid], dim=1)
        self.base = start + width
        self.cached_nodes = [{0: self.base - 1} for _ in range(rows)]
        if hidden is not None:
            self._remember_roots(hidden[:, -1])
        return _split(self._candidates(logits[:, -1], top_k))

    def expand(self, pools: list[TreePool], frontiers: list[list[int]], top_k: int) -> list[Candidates]:
        past, width = kv.cache_length(self.cache), max(len(f) for f in frontiers)
        if width == 0:
            return [empty_candidates(top_k) for _ in frontiers]
        rows, tree_columns = len(frontiers), past - self.base + width
        # the inputs as Python lists, turned into tensors in two calls: a layer has a few dozen slots, and on so few
        # the dispatch of a dozen small indexed writes into a mask cost more than the lists (~0.1 ms a layer)
        tokens, positions, seen = [[0] * width for _ in range(rows)], [[0] * width for _ in range(rows)], []
        for row, (pool, frontier) in enumerate(zip(pools, frontiers, strict=True)):
            columns, row_seen = self.cached_nodes[row], []
            for i in range(width):  # a slot sees its ancestors' tree entries and itself; padding slots only themselves
                slot_seen = [False] * tree_columns
                slot_seen[past - self.base + i] = True
                if i < len(frontier):
                    node = frontier[i]
                    tokens[row][i] = pool.tokens[node]
                    positions[row][i] = self.lengths[row] - 1 + pool.depths[node]
                    for ancestor in pool.path_to(node)[:-1]:
                        slot_seen[columns[ancestor] - self.base] = True
                    columns[node] = past + i
                row_seen.append(slot_seen)
            seen.append(row_seen)
        # every real slot sees its row's accepted prefix
        prefix = self.valid[:, None, : self.base].expand(rows, width, self.base)
        if any(len(f) < width for f in frontiers):
            prefix = prefix & torch.tensor([[i < len(f) for i in range(width)] for f in frontiers])[:, :, None]
        mask = torch.cat([prefix, torch.tensor(seen, dtype=torch.bool).reshape(rows, width, tree_columns)], dim=2)
        inputs = torch.tensor([tokens, positions], device=self.device)
        features = self._frontier_features(pools, frontiers, width) if self.feature_layers else None
        logits, hidden = self._run(inputs[0], inputs[1], mask[:, None].to(self.device), features, last_only=False)
        if hidden is not None:
            self._remember_frontier(frontiers, hidden)
        cands = self._candidates(logits, top_k)
        return [Candidates(cands.tokens[row, : len(f)], cands.probs[row, : len(f)],
                           None if cands.proposal is None else cands.proposal[row, : len(f)])
                for row, f in enumerate(frontiers)]

    def end_step(self) -> None:
        kv.crop(self.cache, self.base)
        if kv.needs_compaction(self.valid):
            self.valid = kv.compact(self.cache, self.valid)

    def keep_rows(self, rows: list[int]) -> None:
        if not rows:
            self.reset(0)
            return
        kv.keep_rows(self.cache, torch.tensor(rows, dtype=torch.long, device=self.device))
        self.valid = self.valid[torch.tensor(rows, dtype=torch.long)]
        self.lengths = [self.lengths[r] for r in rows]
        self.cached_nodes = [self.cached_nodes[r] for r in rows]

    def add_rows(self, count: int) -> None:
        self.cache, self.valid = kv.append_rows(self.cache, self.valid, None, torch.zeros(count, 0, dtype=torch.bool))
        self.lengths += [0] * count
        self.cached_nodes += [{} for _ in range(count)]


def _split(cands: Candidates) -> list[Candidates]:
    """[B, k] candidates -> one single-row Candidates per batch row."""
    return [Candidates(cands.tokens[row: row + 1], cands.probs[row: row + 1],
                       None if cands.proposal is None else cands.proposal[row: row + 1])
            for row in range(cands.tokens.shape[0])]
