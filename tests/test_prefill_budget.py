"""The time budget for prompt tokens in a decode step (chunked prefill sized by measured step times): pure logic,
driven by synthetic step-time curves."""

from __future__ import annotations

import random

import pytest

from castspec.cli import main
from castspec.cli.serve import prefill_chunk
from castspec.costs.prefill import FIRST_TOKENS, RECENT, PrefillBudget, prefill_schedule
from castspec.errors import CastspecError


def settle(budget: PrefillBudget, step_s, steps: int = 40, noise: float = 0.0, seed: int = 0) -> list[int]:
    """Alternate decode steps alone and carrying steps, as a prompt joining a running batch does; returns the
    budget after each carrying step."""
    rng, seen = random.Random(seed), []
    for _ in range(steps):
        budget.observe(step_s(0) * (1 + rng.uniform(-noise, noise)), 0)
        tokens = budget.tokens
        budget.observe(step_s(tokens) * (1 + rng.uniform(-noise, noise)), tokens)
        seen.append(budget.tokens)
    return seen


@pytest.mark.parametrize("decode_s, token_s", [(0.30, 0.0038), (0.15, 0.009), (0.02, 0.0001)])
def test_a_linear_machine_gets_the_chunk_that_spends_the_slack(decode_s, token_s):
    budget = PrefillBudget(slack=1.75)
    assert budget.tokens == FIRST_TOKENS  # nothing measured yet
    seen = settle(budget, lambda k: decode_s + token_s * k)
    fits = 0.75 * decode_s / token_s
    assert abs(seen[-1] - fits) <= max(1.0, 0.02 * fits)
    assert decode_s + token_s * seen[-1] <= 1.75 * decode_s * 1.01


def test_tokens_that_ride_free_on_the_weights_read_are_taken_until_compute_costs_the_slack():
    # a bandwidth-bound step: the first 32 tokens cost nothing more, then 4 ms each
    budget = PrefillBudget(slack=2.0)
    seen = settle(budget, lambda k: 0.2 + 0.004 * max(k - 32, 0), steps=60)
    assert 0.2 + 0.004 * max(seen[-1] - 32, 0) <= 2.0 * 0.2 * 1.05
    assert seen[-1] >= 70  # (50 beyond the free 32 would spend it all)


def test_a_stall_moves_the_budget_by_a_factor_of_two_at_most_and_is_forgotten():
    budget = PrefillBudget(slack=1.75)
    seen = settle(budget, lambda k: 0.3 + 0.004 * k)
    budget.observe(100.0, budget.tokens)  # a stall (another process took the cores)
    assert budget.tokens >= seen[-1] // 2
    assert settle(budget, lambda k: 0.3 + 0.004 * k, steps=RECENT)[-1] == seen[-1]


def test_the_budget_never_drops_below_one_token_and_tokens_always_cost_something():
    budget = PrefillBudget(slack=1.75)
    for _ in range(20):
        budget.observe(0.1, 0)
        budget.observe(100.0, budget.tokens)
    assert budget.tokens == 1
    for _ in range(20):
        budget.observe(0.1, 0)
        budget.observe(0.1, budget.tokens)  # as fast as a decode step alone: a thousandth of one a token
    assert budget.tokens == 750


def test_noisy_steps_keep_the_carrying_step_near_the_slack():
    budget = PrefillBudget(slack=1.75)
    seen = settle(budget, lambda k: 0.3 + 0.004 * k, steps=200, noise=0.15, seed=3)
    tail = seen[100:]
    assert 0.5 * 56 <= sum(tail) / len(tail) <= 1.5 * 56  # 0.75 * 0.3 / 0.004 = 56


def test_nothing_is_learnt_before_a_decode_step_alone_was_timed():
    budget = PrefillBudget()
    budget.observe(1.0, 16)
    assert budget.token_s is None and budget.tokens == FIRST_TOKENS
    assert "nothing measured yet" in budget.describe()


@pytest.mark.parametrize("slack", [1.0, 0.5, True, "2"])
def test_a_slack_that_leaves_no_room_for_prompt_tokens_is_refused(slack):
    with pytest.raises(CastspecError, match="slack"):
        PrefillBudget(slack)


def test_serve_refuses_a_prefill_chunk_that_is_neither_a_count_nor_auto(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "smollm2-135m", "--prefill-chunk", "soon"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "a number of tokens >= 0 or 'auto', got 'soon'" in err
    assert [prefill_chunk(text) for text in ("auto", "0", "64")] == ["auto", 0, 64]


def test_every_shell_reads_the_chunk_option_the_same_way():
    budget = PrefillBudget(2.0)
    assert prefill_schedule(None) is None and prefill_schedule(0) is None and prefill_schedule(64) == 64
    assert prefill_schedule(budget) is budget
    made = prefill_schedule("auto", 1.25)
    assert isinstance(made, PrefillBudget) and made.slack == 1.25
    for bad in ("soon", "64", -1, 1.5, True):
        with pytest.raises(CastspecError, match="prefill chunk is a number of tokens"):
            prefill_schedule(bad)
    with pytest.raises(CastspecError, match="prefill slack"):
        prefill_schedule(64, 1.0)  # a bad slack is refused whatever the chunk, as the CLI reads both at once


def test_a_carrying_step_is_compared_with_decode_steps_of_its_own_batch_size():
    # one row decodes in 0.2 s, three in 0.5 s (say, CAST's trees); a prompt joins the three at 5 ms a token
    budget = PrefillBudget(slack=1.5)
    for _ in range(5):
        budget.observe(0.2, 0, rows=1)
        budget.observe(0.5, 0, rows=3)
    settle_at_three = [budget.observe(0.5, 0, rows=3) or budget.observe(0.5 + 0.005 * budget.tokens,
                                                                         budget.tokens, rows=3)
                       or budget.tokens for _ in range(30)]
    # 0.5 * 0.5 s / 5 ms; against one row's 0.2 s the three rows' own extra 0.3 s would be priced as prompt tokens
    assert settle_at_three[-1] == 50
    assert budget.decode_seconds(2) == 0.2 and budget.decode_seconds(8) == 0.5  # the nearest timed (ties: fewer)


def test_a_prompt_that_costs_at_most_at_once_decode_steps_goes_whole_a_longer_one_by_chunks():
    budget = PrefillBudget(slack=1.5, at_once=8)
    assert budget.budget(100, rows=3) == 0  # no decode step alone timed: one without prompt tokens first
    budget.observe(0.125, 0, rows=3)
    assert budget.budget(100, rows=3) == FIRST_TOKENS  # the price of a token not known yet: a chunk
    settle(budget, lambda k: 0.125 + 0.005 * k)  # a 125 ms decode step, 5 ms a prompt token: chunks of 12
    assert budget.tokens == 12
    assert budget.budget(195, rows=1) == 195  # 0.975 s: under 8 decode steps (200 tokens)
    assert budget.budget(205, rows=1) == 12
    assert budget.budget(5, rows=1) == 12  # never less than the chunk
    assert budget.budget(150, rows=1, uncached=2000) == 12  # the tail of a long prompt: still a chunk
    assert budget.budget(150, rows=1, uncached=160) == 150  # a short prompt after a first chunk: the rest at once
    assert f"prompts of up to {int(8 * 0.125 / budget.token_s)} at once" in budget.describe()
    never_whole = PrefillBudget(at_once=0)
    never_whole.observe(0.125, 0)
    assert never_whole.budget(1, rows=1) == FIRST_TOKENS


def test_a_prompt_taken_at_once_is_priced_at_its_own_cost_not_cut_as_a_stall():
    budget = PrefillBudget(slack=1.5, at_once=8)
    settle(budget, lambda k: 0.125 + 0.005 * k)
    budget.observe(0.125, 0)
    budget.observe(0.125 + 0.005 * 180, 180)  # 180 tokens at once: 7.2 decode steps added, as priced
    assert budget.token_s == pytest.approx(0.005)
    budget.observe(0.125 + 0.05 * 180, 180)  # ten times what was priced: a stall, counted as four times that
    assert budget.token_s < 0.005 * 4


@pytest.mark.parametrize("at_once", [-1, True, "8"])
def test_an_at_once_that_is_not_a_count_of_decode_steps_is_refused(at_once):
    with pytest.raises(CastspecError, match="prefill at once"):
        prefill_schedule("auto", 1.5, at_once)
    assert prefill_schedule("auto", 1.5, 3).at_once == 3.0
