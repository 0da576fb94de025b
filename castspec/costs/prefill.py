"""How many prompt tokens a decode step may carry while other requests run (chunked prefill, issue 39).

A joining prompt's tokens ride in the running rows' forward, so every token added to a step delays the running
requests' next tokens. A fixed chunk is right on one machine only: on a CPU with matrix units 64 prompt tokens
cost about a decode step (bench/prefix-cache, AMX Xeon), on one without them the same 64 cost several. The budget
here is a time, not a count: a step carrying prompt tokens should take at most `slack` times a decode step alone,
and the count that fits is learnt from this engine's own steps."""

from __future__ import annotations

import statistics
from collections import deque

from castspec.errors import CastspecError

PREFILL_SLACK = 1.5  # a step carrying prompt tokens takes at most this many decode steps (issue 39: ITL p99 < 2x)
FIRST_TOKENS = 16  # before anything is measured
MAX_TOKENS = 8192
MIN_TOKEN_SHARE = 1e-3  # of a decode step: the least a prompt token is priced at
RECENT = 9  # timings each estimate is the median of: a stall (another process took the cores) is one of them


class PrefillBudget:
    """Prompt tokens per step while rows decode, sized so that such a step takes at most `slack` times a decode
    step without them. It keeps two estimates from the engine's recent steps, each the median of its last few
    timings: the seconds of a decode step alone, and the seconds each prompt token adds to one (a carrying step's
    time less the decode step's, per token). Measured at the budget it sets, the price per token includes whatever
    the current chunk size costs (few tokens ride nearly free on the weights a decode step reads anyway; many are
    compute-bound), so the budget settles where the slack is spent. One step moves it by at most a factor of two,
    so one noisy timing cannot swing it."""

    def __init__(self, slack: float = PREFILL_SLACK, first: int = FIRST_TOKENS) -> None:
        if isinstance(slack, bool) or not isinstance(slack, int | float) or not slack > 1:
            raise CastspecError(f"the prefill slack must be a number above 1 (a carrying step's time in decode "
                                f"steps), got {slack!r}")
        self.slack = float(slack)
        self._decode: deque[float] = deque(maxlen=RECENT)  # decode steps without prompt tokens
        self._token: deque[float] = deque(maxlen=RECENT)  # what one prompt token added to a decode step
        self.tokens = first

    @property
    def decode_s(self) -> float | None:
        return statistics.median(self._decode) if self._decode else None

    @property
    def token_s(self) -> float | None:
        return statistics.median(self._token) if self._token else None

    def observe(self, seconds: float, prompt_tokens: int) -> None:
        """A decode step took `seconds` while carrying `prompt_tokens` prompt tokens (0: a plain decode step)."""
        if seconds <= 0:
            return
        if prompt_tokens == 0:
            self._decode.append(seconds)
            return
        decode_s = self.decode_s
        if decode_s is None:
            return
        # a carrying step as fast as the decode steps around it is noise: a token costs at least a thousandth of one
        self._token.append(max((seconds - decode_s) / prompt_tokens, MIN_TOKEN_SHARE * decode_s))
        fits = (self.slack - 1) * decode_s / self.token_s
        self.tokens = int(min(max(fits, self.tokens / 2, 1), self.tokens * 2, MAX_TOKENS))

    def describe(self) -> str:
        token_s, decode_s = self.token_s, self.decode_s
        if token_s is None or decode_s is None:
            return f"{self.tokens} prompt tokens a step (nothing measured yet; slack {self.slack:g})"
        return (f"{self.tokens} prompt tokens a step ({token_s * 1e3:.2f} ms each beside a {decode_s * 1e3:.0f} ms "
                f"decode step; slack {self.slack:g})")
