"""The drafter interface: everything the tree-growing loop needs from a drafter, nothing more."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from castspec.decode.sampling import SamplingParams, warp
from castspec.decode.tree import TreePool
from castspec.errors import CastspecError


@dataclass(frozen=True)
class Candidates:
    """The children proposed for each expanded node: row i belongs to the i-th node of the frontier.
    A probability of 0 marks an empty slot (an n-gram drafter may have fewer than k proposals).
    Deterministic drafting gives each row's best tokens, best first. Sampled drafting gives tokens drawn without
    replacement from `proposal` (row i's distribution [V]), in draw order; verification then needs `proposal`."""

    tokens: torch.Tensor  # [F, k] int64
    probs: torch.Tensor  # [F, k] float32
    proposal: torch.Tensor | None = None  # [F, V] when sampled
    # a lookup drafter's match length per row: how many tokens, up to and including the node, its context (sequence
    # + the node's path) agrees on with the earlier text it proposes from (capped at MATCH_CAP). How sure such a
    # guess is depends on it far more than on the tree depth: a 2-token match is a coin toss, a 16-token one a
    # copy (bench/regret). None: a model drafter, whose nodes are calibrated by depth.
    matched: list[int] | None = None


# longer matches are copies alike: after a 16-token match the target took 463 of 466 next tokens of 32 MT-bench /
# HumanEval / GSM8K / repetitive answers, after a 2-3 token one 146 of 272 (bench/regret/README.md)
MATCH_CAP = 16


def top_candidates(logits: torch.Tensor, k: int) -> Candidates:
    """The k likeliest tokens per row and their probabilities. The top-k is taken on the logits and only those
    k are normalised (by the row's logsumexp): a softmax over the whole vocabulary would write V floats per row."""
    logits = logits.float()
    top = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return Candidates(top.indices, (top.values - logits.logsumexp(dim=-1, keepdim=True)).exp())


def sampled_candidates(logits: torch.Tensor, k: int, params: SamplingParams, generator: torch.Generator
                       ) -> Candidates:
    """k tokens per row drawn without replacement from the warped draft distribution q, in draw order.
    Gumbel-top-k: the k largest of log q + Gumbel noise are a draw without replacement, largest first."""
    q = warp(logits, params)
    uniform = torch.rand(q.shape, generator=generator).clamp(min=1e-20).to(q.device)
    keys = q.log() - (-uniform.log()).log()
    tokens = keys.topk(min(k, q.shape[-1]), dim=-1).indices
    return Candidates(tokens, q.gather(-1, tokens), q)


class Drafter(ABC):
    """A drafter follows a batch of sequences (one row each). Per decoding step the loop calls `begin` once with
    each row's tokens accepted since the previous step (the last of them is the row's new root), then `expand`
    once per further draft layer, then `end_step`, after which the drafter holds no trace of the rejected trees.
    Row-wise lists throughout: results[b] belongs to row b."""

    name: str = "drafter"
    sampling: tuple[SamplingParams, torch.Generator] | None = None  # set: draw candidates instead of top-k
    # target hidden-state layers the drafter reads (empty: tokens only); with them, `begin` receives, per row and
    # per new token, the target's features at the position before that token (the very first token has none)
    feature_layers: tuple[int, ...] = ()

    def sample_candidates(self, params: SamplingParams | None, generator: torch.Generator | None) -> None:
        """Draw candidates from the drafter's own distribution (warped like the target's) instead of taking
        its top-k; `None` (or greedy params) switches back to top-k."""
        if params is not None and not params.greedy:
            raise CastspecError(f"the {self.name} drafter proposes deterministically; sampled drafting needs a "
                                "draft model")
        self.sampling = None

    @abstractmethod
    def reset(self, batch_size: int = 1) -> None:
        """Forget everything: the next `begin` receives each row's whole prompt."""

    @abstractmethod
    def begin(self, new_tokens: list[list[int]], top_k: int,
              features: list[torch.Tensor] | None = None) -> list[Candidates]:
        """Absorb each row's newly accepted tokens and propose its root's children (one candidate row each)."""

    @abstractmethod
    def expand(self, pools: list[TreePool], frontiers: list[list[int]], top_k: int) -> list[Candidates]:
        """Propose children for each row's `frontiers[b]` nodes of `pools[b]` (one candidate row per node, in
        frontier order; a row with an empty frontier gets empty candidates)."""

    def end_step(self) -> None:  # noqa: B027 - stateless drafters need nothing here
        """Drop whatever the drafter kept of the current trees."""

    @abstractmethod
    def keep_rows(self, rows: list[int]) -> None:
        """Only `rows` go on (the others finished); called between steps."""

    @abstractmethod
    def add_rows(self, count: int) -> None:
        """`count` new rows join below the others, between steps; their next `begin` brings their whole prompt."""

    @property
    def can_share(self) -> bool:
        """Whether `set_sharing` can turn sharing on (the drafter keeps a history shared between requests)."""
        return False

    def set_sharing(self, rows: list[int], share: list[bool]) -> None:
        """Per-request opt-in, right after `add_rows`: rows whose flag is set read what earlier requests
        produced and add their own output when they finish (a drafter with a shared history: the suffix drafter
        with a shared tree)."""
        if any(share):
            raise CastspecError(f"the {self.name} drafter keeps no history shared between requests (the suffix "
                                "drafter with a shared tree does: --drafter suffix --suffix-shared-tokens N)")


def empty_candidates(top_k: int) -> Candidates:
    return Candidates(torch.zeros(0, top_k, dtype=torch.long), torch.zeros(0, top_k))
