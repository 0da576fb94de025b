"""EAGLE-1/2 heads: the published checkpoint layout loads (and wrong heads are refused clearly), the drafter's
cached tree forwards equal a cache-free run of the head, and decoding with a head stays lossless (fp32, real
SmolLM2 weights, HF greedy as the reference)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from synthetic import flat_costs

from castspec import Engine
from castspec.decode.drafting import _add_layers, _Pool
from castspec.drafters.eagle_head import (
    Eagle3Head,
    EagleHead,
    EagleHeadDrafter,
    head_config,
    load_eagle_head,
    save_eagle_head,
)
from castspec.errors import CastspecError
from castspec.policies.base import ChainPolicy, Eagle2Policy
from castspec.policies.cast import CastPolicy


def _write(directory, state: dict, config: dict, torch_bin: bool = False) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if torch_bin:
        torch.save(state, directory / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(state, str(directory / "model.safetensors"))


def _eagle_layout(model, head: EagleHead) -> tuple[dict, dict]:
    """A checkpoint as the EAGLE repository writes one: embeddings included, fc with bias, no layer-0 norm."""
    state = {k: v.clone() for k, v in head.state_dict().items() if not k.startswith("rotary")}
    state["embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()
    state["fc.bias"] = torch.zeros(model.config.hidden_size)
    assert not any(k.startswith("layers.0.input_layernorm") for k in state)
    config = head.config.to_dict()
    config.pop("_attn_implementation_internal", None)
    return state, config


def test_published_layouts_load_and_run(smollm, random_head, tmp_path):
    model, _ = smollm
    state, config = _eagle_layout(model, random_head)
    for torch_bin in (False, True):
        directory = tmp_path / f"bin{torch_bin}"
        _write(directory, state, config, torch_bin)
        head = load_eagle_head(str(directory), model)
        assert head.fc.bias is not None and head.embed_tokens is not None
        torch.testing.assert_close(head.fc.weight, random_head.fc.weight)
        feats = torch.randn(1, 3, model.config.hidden_size)
        out = head(head.embed_tokens(torch.tensor([[1, 2, 3]])), feats, torch.arange(3)[None], None)
        assert out.shape == (1, 3, model.config.hidden_size) and torch.isfinite(out).all()
    saved = tmp_path / "ours"  # castspec's own writer: same layout, no embeddings
    save_eagle_head(random_head, saved, {"command": "test"})
    again = load_eagle_head(str(saved), model)
    assert again.embed_tokens is None
    torch.testing.assert_close(again.layers[0].mlp.up_proj.weight, random_head.layers[0].mlp.up_proj.weight)


def test_wrong_heads_are_refused_clearly(smollm, random_head, tmp_path):
    model, _ = smollm
    state, config = _eagle_layout(model, random_head)
    d = model.config.hidden_size
    wide = dict(state, **{"fc.weight": torch.zeros(2 * d, 4 * d)})
    _write(tmp_path / "wide", wide, dict(config, hidden_size=2 * d))
    with pytest.raises(CastspecError, match="features of size"):
        load_eagle_head(str(tmp_path / "wide"), model)
    _write(tmp_path / "vocab", dict(state, **{"embed_tokens.weight": torch.zeros(1000, d)}), config)
    with pytest.raises(CastspecError, match="another tokenizer"):
        load_eagle_head(str(tmp_path / "vocab"), model)
    _write(tmp_path / "nofc", {"layers.0.mlp.up_proj.weight": torch.ones(d)}, config)
    with pytest.raises(CastspecError, match="no fc.weight"):
        load_eagle_head(str(tmp_path / "nofc"), model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CastspecError, match="config.json"):
        load_eagle_head(str(tmp_path / "empty"), model)
    with pytest.raises(CastspecError, match="not a directory"):
        load_eagle_head(str(tmp_path / "nowhere" / "at" / "all"), model)
    _write(tmp_path / "badconfig", state, dict(config, hidden_size=d + 1))
    with pytest.raises(CastspecError, match="not a valid Llama config"):
        load_eagle_head(str(tmp_path / "badconfig"), model)
    broken = {k: v for k, v in state.items() if "mlp" not in k}
    _write(tmp_path / "broken", broken, config)
    with pytest.raises(CastspecError, match="layout"):
        load_eagle_head(str(tmp_path / "broken"), model)


@torch.inference_mode()
def test_cached_tree_forwards_equal_a_cache_free_run(smollm, random_head):
    """Two rows of different lengths: the root's children (after the catch-up) and a depth-2 node's children
    equal the head run from scratch over exact pairs followed by its own predicted features."""
    model, tokenizer = smollm
    prompts = [tokenizer("def add(a, b):")["input_ids"], tokenizer("The capital of France is a city that")["input_ids"]]
    with torch.inference_mode():
        feats = [model(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0] for p in prompts]
    drafter = EagleHeadDrafter(random_head, model)
    drafter.reset(2)
    cands = drafter.begin([p + [7] for p in prompts], 4, feats)  # 7: the token after each prompt
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()

    def reference(tokens: list[int], inputs: torch.Tensor) -> torch.Tensor:
        return random_head(embed(torch.tensor([tokens])), inputs[None], torch.arange(len(tokens))[None], None)[0]

    pools, frontiers, expected = [], [], []
    for row, prompt in enumerate(prompts):
        tokens = prompt[1:] + [7]
        hidden = reference(tokens, feats[row])
        top = torch.softmax(lm_head(hidden[-1]), -1).topk(4)
        assert cands[row].tokens[0].tolist() == top.indices.tolist()
        torch.testing.assert_close(cands[row].probs[0], top.values, rtol=1e-4, atol=1e-5)
        pool = _Pool(7)
        (nodes,), _ = _add_layers([pool], [[0]], [cands[row]])
        pools.append(pool)
        frontiers.append(nodes[1:3])  # the root's 2nd and 3rd children
        child = int(pool.tokens[nodes[2]])
        deeper = reference(tokens + [child], torch.cat([feats[row], hidden[-1:]]))
        expected.append(torch.softmax(lm_head(deeper[-1]), -1).topk(4))
    second = drafter.expand(pools, frontiers, 4)
    for row in range(2):
        assert second[row].tokens[1].tolist() == expected[row].indices.tolist()
        torch.testing.assert_close(second[row].probs[1], expected[row].values, rtol=1e-4, atol=1e-5)
    drafter.end_step()


PROMPTS = ["def fibonacci(n):", "The capital of France is", "1, 2, 3, 4, 5, 6, 7, 8,", "Once upon a time,"]


def test_head_decoding_matches_hf_greedy(smollm, smollm_reference, random_head):
    model, tokenizer = smollm
    policies = {"chain": ChainPolicy(4), "eagle2": Eagle2Policy(4, 4, 16),
                "cast": CastPolicy(flat_costs(), 4.0, 3.0, 2.5, 8, 6, 8, auto=False)}
    for name, policy in policies.items():
        engine = Engine(model, tokenizer, EagleHeadDrafter(random_head, model), policy)
        ids = [engine.encode(prompt=p) for p in PROMPTS]
        for got, prompt_ids in zip(engine.generate_batch(prompt_ids=ids, max_new_tokens=20), ids, strict=True):
            assert got.output_ids == smollm_reference(tuple(prompt_ids), 20), name


@pytest.fixture(scope="module")
def eagle3_checkpoint(smollm, tmp_path_factory):
    """A random EAGLE-3 head for SmolLM2 written in the EAGLE-3 layout: a 4096-token draft vocabulary (the
    target ids it covers chosen at random, always including the ids the test prompts need)."""
    model, _ = smollm
    torch.manual_seed(1)
    vocab, layers = model.config.vocab_size, model.config.num_hidden_layers
    chosen = torch.randperm(vocab)[:4096].sort().values
    config = head_config(model).to_dict()
    config.pop("_attn_implementation_internal", None)
    config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=4096)
    head = Eagle3Head(head_config(model), model.config.hidden_size, 4096, (2, layers // 2, layers - 3))
    for p in head.parameters():
        p.data.normal_(0, 0.05)
    state = {k: v for k, v in head.state_dict().items() if not k.startswith("rotary")}
    state["d2t"] = chosen - torch.arange(4096)
    state["t2d"] = torch.zeros(vocab, dtype=torch.bool)
    state["t2d"][chosen] = True
    directory = tmp_path_factory.mktemp("eagle3")
    _write(directory, state, config)
    return directory, chosen


def test_eagle3_layout_loads_and_maps_its_vocabulary(smollm, eagle3_checkpoint, tmp_path):
    model, _ = smollm
    directory, chosen = eagle3_checkpoint
    head = load_eagle_head(str(directory), model)
    layers = model.config.num_hidden_layers
    assert isinstance(head, Eagle3Head) and head.feature_layers == (2, layers // 2, layers - 3)
    with torch.inference_mode():
        logits = head.logits(torch.randn(1, 2, model.config.hidden_size), model.get_output_embeddings())
    assert logits.shape[-1] == model.config.vocab_size
    assert torch.isfinite(logits[..., chosen]).all() and torch.isinf(logits).sum() == 2 * (logits.shape[-1] - 4096)
    from safetensors.torch import load_file

    state = load_file(str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    narrow = dict(state, **{"fc.weight": state["fc.weight"][:, :-9].contiguous()})
    _write(tmp_path / "narrow", narrow, config)
    with pytest.raises(CastspecError, match="fuses features of width"):
        load_eagle_head(str(tmp_path / "narrow"), model)
    far = dict(state, d2t=state["d2t"] + 10 ** 6)
    _write(tmp_path / "far", far, config)
    with pytest.raises(CastspecError, match="another tokenizer"):
        load_eagle_head(str(tmp_path / "far"), model)


@torch.inference_mode()
def test_eagle3_cached_tree_forwards_equal_an_incremental_run(smollm, eagle3_checkpoint):
    model, tokenizer = smollm
    head = load_eagle_head(str(eagle3_checkpoint[0]), model)
    prompts = [tokenizer("def add(a, b):")["input_ids"], tokenizer("Paris is the capital of")["input_ids"]]
    feats = []
    for p in prompts:
        states = model(torch.tensor([p]), output_hidden_states=True).hidden_states
        feats.append(torch.cat([states[i][0] for i in head.feature_layers], dim=-1))
    drafter = EagleHeadDrafter(head, model)
    drafter.reset(2)
    cands = drafter.begin([p + [7] for p in prompts], 4, feats)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    pools, frontiers, expected = [], [], []
    for row, prompt in enumerate(prompts):
        from castspec.decode import kv

        cache = kv.new_cache(head)
        tokens = prompt[1:] + [7]
        hidden = head(embed(torch.tensor([tokens])), feats[row][None], torch.arange(len(tokens))[None], None, cache)
        top = torch.softmax(head.logits(hidden[0, -1], lm_head), -1).topk(4)
        assert cands[row].tokens[0].tolist() == top.indices.tolist()
        pool = _Pool(7)
        (nodes,), _ = _add_layers([pool], [[0]], [cands[row]])
        pools.append(pool)
        frontiers.append(nodes[:2])
        child = int(pool.tokens[nodes[1]])
        deeper = head(embed(torch.tensor([[child]])), hidden[:, -1:], torch.tensor([[len(tokens)]]), None, cache)
        expected.append(torch.softmax(head.logits(deeper[0, -1], lm_head), -1).topk(4))
    second = drafter.expand(pools, frontiers, 4)
    for row in range(2):
        assert second[row].tokens[1].tolist() == expected[row].indices.tolist()
        torch.testing.assert_close(second[row].probs[1], expected[row].values, rtol=1e-4, atol=1e-5)
    drafter.end_step()


def test_eagle3_decoding_matches_hf_greedy(smollm, smollm_reference, eagle3_checkpoint):
    model, tokenizer = smollm
    head = load_eagle_head(str(eagle3_checkpoint[0]), model)
    for policy in (ChainPolicy(3), Eagle2Policy(4, 3, 12), CastPolicy(flat_costs(), 4.0, 3.0, 2.5, 8, 5, 8)):
        engine = Engine(model, tokenizer, EagleHeadDrafter(head, model), policy)
        ids = [engine.encode(prompt=p) for p in PROMPTS[:3]]
        for got, prompt_ids in zip(engine.generate_batch(prompt_ids=ids, max_new_tokens=16), ids, strict=True):
            assert got.output_ids == smollm_reference(tuple(prompt_ids), 16)


TRAINED = Path(__file__).resolve().parents[1] / "heads" / "smollm2-135m-eagle"


class _RecordingDrafter(EagleHeadDrafter):
    """Records, at every step, how many exact pairs the head had absorbed and the root child it ranked first."""

    def begin(self, new_tokens, top_k, features=None):
        cands = super().begin(new_tokens, top_k, features)
        self.seen.append((self.lengths[0], int(cands[0].tokens[0, 0])))
        return cands


@pytest.mark.skipif(not (TRAINED / "model.safetensors").is_file(), reason="the trained SmolLM2 head is not in the tree")
def test_trained_head_drafts_from_exactly_aligned_features(smollm, smollm_reference):
    """In the engine, after every step, the head's first guess for the root's child equals the head run
    teacher-forced over the final sequence with the target's exact features: the engine pairs each accepted
    token with the right feature (also after partly accepted paths) and positions are right. Outputs equal HF
    greedy. The committed head (heads/smollm2-135m-eagle) is used so that drafts do get accepted."""
    model, tokenizer = smollm
    head = load_eagle_head(str(TRAINED), model)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    accepted_paths = agree = total = 0
    for text in ("What is the capital of France?", "Give me three tips for better sleep."):
        drafter = _RecordingDrafter(head, model)
        drafter.seen = []
        engine = Engine(model, tokenizer, drafter, Eagle2Policy(4, 3, 12))
        ids = engine.encode(messages=[{"role": "user", "content": text}])
        got = engine.generate(prompt_ids=ids, max_new_tokens=32)
        assert got.output_ids == smollm_reference(tuple(ids), 32)
        accepted_paths += sum(s.accepted > 1 for s in got.steps)
        sequence = ids + got.output_ids
        with torch.inference_mode():
            features = model(torch.tensor([sequence]), output_hidden_states=True).hidden_states[-1][0]
            hidden = head(embed(torch.tensor([sequence[1:]])), features[None, :-1],
                          torch.arange(len(sequence) - 1)[None], None)[0]
            guesses = lm_head(hidden).argmax(-1)
        for pairs, token in drafter.seen:
            total += 1
            agree += int(guesses[pairs - 1]) == token
    assert accepted_paths >= 3  # steps that accepted drafted tokens: their features were appended too
    assert agree >= 0.95 * total, f"{agree}/{total} root guesses equal the teacher-forced head"


def test_head_with_a_draft_vocabulary_saves_loads_and_stays_lossless(smollm, smollm_reference, random_head,
                                                                      tmp_path):
    """A head restricted to a draft vocabulary (as `train-head --draft-vocab` makes) is written with EAGLE-3's d2t,
    loads back with the same vocabulary, scores only those tokens (the target lm_head's rows), and decodes exactly
    HF greedy's output even though the target's own choices may lie outside it."""
    import copy

    model, tokenizer = smollm
    torch.manual_seed(2)
    chosen = torch.randperm(model.config.vocab_size)[:3000].sort().values
    head = copy.deepcopy(random_head)
    head.restrict_vocabulary(chosen)
    save_eagle_head(head, tmp_path / "head")
    loaded = load_eagle_head(str(tmp_path / "head"), model)
    assert torch.equal(loaded.draft_ids, chosen)
    hidden = torch.randn(1, 3, model.config.hidden_size)
    with torch.inference_mode():
        logits = loaded.logits(hidden, model.get_output_embeddings())
        full = model.get_output_embeddings()(hidden)
    assert torch.allclose(logits[..., chosen], full[..., chosen], atol=1e-5)
    assert torch.isinf(logits).sum() == 3 * (model.config.vocab_size - 3000)
    # drafting ranks within the draft vocabulary: the same candidates as the top-k of the whole-vocabulary logits
    drafter = EagleHeadDrafter(loaded, model)
    with torch.inference_mode():
        drafter.draft_ids = loaded.draft_logits(hidden, model.get_output_embeddings())[1]
        cands = drafter._candidates(loaded.draft_logits(hidden, model.get_output_embeddings())[0], 5)
    expected = torch.softmax(logits, -1).topk(5)
    assert torch.equal(cands.tokens, expected.indices)
    assert torch.allclose(cands.probs, expected.values, atol=1e-6)

    for policy in (Eagle2Policy(4, 4, 16), CastPolicy(flat_costs(), 4.0, 3.0, 2.5, 8, 6, 8, auto=False)):
        engine = Engine(model, tokenizer, EagleHeadDrafter(loaded, model), policy)
        ids = [engine.encode(prompt=p) for p in PROMPTS]
        for got, prompt_ids in zip(engine.generate_batch(prompt_ids=ids, max_new_tokens=20), ids, strict=True):
            assert got.output_ids == smollm_reference(tuple(prompt_ids), 20), policy.name

    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "head" / "model.safetensors"))
    save_file(dict(state, d2t=state["d2t"] + 10 ** 6), str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(CastspecError, match="another tokenizer"):
        load_eagle_head(str(tmp_path / "head"), model)


def test_widened_vocabulary_keeps_the_old_tokens_and_adds_the_most_frequent_answers():
    from castspec.heads.train import TrainingSequence, widened_vocabulary

    data = [TrainingSequence([5, 7, 7, 9, 9, 9, 2], [False, True, True, True, True, True, False])]
    # 9 (3 answer tokens) before 7 (2); 5 and 2 are prompt tokens and do not count; 1 is kept from before
    assert widened_vocabulary(torch.tensor([1]), data, 3).tolist() == [1, 7, 9]
    assert widened_vocabulary(torch.tensor([1]), data, 2).tolist() == [1, 9]
    assert widened_vocabulary(torch.tensor([1, 9]), data, 10).tolist() == [1, 7, 9]  # fewer tokens than asked
    with pytest.raises(CastspecError, match="would drop"):
        widened_vocabulary(torch.tensor([1, 2, 3]), data, 2)


def test_widened_head_drafts_more_tokens_and_stays_lossless(smollm, smollm_reference, random_head, tmp_path):
    """`castspec head-vocab`: a head trained on a small draft vocabulary is copied with the vocabulary widened on
    real ShareGPT answers (no training: the rows are the target's lm_head); the copy keeps every old token, loads
    with its weights unchanged, decodes exactly HF greedy's output, and the command refuses what it cannot do."""
    import copy

    from castspec.bench.prompts import load_sharegpt
    from castspec.cli import main
    from castspec.heads.train import widen_head

    model, tokenizer = smollm
    head = copy.deepcopy(random_head)
    head.restrict_vocabulary(torch.arange(100, 600))
    save_eagle_head(head, tmp_path / "small", {"note": "kept"})
    record = widen_head(str(tmp_path / "small"), model, tokenizer, load_sharegpt(40), 2000, tmp_path / "wide")
    assert record == {"from": str(tmp_path / "small"), "before": 500, "after": 2000}
    wide = load_eagle_head(str(tmp_path / "wide"), model)
    assert set(range(100, 600)) <= set(wide.draft_ids.tolist()) and len(wide.draft_ids) == 2000
    assert all(torch.equal(a, b) for (k, a), (_, b) in zip(head.state_dict().items(), wide.state_dict().items(),
                                                            strict=True) if k != "d2t")
    saved = json.loads((tmp_path / "wide" / "config.json").read_text())["castspec"]
    assert saved["note"] == "kept" and saved["widened_vocabulary"]["after"] == 2000
    engine = Engine(model, tokenizer, EagleHeadDrafter(wide, model), Eagle2Policy(4, 4, 16))
    ids = [engine.encode(prompt=p) for p in PROMPTS]
    for got, prompt_ids in zip(engine.generate_batch(prompt_ids=ids, max_new_tokens=20), ids, strict=True):
        assert got.output_ids == smollm_reference(tuple(prompt_ids), 20)

    with pytest.raises(CastspecError, match="would drop"):
        widen_head(str(tmp_path / "wide"), model, tokenizer, load_sharegpt(5), 100, tmp_path / "narrow")
    with pytest.raises(CastspecError, match="another directory"):
        widen_head(str(tmp_path / "wide"), model, tokenizer, load_sharegpt(5), 3000, tmp_path / "wide")
    save_eagle_head(random_head, tmp_path / "whole")
    assert main(["head-vocab", "--head", str(tmp_path / "whole"), "--target", "smollm2-135m", "--dtype", "fp32",
                 "--size", "100", "--conversations", "3", "--out", str(tmp_path / "x")]) == 2
