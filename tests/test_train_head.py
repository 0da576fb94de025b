"""`castspec train-head` on the real SmolLM2 and real ShareGPT conversations, tiny settings: the loss falls,
an interrupted run resumed with --resume ends exactly where an uninterrupted one does, and misuse is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from castspec.bench.prompts import load_sharegpt
from castspec.drafters.eagle_head import load_eagle_head
from castspec.errors import CastspecError
from castspec.heads.config import TrainConfig
from castspec.heads.train import (
    _assistant_spans,
    _batch,
    _Item,
    cache_features,
    head_from_target_layer,
    head_loss,
    held_out_indices,
    scored_pairs,
    train,
    training_sequences,
    unrolled_passes,
)

# 48 tokens end inside most prompts: these runs score every pair (the response-only loss has its own test)
TINY = TrainConfig(conversations=4, max_length=48, epochs=6, batch_size=3, lr=1e-3, warmup=1, noise=0.05,
                   save_every=100, validation=1, seed=0, loss_on="all")


@pytest.fixture(scope="module")
def conversations():
    return load_sharegpt(4)


def test_sharegpt_and_sequences(smollm, conversations):
    _, tokenizer = smollm
    assert len(conversations) == 4
    assert all(c[0]["role"] == "user" and c[1]["role"] == "assistant" for c in conversations)
    sequences = training_sequences(tokenizer, conversations, 48)
    assert sequences and all(16 <= len(s.ids) <= 48 and len(s.response) == len(s.ids) for s in sequences)
    assert tokenizer.decode(sequences[0].ids).count(conversations[0][0]["content"][:20]) == 1


def test_response_tokens_are_the_assistant_turns(smollm, conversations):
    _, tokenizer = smollm
    for turns, seq in zip(conversations, training_sequences(tokenizer, conversations, 4096), strict=True):
        spans = _assistant_spans(tokenizer, turns, seq.ids)
        answers = [t["content"] for t in turns if t["role"] == "assistant"]
        assert len(spans) == len(answers) and sum(seq.response) == sum(end - start for start, end in spans)
        for (start, end), answer in zip(spans, answers, strict=True):
            text = tokenizer.decode(seq.ids[start:end])
            assert text.startswith(answer.strip()[:40]) and text.rstrip().endswith("<|im_end|>")
            assert tokenizer.decode(seq.ids[:start]).endswith("<|im_start|>assistant\n")


def test_scored_pairs_are_the_predictions_of_response_tokens():
    # pair t = (f_t, x_{t+1}) predicts x_{t+2}; the last pair predicts past the end
    assert scored_pairs([False, False, False, True, True, False], "responses").tolist() == [
        False, True, True, False, False]
    assert scored_pairs([False, False, True, True], "responses").tolist() == [True, True, True]
    assert scored_pairs([False, False, True, True], "all").tolist() == [True, True, True]


def test_response_loss_ignores_prompt_targets(smollm, conversations, tmp_path):
    """With --loss-on responses the loss does not depend on the targets of prompt pairs (they remain context)
    but does on a response pair's; a short run trains on responses only and reports how many pairs it scored."""
    model, tokenizer = smollm
    seq = training_sequences(tokenizer, conversations, 160)[1]
    ids = torch.tensor(seq.ids)
    with torch.no_grad():
        feats = model(ids[None], output_hidden_states=True).hidden_states[-1][0]
    from castspec.drafters.eagle_head import EagleHead, head_config

    torch.manual_seed(0)
    head = EagleHead(head_config(model)).eval()
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    tokens, inputs, targets, scored = _batch([_Item(ids, feats, scored_pairs(seq.response, "responses"))])
    assert 0 < int(scored.sum()) < scored.numel()
    with torch.no_grad():
        base, _ = head_loss(head, embed, lm_head, (tokens, inputs, targets, scored))
        noisy = targets.clone()
        noisy[~scored] = torch.randn_like(noisy[~scored])
        same, _ = head_loss(head, embed, lm_head, (tokens, inputs, noisy, scored))
        row, pair = scored.nonzero()[0].tolist()
        noisy[row, pair] += 1.0
        moved, _ = head_loss(head, embed, lm_head, (tokens, inputs, noisy, scored))
    assert torch.equal(base, same) and not torch.equal(base, moved)
    cfg = dataclasses.replace(TINY, max_length=160, epochs=2, loss_on="responses")
    result = train(model, tokenizer, conversations, tmp_path / "head", tmp_path / "features", cfg)
    assert 0 < result["scored_pairs"] < result["tokens"] - result["sequences"] and result["loss_on"] == "responses"


def test_loss_falls_and_resume_is_exact(smollm, conversations, tmp_path):
    model, tokenizer = smollm
    features = tmp_path / "features"
    whole = train(model, tokenizer, conversations, tmp_path / "whole", features, TINY)
    history = json.loads((tmp_path / "whole" / "training.json").read_text())["history"]
    assert history[-1]["loss"] < history[0]["loss"]  # 6 steps on the same 3 sequences: it must learn something
    assert whole["steps"] == 6
    # held-out agreement after every epoch but the last, whose figure is the run's final validation
    assert ["validation" in h for h in history] == [True] * 5 + [False]
    assert set(history[0]["validation"]) == set(whole["validation"]) == {"v", "p", "top1", "top1_2"}

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


def test_feature_cache_reuses_shards_of_data_that_grew(smollm, tmp_path):
    """Sequences appended to the data cost only their own features: a shard holding exactly its sequences is
    kept, one whose sequences changed is computed again, and every shard holds the target's features."""
    from safetensors.torch import load_file

    model, _ = smollm
    seqs = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13], [5, 4, 3], [9, 9, 9, 9, 9, 9]]
    first = cache_features(model, seqs[:3], tmp_path, shard_size=2)
    stamps = [shard.stat().st_mtime_ns for shard in first]
    grown = cache_features(model, seqs, tmp_path, shard_size=2)
    assert len(grown) == 3 and grown[0].stat().st_mtime_ns == stamps[0] and grown[1].stat().st_mtime_ns != stamps[1]
    grown_stamps = [shard.stat().st_mtime_ns for shard in grown]
    for index, shard in enumerate(grown):
        data = load_file(str(shard))
        for row, seq in enumerate(seqs[2 * index: 2 * index + 2]):
            with torch.no_grad():
                want = model(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
            assert data["ids"][row, : len(seq)].tolist() == seq
            torch.testing.assert_close(data["features"][row, : len(seq)].float(), want, atol=2e-2, rtol=2e-2)
    # EAGLE-3's fused layers (+ the last) are another width: nothing cached at one width is taken for the other
    layers = (2, 15, -1)
    fused = cache_features(model, seqs, tmp_path, shard_size=2, layers=layers)
    assert all(a.stat().st_mtime_ns != b for a, b in zip(fused, grown_stamps, strict=True))
    data = load_file(str(fused[0]))
    with torch.no_grad():
        out = model(torch.tensor([seqs[0]]), output_hidden_states=True)
    want = torch.cat([out.hidden_states[i][0] for i in layers], dim=-1)
    assert data["features"].shape[-1] == 3 * model.config.hidden_size
    torch.testing.assert_close(data["features"][0, : len(seqs[0])].float(), want, atol=3e-2, rtol=2e-2)


def test_held_out_sequences_stay_unseen_as_the_data_grows():
    """A sequence held out of a run is either held out again when the data grows, or replaced by a new
    sequence; never one the earlier run trained on. Order does not matter."""
    first = [[i, i + 1, i * 7 % 13] for i in range(40)]
    grown = first + [[100 + i, i] for i in range(25)]
    before = {tuple(first[i]) for i in held_out_indices(first, 5)}
    after = {tuple(grown[i]) for i in held_out_indices(grown, 5)}
    assert len(before) == len(after) == 5 and after != before
    assert after <= before | {tuple(s) for s in grown[40:]}
    shuffled = grown[::-1]
    assert {tuple(shuffled[i]) for i in held_out_indices(shuffled, 5)} == after
    assert held_out_indices(first, 5, seed=1) != held_out_indices(first, 5)


def test_unrolled_passes_are_draft_chains(smollm):
    """Pass k of the training-time test gives, at row t, what drafting gives k nodes below the exact pair t:
    the head run over the exact pairs up to t and then its own previous outputs, one pair at a time. The loss
    of a later pass reaches the weights through the earlier passes' outputs."""
    from castspec.drafters.eagle_head import EagleHead, head_config

    model, _ = smollm
    torch.manual_seed(0)
    head = EagleHead(head_config(model)).eval()
    for p in head.parameters():
        p.data.normal_(0, 0.05)
    embed = model.get_input_embeddings()
    pairs = 10
    tokens, inputs = torch.randint(0, 5000, (2, pairs)), torch.randn(2, pairs, model.config.hidden_size)
    positions = torch.arange(pairs)[None]
    with torch.no_grad():
        passes = unrolled_passes(head, embed(tokens), inputs, 3)
        assert [p.shape[1] for p in passes] == [10, 9, 8]
        for row in range(2):
            for t in range(pairs - 2):
                features, chain = inputs[row: row + 1, : t + 1], []
                for depth in range(3):
                    n = t + 1 + depth
                    out = head(embed(tokens[row: row + 1, :n]), features, positions[:, :n], None)[:, -1:]
                    torch.testing.assert_close(out, passes[depth][row: row + 1, t: t + 1], atol=1e-4, rtol=1e-4)
                    chain.append(out)
                    features = torch.cat([inputs[row: row + 1, : t + 1], *chain], dim=1)
    head.train()
    later = unrolled_passes(head, embed(tokens).detach(), inputs, 2)[1]
    first_output = torch.autograd.grad(later.sum(), head.fc.weight, retain_graph=True)[0]
    assert first_output.abs().sum() > 0


def test_head_from_the_targets_last_layer(smollm, smollm_reference, conversations, tmp_path):
    """--layer-init target: the head's layer starts as the target's last decoder layer (same output for the
    same input), keeps its input norm through save and load, and a head trained that way with the training-time
    test decodes exactly HF greedy's output; conflicting settings are refused."""
    from castspec import Engine
    from castspec.drafters.eagle_head import EagleHeadDrafter
    from castspec.policies.base import ChainPolicy, Eagle2Policy

    model, tokenizer = smollm
    head = head_from_target_layer(model)
    last = model.get_decoder().layers[-1]
    x = torch.randn(1, 5, model.config.hidden_size)
    positions = torch.arange(5)[None]
    with torch.no_grad():
        rope = model.get_decoder().rotary_emb(x, positions)
        torch.testing.assert_close(head.layers[0](x, position_ids=positions, position_embeddings=rope),
                                   last(x, position_ids=positions, position_embeddings=rope))
    cfg = dataclasses.replace(TINY, layer_init="target", unroll=2)
    result = train(model, tokenizer, conversations, tmp_path / "head", tmp_path / "features", cfg)
    history = json.loads((tmp_path / "head" / "training.json").read_text())["history"]
    assert history[-1]["loss"] < history[0]["loss"] and {"top1", "top1_2"} <= set(result["validation"])
    loaded = load_eagle_head(str(tmp_path / "head"), model)
    assert not isinstance(loaded.layers[0].input_layernorm, torch.nn.Identity)
    for policy in (ChainPolicy(3), Eagle2Policy(4, 3, 12)):
        engine = Engine(model, tokenizer, EagleHeadDrafter(loaded, model), policy)
        ids = [engine.encode(prompt=p) for p in ("def add(a, b):", "The capital of France is")]
        for got, prompt_ids in zip(engine.generate_batch(prompt_ids=ids, max_new_tokens=20), ids, strict=True):
            assert got.output_ids == smollm_reference(tuple(prompt_ids), 20), policy.name
    with pytest.raises(CastspecError, match="--init"):
        train(model, tokenizer, conversations, tmp_path / "x", tmp_path / "features",
              dataclasses.replace(cfg, init=str(tmp_path / "head")))
    with pytest.raises(CastspecError, match="--unroll"):
        train(model, tokenizer, conversations, tmp_path / "y", tmp_path / "features",
              dataclasses.replace(TINY, unroll=0))


def test_eagle3_head_trains_saves_in_its_layout_and_decodes_exactly(smollm, smollm_reference, conversations,
                                                                     tmp_path):
    """--arch eagle3: a head over the target's low / middle / high layers with its own lm_head (started from the
    target's rows of the draft vocabulary) learns with the cross-entropy alone, is written in the EAGLE-3 layout
    (midlayer.*, d2t, t2d, eagle_aux_hidden_state_layer_ids) that the loader reads back with the same layers,
    and drafts losslessly with chain, EAGLE-2 and CAST trees; misuse is refused."""
    from synthetic import flat_costs

    from castspec import Engine
    from castspec.drafters.eagle_head import Eagle3Head, EagleHeadDrafter
    from castspec.policies.base import ChainPolicy, Eagle2Policy
    from castspec.policies.cast import CastPolicy

    model, tokenizer = smollm
    cfg = dataclasses.replace(TINY, arch="eagle3", draft_vocab=50, unroll=2)
    result = train(model, tokenizer, conversations, tmp_path / "head", tmp_path / "features", cfg)
    history = json.loads((tmp_path / "head" / "training.json").read_text())["history"]
    assert history[-1]["loss"] < history[0]["loss"] and set(result["validation"]) == {"p", "top1", "top1_2"}
    saved = json.loads((tmp_path / "head" / "config.json").read_text())
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26] and saved["draft_vocab_size"] == 50
    head = load_eagle_head(str(tmp_path / "head"), model)
    assert isinstance(head, Eagle3Head) and head.feature_layers == (2, 15, 27) and len(head.draft_ids) == 50
    assert int(head.t2d.sum()) == 50 and head.t2d[head.draft_ids].all()
    for policy in (ChainPolicy(3), Eagle2Policy(4, 3, 12), CastPolicy(flat_costs(), 4.0, 3.0, 2.5, 8, 5, 8)):
        engine = Engine(model, tokenizer, EagleHeadDrafter(head, model), policy)
        ids = [engine.encode(prompt=p) for p in ("def add(a, b):", "The capital of France is")]
        for got, prompt_ids in zip(engine.generate_batch(prompt_ids=ids, max_new_tokens=20), ids, strict=True):
            assert got.output_ids == smollm_reference(tuple(prompt_ids), 20), policy.name
    tuned = dataclasses.replace(cfg, draft_vocab=0, epochs=1, init=str(tmp_path / "head"))
    train(model, tokenizer, conversations, tmp_path / "tuned", tmp_path / "features", tuned)
    assert json.loads((tmp_path / "tuned" / "training.json").read_text())["history"][0]["loss"] < history[0]["loss"]
    features = tmp_path / "features"
    for wrong, message in ((dataclasses.replace(cfg, draft_vocab=0), "--draft-vocab"),
                           (dataclasses.replace(cfg, layer_init="target"), "--layer-init"),
                           (dataclasses.replace(tuned, arch="eagle"), "--arch eagle3"),
                           (dataclasses.replace(cfg, arch="eagle4"), "--arch")):
        with pytest.raises(CastspecError, match=message):
            train(model, tokenizer, conversations, tmp_path / wrong.arch / str(wrong.draft_vocab), features, wrong)
