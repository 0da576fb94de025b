"""Sampling parameters and the one logits transform both the AR and the speculative paths apply.

The transform follows `transformers`' generate order and tie rules (temperature, then top-k keeping ties at the
k-th value, then top-p keeping the smallest head whose mass reaches top_p), so plain sampling here is distributed
exactly as `generate(do_sample=True, ...)` with the same settings."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from castspec.errors import CastspecError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None

    def __post_init__(self) -> None:
        t, p, k = self.temperature, self.top_p, self.top_k
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise CastspecError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(p, bool) or not isinstance(p, int | float) or not (0 < p <= 1):
            raise CastspecError(f"top_p must be in (0, 1], got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise CastspecError(f"top_k must be an integer >= 0 (0 = no cut), got {k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise CastspecError(f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        """A CPU generator: seeded when a seed is given, so that the same seed repeats the same output."""
        gen = torch.Generator()
        if self.seed is not None:
            gen.manual_seed(self.seed)
        else:
            gen.seed()
        return gen


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [..., V] that plain sampling with `params` draws the next token from (fp32)."""
    if params.greedy:
        raise CastspecError("greedy decoding has no sampling distribution; use temperature > 0")
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = scores.topk(params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1:
        ascending, order = scores.sort(dim=-1)
        drop = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - params.top_p
        drop[..., -1] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return scores.softmax(dim=-1)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a distribution [V] (the generator lives on the CPU, so the draw does too)."""
    return int(torch.multinomial(probs.detach().float().cpu(), 1, generator=generator))
