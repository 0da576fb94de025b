"""A model drafter with n-gram proposals merged in: the merge rule, clear refusals, and lossless decoding with a
real SmolLM2 (fp32, HF greedy as the reference) for the EAGLE head and the draft model, alone and in a batch."""

from __future__ import annotations

import pytest
import torch
from synthetic import flat_costs

from castspec import Engine
from castspec.bench.runner import _runners, parse_methods
from castspec.decode.sampling import SamplingParams
from castspec.drafters.base import Candidates
from castspec.drafters.draft_model import DraftModelDrafter
from castspec.drafters.eagle_head import EagleHeadDrafter
from castspec.drafters.ngram import NgramDrafter
from castspec.drafters.suffix import SuffixDrafter
from castspec.drafters.with_ngram import NgramAugmentedDrafter, merge_candidates
from castspec.errors import CastspecError
from castspec.policies.base import ChainPolicy, Eagle2Policy
from castspec.policies.cast import CastPolicy


def test_merge_keeps_each_token_once_with_its_larger_probability_best_first():
    model = Candidates(torch.tensor([[5, 7, 9], [1, 2, 3]]), torch.tensor([[0.5, 0.3, 0.1], [0.4, 0.2, 0.1]]))
    ngram = Candidates(torch.tensor([[7, 4, 0], [0, 0, 0]]), torch.tensor([[0.9, 0.1, 0.0], [0.0, 0.0, 0.0]]))
    merged = merge_candidates(model, ngram)
    assert merged.tokens.shape == (2, 6)
    assert merged.tokens[0, :4].tolist() == [7, 5, 9, 4]
    assert merged.probs[0].tolist() == pytest.approx([0.9, 0.5, 0.1, 0.1, 0.0, 0.0])
    # an n-gram row with no match leaves the model's row as it was
    assert merged.tokens[1, :3].tolist() == [1, 2, 3] and merged.probs[1, 3:].sum() == 0
    empty = merge_candidates(Candidates(torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3)),
                             Candidates(torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)))
    assert empty.tokens.shape == (0, 5)


def test_misuse_is_refused(smollm):
    model, _ = smollm
    with pytest.raises(CastspecError, match="not into another model-free drafter"):
        NgramAugmentedDrafter(NgramDrafter())
    with pytest.raises(CastspecError, match="not into another model-free drafter"):
        NgramAugmentedDrafter(SuffixDrafter(), NgramDrafter())
    merged = NgramAugmentedDrafter(DraftModelDrafter(model))
    with pytest.raises(CastspecError, match="proposes deterministically"):
        merged.sample_candidates(SamplingParams(temperature=0.8), torch.Generator())
    with pytest.raises(CastspecError, match="give --draft or --head too"):
        Engine.load("smollm2-135m", "eagle2", drafter="ngram", with_ngram=True)
    with pytest.raises(CastspecError, match="give --draft or --head too"):
        Engine.load("smollm2-135m", "eagle2", with_suffix=True)
    with pytest.raises(CastspecError, match=r"drafts with a draft, and none was given \(--draft"):
        _runners(model, None, None, parse_methods("cast:draft+suffix"))
    with pytest.raises(CastspecError, match=r"drafts with a head, and none was given \(--head"):
        _runners(model, None, None, parse_methods("cast:head+ngram"))


# repeated text, so that the n-gram index has continuations to propose
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "1, 2, 3, 4, 5, 6, 7, 8,",
           "The cat sat on the mat. The cat sat on the", "Once upon a time,"]


def _policies():
    return {"chain": ChainPolicy(4), "eagle2": Eagle2Policy(4, 4, 16),
            "cast": CastPolicy(flat_costs(), 4.0, 3.0, 2.5, 8, 6, 8, auto=False)}


def test_head_with_ngram_matches_hf_greedy_and_accepts_more(smollm, smollm_reference, random_head):
    model, tokenizer = smollm
    for name, policy in _policies().items():
        taus = {}
        for label, drafter in (("head", EagleHeadDrafter(random_head, model)),
                               ("head+ngram", NgramAugmentedDrafter(EagleHeadDrafter(random_head, model)))):
            engine = Engine(model, tokenizer, drafter, policy)
            ids = [engine.encode(prompt=p) for p in PROMPTS]
            got = engine.generate_batch(prompt_ids=ids, max_new_tokens=24)
            for g, prompt_ids in zip(got, ids, strict=True):
                assert g.output_ids == smollm_reference(tuple(prompt_ids), 24), (name, label)
            taus[label] = sum(len(g.output_ids) for g in got) / sum(len(g.steps) for g in got)
        # the random head rarely guesses right; the copied continuations are accepted
        assert taus["head+ngram"] > taus["head"] + 0.1, (name, taus)


def test_draft_model_with_ngram_matches_hf_greedy_one_prompt_at_a_time(smollm, smollm_reference):
    model, tokenizer = smollm
    for name, policy in _policies().items():
        engine = Engine(model, tokenizer, NgramAugmentedDrafter(DraftModelDrafter(model), NgramDrafter(min_n=1)),
                        policy)
        for prompt in PROMPTS[:2]:
            ids = engine.encode(prompt=prompt)
            assert engine.generate(prompt_ids=ids, max_new_tokens=16).output_ids == \
                smollm_reference(tuple(ids), 16), name
