"""Lossless greedy decoding, fp32, real weights: every method and drafter gives exactly HF's greedy tokens."""

from __future__ import annotations

import pytest
from synthetic import flat_costs

from castspec import Engine
from castspec.drafters.draft_model import DraftModelDrafter
from castspec.drafters.ngram import NgramDrafter
from castspec.policies.base import ChainPolicy, Eagle2Policy

PROMPTS = [
    "def fibonacci(n):",
    "import numpy as np\n\ndef softmax(x):\n    \"\"\"Numerically stable softmax.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "SELECT name, COUNT(*) FROM orders",
    "<html>\n<head>\n<title>",
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "Q: What is 17 * 23?\nA:",
    "If a train travels 60 miles in 1.5 hours, its average speed is",
    "Solve for x: 3x + 7 = 22. First, subtract 7 from both sides:",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat.",
    "A B C D E F G H I J K L M N O P",
    "Monday, Tuesday, Wednesday,",
    "Translate to French: Good morning, how are you?",
    "Here is a list of fruits:\n- apple\n- banana\n-",
    "The quick brown fox",
    "Photosynthesis is the process by which",
    "#include <stdio.h>\n\nint main() {",
    "Hello",
]
CHATS = [
    [{"role": "user", "content": "Write a haiku about the ocean."}],
    [{"role": "user", "content": "What is 2+2? Answer with a single number."}],
]
NEW_TOKENS = 24


def engines(model, tokenizer):
    yield "ar", Engine(model, tokenizer)
    yield "chain-ngram", Engine(model, tokenizer, NgramDrafter(), ChainPolicy(4))
    yield "eagle2-ngram", Engine(model, tokenizer, NgramDrafter(), Eagle2Policy())
    yield "chain-draft", Engine(model, tokenizer, DraftModelDrafter(model), ChainPolicy(4))
    yield "eagle2-draft", Engine(model, tokenizer, DraftModelDrafter(model), Eagle2Policy())
    yield "eagle2-small-draft", Engine(model, tokenizer, DraftModelDrafter(model), Eagle2Policy(2, 3, 6))


@pytest.mark.parametrize("case", range(len(PROMPTS) + len(CHATS)))
def test_every_method_matches_hf_greedy(smollm, smollm_reference, case):
    model, tokenizer = smollm
    for name, engine in engines(model, tokenizer):
        if case < len(PROMPTS):
            ids = engine.encode(prompt=PROMPTS[case])
        else:
            ids = engine.encode(messages=CHATS[case - len(PROMPTS)])
        expected = smollm_reference(tuple(ids), NEW_TOKENS)
        got = engine.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS)
        assert got.output_ids == expected, f"{name} differs from HF greedy on case {case}"
        assert sum(got.accept_lengths) + 1 >= len(got.output_ids)


def test_one_token_prompt(smollm, smollm_reference):
    model, tokenizer = smollm
    for name, engine in engines(model, tokenizer):
        got = engine.generate(prompt_ids=[1], max_new_tokens=NEW_TOKENS)
        assert got.output_ids == smollm_reference((1,), NEW_TOKENS), name


def test_identical_draft_accepts_every_drafted_token(smollm):
    model, tokenizer = smollm
    engine = Engine(model, tokenizer, DraftModelDrafter(model), ChainPolicy(4))
    got = engine.generate(prompt="def quicksort(items):", max_new_tokens=40)
    assert all(step.accepted == step.tree_size + 1 for step in got.steps)
    assert all(step.tree_size == 4 for step in got.steps[:-1])


def test_eos_inside_an_accepted_path_ends_exactly_there(smollm, smollm_reference):
    model, tokenizer = smollm
    messages = [{"role": "user", "content": "Say hello."}]
    for name, engine in engines(model, tokenizer):
        ids = engine.encode(messages=messages)
        expected = smollm_reference(tuple(ids), 64)
        got = engine.generate(prompt_ids=ids, max_new_tokens=64)
        assert got.output_ids == expected, name
        assert got.stop_reason == "eos" and got.output_ids[-1] in engine.eos_ids
    # with an identical draft the chain runs on past the EOS: the cut must happen inside an accepted path
    cut_inside = []
    for length in range(3, 9):
        engine = Engine(model, tokenizer, DraftModelDrafter(model), ChainPolicy(length))
        got = engine.generate(messages=messages, max_new_tokens=64)
        assert got.output_ids == expected, length
        emitted_before_last = 1 + sum(got.accept_lengths[:-1])
        cut_inside.append(len(got.output_ids) - emitted_before_last < got.steps[-1].accepted)
    assert any(cut_inside)


def test_max_new_tokens_inside_a_tree_cuts_exactly(smollm, smollm_reference):
    model, tokenizer = smollm
    ids = Engine(model, tokenizer).encode(prompt="1, 2, 3, 4, 5, 6, 7, 8,")
    for n in [1, 2, 3, 7]:
        for name, engine in engines(model, tokenizer):
            got = engine.generate(prompt_ids=ids, max_new_tokens=n)
            assert got.output_ids == smollm_reference(tuple(ids), n), (name, n)


def test_stop_string_ends_after_the_completing_token(smollm):
    model, tokenizer = smollm
    ar = Engine(model, tokenizer).generate(prompt="1, 2, 3, 4, 5, 6, 7, 8,", max_new_tokens=30)
    assert " 11" in ar.text
    for name, engine in engines(model, tokenizer):
        got = engine.generate(prompt="1, 2, 3, 4, 5, 6, 7, 8,", max_new_tokens=30, stop=[" 11"])
        assert got.stop_reason == "stop_string", name
        assert got.output_ids == ar.output_ids[: len(got.output_ids)], name
        assert " 11" not in tokenizer.decode(got.output_ids[:-1]), name


def test_prompt_close_to_the_context_window(smollm, smollm_reference):
    model, tokenizer = smollm
    saved = model.config.max_position_embeddings
    ids = (tokenizer("the cat sat on the mat. " * 40)["input_ids"])[:250]
    try:
        model.config.max_position_embeddings = 256
        for name, engine in engines(model, tokenizer):
            got = engine.generate(prompt_ids=ids, max_new_tokens=40)
            assert len(got.output_ids) == 6, name
            assert got.output_ids == smollm_reference(tuple(ids), 6), name
            assert all(s.context_length + s.draft.depth < 256 for s in got.steps), name
    finally:
        model.config.max_position_embeddings = saved


@pytest.mark.parametrize("case", [0, 2, 5, 7, 10, 11, 16, 19])
def test_cast_matches_hf_greedy_with_every_drafter(smollm, smollm_reference, case):
    from castspec.policies.cast import CastPolicy

    model, tokenizer = smollm
    engines_ = {
        "cast-auto-ngram": Engine(model, tokenizer, NgramDrafter(), CastPolicy(flat_costs(), auto=True)),
        "cast-calibrated-ngram": Engine(model, tokenizer, NgramDrafter(),
                                        CastPolicy(flat_costs(), auto=True, calibrate=True)),
        "cast-paper-draft": Engine(model, tokenizer, DraftModelDrafter(model),
                                   CastPolicy(flat_costs(), 4.0, 3.0, 2.5)),
        "cast-auto-draft": Engine(model, tokenizer, DraftModelDrafter(model), CastPolicy(flat_costs(), auto=True)),
    }
    for name, engine in engines_.items():
        ids = engine.encode(prompt=PROMPTS[case])
        got = engine.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS)
        assert got.output_ids == smollm_reference(tuple(ids), NEW_TOKENS), name
        if name == "cast-auto-draft":
            assert max(s.tree_size for s in got.steps) > 1  # a real tree was verified, not plain AR


class SometimesChain(ChainPolicy):
    """Drafts on every third step only: the drafter must catch up on the tokens of the steps it skipped."""

    def __init__(self):
        super().__init__(3)
        self.calls = 0

    def should_draft(self, ctx):
        self.calls += 1
        return self.calls % 3 == 0


@pytest.mark.parametrize("case", [0, 11, 13])
def test_skipped_draft_steps_catch_up_exactly(smollm, smollm_reference, case):
    model, tokenizer = smollm
    for drafter in (DraftModelDrafter(model), NgramDrafter()):
        engine = Engine(model, tokenizer, drafter, SometimesChain())
        ids = engine.encode(prompt=PROMPTS[case])
        got = engine.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS)
        assert got.output_ids == smollm_reference(tuple(ids), NEW_TOKENS), drafter.name
        sizes = [s.tree_size for s in got.steps]
        assert 0 in sizes and (drafter.name == "ngram" or max(sizes) == 3)


@pytest.mark.parametrize("case", [0, 11, 16])
def test_cast_with_the_online_cost_model_matches_hf_greedy_with_every_drafter(smollm, smollm_reference, random_head,
                                                                              case, tmp_path, monkeypatch):
    """The online cost model only changes which trees CAST picks: the output stays the target's own, for every
    drafter, while the model learns from the step timings (probed first, as on an empty $CASTSPEC_HOME)."""
    from castspec.costs.probe import online_cost_model
    from castspec.drafters.eagle_head import EagleHeadDrafter
    from castspec.drafters.with_ngram import NgramAugmentedDrafter
    from castspec.policies.cast import CastPolicy

    monkeypatch.setenv("CASTSPEC_HOME", str(tmp_path))
    model, tokenizer = smollm
    drafters = {"draft": DraftModelDrafter(model), "ngram": NgramDrafter(),
                "head": EagleHeadDrafter(random_head, model),
                "head+ngram": NgramAugmentedDrafter(EagleHeadDrafter(random_head, model))}
    for name, drafter in drafters.items():
        costs = online_cost_model(model, drafter, name, fresh=True, log=lambda message: None)
        probed = costs.target_curve.observations
        engine = Engine(model, tokenizer, drafter, CastPolicy(costs, auto=True))
        ids = engine.encode(prompt=PROMPTS[case])
        got = engine.generate(prompt_ids=ids, max_new_tokens=NEW_TOKENS)
        assert got.output_ids == smollm_reference(tuple(ids), NEW_TOKENS), name
        assert costs.target_curve.observations == probed + len(got.steps), name  # every verify step learned
        assert all("timing" in s.draft.decisions for s in got.steps), name
