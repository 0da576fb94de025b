"""`castspec regenerate` on the real SmolLM2 and real ShareGPT prompts: the answers are the target's own greedy
answers, a second run continues after the first, and a file it did not write is refused."""

from __future__ import annotations

import json

import pytest

from castspec.bench.prompts import load_sharegpt, read_prompts_file
from castspec.errors import CastspecError
from castspec.heads.regenerate import regenerate
from tests.conftest import hf_greedy


def test_answers_are_the_targets_and_a_rerun_continues(smollm, tmp_path):
    model, tokenizer = smollm
    conversations = load_sharegpt(5)
    out = tmp_path / "answers.jsonl"
    first = regenerate(model, tokenizer, conversations[:3], out, max_new_tokens=10, max_prompt_tokens=400,
                       batch_size=2)
    assert first["generated_now"] == 3 and first["skipped_long_prompts"] == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row in rows:
        prompt = tokenizer.apply_chat_template(conversations[row["id"]][:1], tokenize=True,
                                               add_generation_prompt=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        alone = hf_greedy(model, prompt, 10)  # unpadded, one prompt: what batching with left padding must match
        assert row["messages"][1]["content"] == tokenizer.decode(alone[: row["new_tokens"]], skip_special_tokens=True)
        assert row["messages"][0] == conversations[row["id"]][0] and row["messages"][1]["role"] == "assistant"
        assert row["finished"] == (row["new_tokens"] < 10)

    again = regenerate(model, tokenizer, conversations, out, max_new_tokens=10, max_prompt_tokens=400, batch_size=2)
    assert again["generated_now"] == 2
    assert sorted(r["id"] for r in read_prompts_file(str(out))) == list(range(5))  # what train-head --data reads

    out.write_text(out.read_text() + "not json\n")
    with pytest.raises(CastspecError, match="not a line this command wrote"):
        regenerate(model, tokenizer, conversations, out, max_new_tokens=10)
    with pytest.raises(CastspecError, match="max-prompt-tokens"):
        regenerate(model, tokenizer, conversations, tmp_path / "none.jsonl", max_prompt_tokens=2)
