"""`castspec train-head` on the real SmolLM2 and real ShareGPT conversations, tiny settings: the loss falls,
an interrupted run resumed with --resume ends exactly where an uninterrupted one does, and misuse is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from castspec.drafters.eagle_head import load_eagle_head
from castspec.errors import CastspecError
from castspec.prompts import load_sharegpt
from castspec.train_config import TrainConfig
from castspec.train_head import train, training_sequences

TINY = TrainConfig(conversations=4, max_length=48, epochs=6, batch_size=3, lr=1e-3, warmup=1, noise=0.05,
                   save_every=100, validation=1, seed=0)


@pytest.fixture(scope="module")
def conversations():
    return load_sharegpt(4)


def test_sharegpt_and_sequences(smollm, conversations):
    _, tokenizer = smollm
    assert len(conversations) == 4
    assert all(c[0]["role"] == "user" and c[1]["role"] == "assistant" for c in conversations)
    sequences = training_sequences(tokenizer, conversations, 48)
    assert sequences and all(16 <= len(s) <= 48 for s in sequences)
    assert tokenizer.decode(sequences[0]).count(conversations[0][0]["content"][:20]) == 1


def test_loss_falls_and_resume_is_exact(smollm, conversations, tmp_path):
    model, tokenizer = smollm
    features = tmp_path / "features"
    whole = train(model, tokenizer, conversations, tmp_path / "whole", features, TINY)
    history = json.loads((tmp_path / "whole" / "training.json").read_text())["history"]
    assert history[-1]["loss"] < history[0]["loss"]  # 6 steps on the same 3 sequences: it must learn something
    assert whole["steps"] == 6

    stopped = train(model, tokenizer, conversations, tmp_path / "parts", features, TINY, stop_after_steps=3)
    assert stopped["steps"] == 3 and stopped["stopped"] == "steps"
    with pytest.raises(CastspecError, match="--resume"):
        train(model, tokenizer, conversations, tmp_path / "parts", features, TINY)
    with pytest.raises(CastspecError, match="different settings"):
        train(model, tokenizer, conversations, tmp_path / "parts", features, dataclasses.replace(TINY, lr=1e-4),
              resume=True)
    with pytest.raises(CastspecError, match="nothing to resume"):
        train(model, tokenizer, conversations, tmp_path / "fresh", features, TINY, resume=True)
    train(model, tokenizer, conversations, tmp_path / "parts", features, TINY, resume=True)
    a, b = load_eagle_head(str(tmp_path / "whole"), model), load_eagle_head(str(tmp_path / "parts"), model)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_bf16_target_trains_under_autocast(conversations, tmp_path):
    """A bf16 target: features and the loss run in bf16 (autocast), the head's weights stay fp32 and it learns."""
    from castspec.models import load_model

    model, tokenizer = load_model("smollm2-135m", "bf16")
    result = train(model, tokenizer, conversations, tmp_path / "head", tmp_path / "features", TINY)
    history = json.loads((tmp_path / "head" / "training.json").read_text())["history"]
    assert result["steps"] == 6 and history[-1]["loss"] < history[0]["loss"]
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    state = torch.load(tmp_path / "head" / "checkpoint.pt", weights_only=False)["head"]
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    assert load_eagle_head(str(tmp_path / "head"), model).fc.weight.dtype == torch.bfloat16  # runs as the target


def test_init_starts_from_a_trained_head(smollm, conversations, tmp_path):
    """--init: a run starts from an existing head's weights (in fp32) and draft vocabulary, so its first loss is
    the trained head's, not a fresh one's; a draft vocabulary cannot be chosen again."""
    model, tokenizer = smollm
    features = tmp_path / "features"
    small_vocab = dataclasses.replace(TINY, draft_vocab=50)  # of the ~90 distinct tokens in the data
    train(model, tokenizer, conversations, tmp_path / "first", features, small_vocab)
    first = json.loads((tmp_path / "first" / "training.json").read_text())["history"]
    tuned = dataclasses.replace(TINY, epochs=1, init=str(tmp_path / "first"))
    train(model, tokenizer, conversations, tmp_path / "tuned", features, tuned)
    history = json.loads((tmp_path / "tuned" / "training.json").read_text())["history"]
    assert history[0]["loss"] < first[0]["loss"]
    start, end = load_eagle_head(str(tmp_path / "first"), model), load_eagle_head(str(tmp_path / "tuned"), model)
    assert torch.equal(start.draft_ids, end.draft_ids) and len(end.draft_ids) == 50
    with pytest.raises(CastspecError, match="draft vocabulary"):
        train(model, tokenizer, conversations, tmp_path / "again", features, dataclasses.replace(tuned, draft_vocab=9))
