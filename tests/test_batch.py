"""Batched decoding, fp32, real weights: every row is exactly what that prompt gives alone (HF greedy), for every
method and drafter, with prompts of very different lengths and rows that finish at different times."""

from __future__ import annotations

import pytest
import torch
from synthetic import flat_costs
from test_exactness import PROMPTS

from castspec import Engine
from castspec.decode.engine import StopCondition, decode
from castspec.decode.target import Target
from castspec.drafters.draft_model import DraftModelDrafter
from castspec.drafters.ngram import NgramDrafter
from castspec.errors import CastspecError
from castspec.policies.base import ChainPolicy, Eagle2Policy
from castspec.policies.cast import CastPolicy

LONG = ("Here is a long piece of context that the model has to read before it can answer. " * 6
        + "In short, the point is that")
BATCH = ["Hello", PROMPTS[1], LONG, PROMPTS[11]]  # 1 token up to ~100 tokens, code, prose, repetition
NEW_TOKENS = 20


def batch_engines(model, tokenizer):
    yield "ar", Engine(model, tokenizer)
    yield "chain-draft", Engine(model, tokenizer, DraftModelDrafter(model), ChainPolicy(3))
    yield "eagle2-draft", Engine(model, tokenizer, DraftModelDrafter(model), Eagle2Policy(3, 3, 10))
    yield "eagle2-ngram", Engine(model, tokenizer, NgramDrafter(), Eagle2Policy(4, 4, 12))
    yield "cast-paper-draft", Engine(model, tokenizer, DraftModelDrafter(model), CastPolicy(flat_costs(), 4.0, 3.0,
                                                                                              2.5))
    yield "cast-auto-ngram", Engine(model, tokenizer, NgramDrafter(), CastPolicy(flat_costs(), auto=True))


@pytest.mark.parametrize("method", ["ar", "chain-draft", "eagle2-draft", "eagle2-ngram", "cast-paper-draft",
                                    "cast-auto-ngram"])
def test_every_row_equals_its_prompt_alone(smollm, smollm_reference, method):
    model, tokenizer = smollm
    engine = dict(batch_engines(model, tokenizer))[method]
    ids = [engine.encode(prompt=p) for p in BATCH]
    assert len(ids[0]) == 1 and len(ids[2]) > 80
    rows = engine.generate_batch(prompt_ids=ids, max_new_tokens=NEW_TOKENS)
    for row, prompt_ids in zip(rows, ids, strict=True):
        assert row.output_ids == smollm_reference(tuple(prompt_ids), NEW_TOKENS), method
    if method != "ar":
        assert any(step.accepted > 1 for row in rows for step in row.steps)


def test_rows_that_finish_at_different_times(smollm, smollm_reference):
    """Different budgets per row (and a stop string) end rows mid-batch; the rest go on unchanged."""
    model, tokenizer = smollm
    engine = Engine(model, tokenizer, DraftModelDrafter(model), Eagle2Policy(3, 3, 10))
    ids = [engine.encode(prompt=p) for p in [PROMPTS[10], PROMPTS[0], LONG, PROMPTS[5]]]
    budgets = [3, 17, 9, 1]
    stops = [StopCondition(n, engine.eos_ids, [], tokenizer) for n in budgets]
    with torch.inference_mode():
        outputs, steps = decode(Target(model), engine.drafter, engine.policy, ids, stops)
    for out, prompt_ids, n in zip(outputs, ids, budgets, strict=True):
        assert out == smollm_reference(tuple(prompt_ids), n)
    assert [len(s) for s in steps][3] == 0  # a row done after its prefill token never runs a step
    stopped = engine.generate_batch(prompt_ids=[ids[0], ids[1]], max_new_tokens=NEW_TOKENS, stop=[" 11"])
    assert tokenizer.decode(stopped[0].output_ids).rstrip().endswith("11") and stopped[0].stop_reason == "stop_string"
    alone = engine.generate(prompt_ids=ids[1], max_new_tokens=NEW_TOKENS, stop=[" 11"])
    assert stopped[1].output_ids == alone.output_ids


def test_identical_draft_accepts_whole_chains_in_a_batch(smollm):
    """SmolLM2 drafting for itself: with the batched draft cache, masks and positions right, the draft's chain is
    the target's own greedy continuation, so (near-ties apart) every step accepts the whole chain."""
    model, tokenizer = smollm
    engine = Engine(model, tokenizer, DraftModelDrafter(model), ChainPolicy(4))
    rows = engine.generate_batch(prompts=BATCH, max_new_tokens=NEW_TOKENS)
    full = [s.accepted == 5 for row in rows for s in row.steps[:-1]]
    assert sum(full) >= 0.8 * len(full), full


def test_batch_input_errors(smollm):
    model, tokenizer = smollm
    engine = Engine(model, tokenizer)
    with pytest.raises(CastspecError, match="non-empty list"):
        engine.generate_batch(prompts=[])
    with pytest.raises(CastspecError, match="empty"):
        engine.generate_batch(prompts=["hi", ""])


def test_rows_can_leave_before_the_drafter_ever_ran(smollm, smollm_reference):
    """CAST may skip drafting for many steps; a row that finishes meanwhile leaves a drafter with an empty cache."""
    model, tokenizer = smollm
    drafter = DraftModelDrafter(model)
    drafter.reset(3)
    drafter.keep_rows([0, 2])
    assert drafter.lengths == [0, 0] and drafter.valid.shape == (2, 0)
    engine = Engine(model, tokenizer, drafter, ChainPolicy(2))
    ids = [engine.encode(prompt=p) for p in ["Hello", PROMPTS[0]]]
    expected = [smollm_reference(tuple(i), n) for i, n in zip(ids, (2, 6), strict=True)]
    with torch.inference_mode():
        for policy in (NeverDraft(), ChainPolicy(2)):  # the second run starts the drafter afresh
            stops = [StopCondition(n, engine.eos_ids, [], tokenizer) for n in (2, 6)]
            outputs, _ = decode(Target(model), drafter, policy, ids, stops)
            assert outputs == expected


class NeverDraft(ChainPolicy):
    def should_draft(self, ctx):
        return False
