"""The target model's side of a decoding step, for a batch of sequences: prompts prefilled (by chunks, in the same
forward as the running rows' trees), one tree per running row verified, each row's accepted path committed.

Every row's KV is a slot of a `SlotCache`: its entries in position order with no holes, so a row's length is its
slot's fill and a column is a position. A forward packs the running rows' trees and the joining prompts' next
tokens into one ragged batch (`ragged.plan`): the weights are read once for both and no row is padded to another's
width. Prompts join as the bottom rows once prefilled; rows leave between steps and their slots are reused."""

from __future__ import annotations

import math

import torch

from castspec.decode import ragged
from castspec.decode.prefix_cache import PrefixHit
from castspec.decode.tree import DraftTree


class Prefill:
    """A prompt going into its slot: `done` of its tokens are in the cache (a prefix-cache hit's first, then the
    chunks prefilled so far); `first_logits` [V] predict its first output token once all are."""

    def __init__(self, slot: int, prompt: list[int], hit: PrefixHit | None) -> None:
        self.slot, self.prompt = slot, prompt
        self.done = hit.length if hit is not None else 0
        self.cached = self.done
        self.first_logits: torch.Tensor | None = None
        self.features: list[torch.Tensor] = []  # of its prompt tokens so far (with feature layers)
        self.hit_features = hit.features if hit is not None else None

    @property
    def left(self) -> int:
        return len(self.prompt) - self.done

    @property
    def complete(self) -> bool:
        return self.first_logits is not None


class Target:
    def __init__(self, model) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = ragged.SlotCache(model)
        self.slots: list[int] = []  # row i's slot
        self._taken: set[int] = set()  # slots of rows and of prompts being prefilled

    @property
    def rows(self) -> int:
        return len(self.slots)

    @property
    def lengths(self) -> list[int]:
        """Each row's committed tokens (the position of its next one)."""
        return [self.cache.fill[slot] for slot in self.slots]

    @property
    def length(self) -> int:
        """The longest row: the context a step's cost is read at."""
        return max(self.lengths, default=0)

    @property
    def max_positions(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    # ---- rows joining -------------------------------------------------------------------------------------------
    def prefill(self, prompts: list[list[int]], feature_layers: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Start afresh with the prompts (one per row); returns what `join_rows` returns."""
        self.keep_rows([])
        return self.add_rows(prompts, feature_layers)

    def add_rows(self, prompts: list[list[int]], feature_layers: tuple[int, ...] = (),
                 prefixes: list[PrefixHit | None] | None = None) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Prefill the prompts in one forward and append them as rows below the running ones."""
        prefills = self.start_rows(prompts, prefixes)
        self.forward([], prefills, None, feature_layers)
        return self.join_rows(prefills, feature_layers)

    def start_rows(self, prompts: list[list[int]], prefixes: list[PrefixHit | None] | None = None
                   ) -> list[Prefill]:
        """A slot for each prompt, holding its prefix-cache hit's entries (`prefixes[b]`, not computed again);
        `forward` prefills the rest, `join_rows` makes them rows."""
        prefills = []
        for prompt, hit in zip(prompts, prefixes or [None] * len(prompts), strict=True):
            slot = next(s for s in range(len(self._taken) + 1) if s not in self._taken)
            self._taken.add(slot)
            self.cache.ensure(slot + 1, 1)
            self.cache.fill[slot] = 0
            if hit is not None:
                self.cache.write_prefix(slot, hit.kv)
            prefills.append(Prefill(slot, prompt, hit))
        return prefills

    def join_rows(self, prefills: list[Prefill], feature_layers: tuple[int, ...] = ()
                  ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """The prefilled prompts become the bottom rows. Returns the logits that predict each one's first token
        [B', V] (float) and, with `feature_layers`, each one's features of its prompt tokens ([len(prompt), F])."""
        self.slots += [p.slot for p in prefills]
        features = None
        if feature_layers:
            features = []
            for p in prefills:
                mine = p.features
                if p.cached:
                    if p.hit_features is None:
                        raise ValueError("a prefix-cache hit without features for a drafter that reads them")
                    mine = [p.hit_features.to(self.device, mine[0].dtype), *mine]
                features.append(torch.cat(mine))
        return torch.stack([p.first_logits for p in prefills]), features

    def drop_prefills(self, prefills: list[Prefill]) -> None:
        """Prompts that will not join after all (aborted): their slots are free again."""
        for p in prefills:
            self._free(p.slot)

    def hold_rows(self, count: int, length: int) -> None:
        """Start afresh with `count` rows of `length` zero entries each (a cost probe times forwards after them)."""
        self.keep_rows([])
        self.cache.ensure(count, length + 1)
        self.cache.fill[:count] = [length] * count
        self.slots, self._taken = list(range(count)), set(range(count))

    # ---- a step -------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, trees: list[DraftTree], prefills: list[Prefill], budget: int | None,
                feature_layers: tuple[int, ...] = ()
                ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, int]:
        """One forward over every row's tree (row i: `trees[i]`) and the next prompt tokens of `prefills`, at most
        `budget` of them in all (None: all that are left), in order. Returns each row's logits [len(tree), V]
        (model dtype), with `feature_layers` its features [len(tree), F] (else None), and how many prompt tokens
        the forward carried; a prompt finished here gets its first logits, and its features are kept with it."""
        left = math.inf if budget is None else budget
        chunks = []
        for p in prefills:
            if p.complete or left <= 0:
                continue
            take = int(min(p.left, left))
            chunks.append((p, p.prompt[p.done: p.done + take]))
            left -= take
        tokens, positions, batch = ragged.plan(self.cache, list(zip(self.slots, trees, strict=True)),
                                        [(p.slot, chunk, p.done) for p, chunk in chunks], self.device)
        # logits for every tree node, and for the last token of each prompt this forward completes
        verified = sum(len(t) for t in trees)
        keep, end = list(range(verified)), verified
        for p, chunk in chunks:
            end += len(chunk)
            if p.done + len(chunk) == len(p.prompt):
                keep.append(end - 1)
        out = ragged.forward(self.model, self.cache, tokens, positions, batch,
                             torch.tensor(keep, dtype=torch.long, device=self.device), bool(feature_layers))
        features = join_features(out, feature_layers)[0] if feature_layers else None
        start, finished = verified, verified
        for p, chunk in chunks:
            if features is not None:
                p.features.append(features[start: start + len(chunk)])
            start += len(chunk)
            p.done += len(chunk)
            self.cache.fill[p.slot] = p.done
            if p.done == len(p.prompt):
                p.first_logits = out.logits[0, finished].float()
                finished += 1
        sizes = [len(t) for t in trees]
        logits = list(out.logits[0, :verified].split(sizes)) if trees else []
        row_features = list(features[:verified].split(sizes)) if features is not None and trees else None
        return logits, row_features, start - verified

    def verify(self, trees: list[DraftTree], feature_layers: tuple[int, ...] = ()
               ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """`forward` over the rows' trees alone."""
        logits, features, _ = self.forward(trees, [], 0, feature_layers)
        return logits, features

    def commit(self, kept_nodes: list[list[int]]) -> None:
        """Per row, keep the entries of `kept_nodes` (root first, then the accepted path) of the trees verified
        last, in order after its committed ones; drop the rest of those trees."""
        slots, sources, targets = [], [], []
        for slot, kept in zip(self.slots, kept_nodes, strict=True):
            fill = self.cache.fill[slot]
            for j, node in enumerate(kept):
                if node != j:
                    slots.append(slot)
                    sources.append(fill + node)
                    targets.append(fill + j)
            self.cache.fill[slot] = fill + len(kept)
        if slots:
            device = self.device
            self.cache.move(torch.tensor(slots, device=device), torch.tensor(sources, device=device),
                            torch.tensor(targets, device=device))

    def keep_rows(self, rows: list[int]) -> None:
        """Only `rows` go on (the others finished or left); their slots are free for newcomers."""
        kept = [self.slots[r] for r in rows]
        for slot in set(self.slots) - set(kept):
            self._free(slot)
        self.slots = kept

    def row_entries(self, row: int, tree_nodes: list[int] = ()) -> tuple[int, torch.Tensor]:
        """Row `row`'s committed KV entries in order, then those of `tree_nodes` of the tree verified last (not
        committed): (count, [layers, 2, kv_heads, count, head_dim])."""
        slot = self.slots[row]
        fill = self.cache.fill[slot]
        columns = torch.arange(fill)
        if tree_nodes:
            columns = torch.cat([columns, fill + torch.tensor(tree_nodes, dtype=torch.long)])
        return len(columns), self.cache.entries(slot, columns)

    def _free(self, slot: int) -> None:
        self._taken.discard(slot)
        if slot < self.cache.slots:
            self.cache.fill[slot] = 0
        if not self._taken:  # nothing left: give the memory back
            self.cache.release()
        else:
            longest = max(self.cache.fill[s] for s in self._taken)
            if self.cache.capacity > 4 * longest + 1024:  # a long request left: keep room for twice the rest
                self.cache.shrink_to(2 * longest)


def join_features(out, layers: tuple[int, ...]) -> torch.Tensor:
    """The hidden states of `layers` side by side (index -1: the last layer's, after the final norm)."""
    return torch.cat([out.hidden_states[i] for i in layers], dim=-1)
