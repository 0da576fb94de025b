"""The real target/draft pair in fp32: Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B equals HF greedy."""

from __future__ import annotations

import pytest
from conftest import hf_greedy

from castspec import Engine
from castspec.drafters.draft_model import DraftModelDrafter, check_compatible
from castspec.drafters.ngram import NgramDrafter
from castspec.models import load_model
from castspec.policies.base import ChainPolicy, Eagle2Policy

pytestmark = pytest.mark.slow

CHATS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is 12 * 13? Explain briefly.",
]


@pytest.fixture(scope="module")
def qwen_pair():
    target, tokenizer = load_model("qwen2.5-coder-1.5b", "fp32")
    draft, draft_tokenizer = load_model("qwen2.5-coder-0.5b", "fp32")
    check_compatible(target, tokenizer, draft, draft_tokenizer)
    return target, tokenizer, draft


def test_qwen_pair_matches_hf_greedy(qwen_pair):
    target, tokenizer, draft = qwen_pair
    engines = {
        "ar": Engine(target, tokenizer),
        "chain-draft": Engine(target, tokenizer, DraftModelDrafter(draft), ChainPolicy(4)),
        "eagle2-draft": Engine(target, tokenizer, DraftModelDrafter(draft), Eagle2Policy(4, 4, 16)),
        "eagle2-ngram": Engine(target, tokenizer, NgramDrafter(), Eagle2Policy()),
    }
    accepted = []
    for text in CHATS:
        ids = engines["ar"].encode(messages=[{"role": "user", "content": text}])
        expected = hf_greedy(target, ids, 16)
        for name, engine in engines.items():
            got = engine.generate(prompt_ids=ids, max_new_tokens=16)
            assert got.output_ids == expected, f"{name} differs from HF greedy on {text!r}"
            if name == "chain-draft":
                accepted.append(got.mean_accepted)
    assert max(accepted) > 1.5  # the 0.5B draft agrees with the 1.5B target often enough to matter


def test_a_draft_with_another_tokenizer_is_refused(qwen_pair):
    from castspec.errors import CastspecError

    target, tokenizer, _ = qwen_pair
    small, small_tokenizer = load_model("smollm2-135m", "fp32")
    with pytest.raises(CastspecError, match="tokenizer differs"):
        check_compatible(target, tokenizer, small, small_tokenizer)
