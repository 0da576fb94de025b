"""EAGLE-1/2 heads: the published checkpoint layout loads (and wrong heads are refused clearly), the drafter's
cached tree forwards equal a cache-free run of the head, and decoding with a head stays lossless (fp32, real
SmolLM2 weights, HF greedy as the reference)."""

from __future__ import annotations

import json

import pytest
import torch
from synthetic import flat_costs

from castspec import Engine
from castspec.cast import CastPolicy
from castspec.drafters.eagle_head import EagleHead, EagleHeadDrafter, head_config, load_eagle_head, save_eagle_head
from castspec.drafting import _Pool
from castspec.errors import CastspecError
from castspec.policies import ChainPolicy, Eagle2Policy


@pytest.fixture(scope="module")
def random_head(smollm):
    model, _ = smollm
    torch.manual_seed(0)
    head = EagleHead(head_config(model))
    for p in head.parameters():  # larger than the default init, so that the head's choices vary with its inputs
        p.data.normal_(0, 0.05)
    return head.eval()


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
    _write(tmp_path / "eagle3", {"midlayer.hidden_norm.weight": torch.ones(d), "d2t": torch.zeros(8)}, config)
    with pytest.raises(CastspecError, match="EAGLE-3"):
        load_eagle_head(str(tmp_path / "eagle3"), model)
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
        nodes, _ = pool.add_layer([0], cands[row])
        pools.append(pool)
        frontiers.append(nodes[1:3])  # the root's 2nd and 3rd children
        child = int(pool.tokens[nodes[2]])
        deeper = reference(tokens + [child], torch.cat([feats[row], hidden[-1:]]))
        expected.append(torch.softmax(lm_head(deeper[-1]), -1).topk(4))
    second = drafter.expand([p.tree() for p in pools], frontiers, 4)
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
        alone = engine.generate(prompt_ids=ids[0], max_new_tokens=20)
        assert alone.output_ids == smollm_reference(tuple(ids[0]), 20), name
