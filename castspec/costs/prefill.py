"""How many prompt tokens a decode step may carry while other requests run (chunked prefill, issue 39).

A joining prompt's tokens ride in the running rows' forward, so every token added to a step delays the running
requests' next tokens. A fixed chunk is right on one machine only: on a CPU with matrix units 64 prompt tokens
cost about a decode step (bench/prefix-cache, AMX Xeon), on one without them the same 64 cost several. The budget
here is a time, not a count: a step carrying prompt tokens should take at most `slack` times a decode step alone,
and the count that fits is learnt from this engine's own steps.

Chunks have a price besides the running rows' latency: the joining row decodes nothing until its prompt is done,
so a prompt spread over many steps leaves a place in the batch idle for all of them. On the 2-core EPYC a prompt
token in a decode step cost ~5 ms beside a 127 ms step, so slack 1.5 carried ~13 tokens a step and a 150-token
prompt joined over ~10 steps; with four clients that made 356 steps of 3.2 rows where whole prompts made ~300
steps, 17.1 against 21.0 tok/s (bench/serve-load/prefill-schedule-cold-*). So a prompt that costs at most
`at_once` decode steps is prefilled in one step (one gap of that length, as vLLM's whole-prompt prefill gives);
longer prompts (the 2k-token one of issue 39's latency bar) still go by chunks within the slack. A first default of
8 steps still left prompts of 250-500 tokens to 25-40 chunks of ~10 tokens in a fast phase of the machine (95 ms
decode steps), with castspec's AR at 0.79x vLLM at four clients (bench/peer-vllm/interleaved-cold-c4-fixed-*)."""

from __future__ import annotations

import statistics
from collections import deque

from castspec.errors import CastspecError

PREFILL_SLACK = 1.5  # a step carrying prompt tokens takes at most this many decode steps (issue 39: ITL p99 < 2x)
PREFILL_AT_ONCE = 32.0  # a prompt that costs at most this many decode steps joins in one step: on the EPYC the
# benchmark's prompts (up to ~500 tokens, 20-30 steps) go whole, a 2k-token one (80-120 steps) by chunks
FIRST_TOKENS = 16  # before anything is measured
MAX_TOKENS = 8192
MIN_TOKEN_SHARE = 1e-3  # of a decode step: the least a prompt token is priced at
STALL = 4  # a carrying step's added time counts as at most this many times what the slack allows
RECENT = 9  # steps each estimate reads: a stall (another process took the cores) is one of them


class PrefillBudget:
    """Prompt tokens per step while rows decode, sized so that such a step takes at most `slack` times a decode
    step without them. It keeps two estimates from the engine's recent steps: the seconds of a decode step alone
    at each batch size (the median of the last few: a CAST step over 4 rows is not one over 1), and the seconds
    each prompt token adds to one (the last few carrying steps' times less a decode step's at their batch size,
    over the tokens they carried). Measured at the budget it sets, the price per token includes whatever the
    current chunk size costs (few tokens ride nearly free on the weights a decode step reads anyway; many are
    compute-bound), so the budget settles where the slack is spent. One step moves it by at most a factor of two,
    so one noisy timing cannot swing it."""

    def __init__(self, slack: float = PREFILL_SLACK, first: int = FIRST_TOKENS,
                 at_once: float = PREFILL_AT_ONCE) -> None:
        self.slack = check_slack(slack)
        self.at_once = check_at_once(at_once)
        self._decode: dict[int, deque[float]] = {}  # per batch size, its decode steps without prompt tokens
        self._carried: deque[tuple[float, int]] = deque(maxlen=RECENT)  # (seconds added, tokens) of carrying steps
        self._latest_decode_s: float | None = None  # a decode step's seconds at the latest carrying step's rows
        self.tokens = first

    def decode_seconds(self, rows: int) -> float | None:
        """A decode step's seconds at `rows` rows (or the nearest batch size timed; None before any)."""
        if not self._decode:
            return None
        nearest = min(self._decode, key=lambda timed: (abs(timed - rows), timed))
        return statistics.median(self._decode[nearest])

    @property
    def token_s(self) -> float | None:
        """Seconds added over tokens carried, summed over the recent carrying steps: a step of a few tokens
        weighs little, so the step-to-step noise of the decode part (a CAST tree's size changes every step)
        cannot price a token at the whole noise, which per-step ratios did when the chunk got small."""
        if not self._carried:
            return None
        return sum(added for added, _ in self._carried) / sum(tokens for _, tokens in self._carried)

    def observe(self, seconds: float, prompt_tokens: int, rows: int = 1) -> None:
        """A decode step over `rows` rows took `seconds` while carrying `prompt_tokens` prompt tokens (0: a plain
        decode step)."""
        if seconds <= 0:
            return
        if prompt_tokens == 0:
            self._decode.setdefault(rows, deque(maxlen=RECENT)).append(seconds)
            return
        decode_s = self.decode_seconds(rows)
        if decode_s is None:
            return
        self._latest_decode_s = decode_s
        # a carrying step as fast as the decode steps around it is noise: a token costs at least a thousandth of one;
        # one far slower (a stall: another process took the cores) counts as STALL times what was meant for it (the
        # slack's room, or a prompt taken at once: its tokens at the price known so far)
        meant = (self.slack - 1) * decode_s
        if self.token_s is not None:
            meant = max(meant, prompt_tokens * self.token_s)
        added = min(max(seconds - decode_s, MIN_TOKEN_SHARE * decode_s * prompt_tokens), STALL * meant)
        self._carried.append((added, prompt_tokens))
        fits = (self.slack - 1) * decode_s / self.token_s
        self.tokens = int(min(max(fits, self.tokens / 2, 1), self.tokens * 2, MAX_TOKENS))

    def budget(self, left: int, rows: int, uncached: int | None = None) -> int:
        """Prompt tokens the next step over `rows` decoding rows may carry, the first joining prompt having `left`
        tokens to go of the `uncached` (default `left`) it prefills in all: the `left` when all `uncached` cost at
        most `at_once` decode steps at the price learnt so far (the joining row then decodes from the next step
        on), else the chunk that keeps the step within the slack; none before a decode step alone has been timed.
        A long prompt's last chunks stay chunks: its tail taken at once would be one long step after all."""
        token_s, decode_s = self.token_s, self.decode_seconds(rows)
        if decode_s is None:
            # no decode step alone timed yet (requests arriving together, each joining while the first decodes):
            # one step without prompt tokens, so that the next one's chunk can be priced and short prompts go whole
            # after that (a trace at 4 clients otherwise carried chunks of 16 for the first 25 steps)
            return 0
        if token_s is not None and (left if uncached is None else uncached) * token_s <= self.at_once * decode_s:
            return max(left, self.tokens)
        return self.tokens

    def describe(self) -> str:
        token_s, decode_s = self.token_s, self._latest_decode_s
        if token_s is None or decode_s is None:
            return f"{self.tokens} prompt tokens a step (nothing measured yet; slack {self.slack:g})"
        return (f"{self.tokens} prompt tokens a step ({token_s * 1e3:.2f} ms each beside a {decode_s * 1e3:.0f} ms "
                f"decode step; slack {self.slack:g}), prompts of up to "
                f"{int(self.at_once * decode_s / token_s)} at once")


def check_slack(slack: float) -> float:
    if isinstance(slack, bool) or not isinstance(slack, int | float) or not slack > 1:
        raise CastspecError(f"the prefill slack must be a number above 1 (a carrying step's time in decode steps), "
                            f"got {slack!r}")
    return float(slack)


def check_at_once(at_once: float) -> float:
    if isinstance(at_once, bool) or not isinstance(at_once, int | float) or not at_once >= 0:
        raise CastspecError(f"prefill at once is a number of decode steps >= 0 (0: every prompt by chunks), got "
                            f"{at_once!r}")
    return float(at_once)


def prefill_schedule(chunk: int | str | PrefillBudget | None, slack: float = PREFILL_SLACK,
                     at_once: float = PREFILL_AT_ONCE) -> int | PrefillBudget | None:
    """What a stepping engine prefills per step while rows decode, from what a user asked for: None or 0 (a
    joining prompt at once) -> None; a positive count of tokens -> that count; 'auto' -> a PrefillBudget with
    `slack` and `at_once`; a PrefillBudget -> itself. Anything else is refused in one line (the CLI, the library
    and Ray replicas all read the options through here)."""
    check_slack(slack)
    check_at_once(at_once)
    if chunk is None or isinstance(chunk, PrefillBudget):
        return chunk
    if chunk == "auto":
        return PrefillBudget(slack, at_once=at_once)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise CastspecError(f"the prefill chunk is a number of tokens >= 0 (0: a prompt at once) or 'auto', got "
                            f"{chunk!r}")
    return chunk or None
