"""Every published EAGLE head layout (/work/shared/reference/EAGLE_LAYOUTS.md) loads through the public entry point
and decodes losslessly: small random heads written with the published key names, dtypes, file names and config
fields, for SmolLM2 and for the Qwen pair's geometry (Qwen2.5-Coder-0.5B as the target, fp32). Each loaded head
must compute what the head that was written computes, and its greedy decoding must equal HF's."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf_greedy
from torch import nn

from castspec import Engine
from castspec.drafters.eagle_head import Eagle3Head, EagleHead, eagle3_feature_layers, head_config
from castspec.errors import CastspecError

PROMPTS = ["def add(a, b):\n    return", "1, 2, 3, 1, 2, 3, 1,"]
TREE = {"method": "eagle2", "top_k": 4, "depth": 3, "total_tokens": 12}


@pytest.fixture(scope="module")
def qwen_small():
    from castspec.models import load_model

    return load_model("qwen2.5-coder-0.5b", "fp32")


def _randomise(module: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    for p in module.parameters():
        p.data.normal_(0, 0.05)
    return module


def _config(model, **changes) -> dict:
    config = head_config(model).to_dict()
    config.pop("_attn_implementation_internal", None)
    config.update(changes)
    return {k: v for k, v in config.items() if v is not None}


def _write(directory, state: dict, config: dict, stored: torch.dtype, file: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    state = {k: (v.to(stored) if v.is_floating_point() else v).contiguous() for k, v in state.items()}
    if file == "pytorch_model.bin":
        torch.save(state, directory / file)
    else:
        from safetensors.torch import save_file

        save_file(state, str(directory / file))


def _rounded(module: nn.Module, stored: torch.dtype) -> nn.Module:
    """The written head as the loader will see it: its weights through the stored dtype and back."""
    for p in module.parameters():
        p.data = p.data.to(stored).float()
    return module


def _eagle1_head(model, config: dict, seed: int, qkv_bias: bool = False, fc_bias: bool = True) -> EagleHead:
    from transformers import LlamaConfig

    head = EagleHead(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"}), fc_bias=fc_bias)
    if qkv_bias:
        attention = head.layers[0].self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attention, name)
            setattr(attention, name, nn.Linear(old.in_features, old.out_features, bias=True))
    return _randomise(head, seed).eval()


def _state(head: nn.Module) -> dict:
    return {k: v for k, v in head.state_dict().items() if not k.startswith("rotary")}


def _check(model_name: str, model, tokenizer, directory, source: nn.Module, uses_embeddings_from=None) -> None:
    """The public entry point loads it; the loaded head computes what `source` computes; decoding is exact."""
    engine = Engine.load(model_name, head=str(directory), dtype="fp32", **TREE)
    head = engine.drafter.head
    assert type(head) is type(source)
    d = model.config.hidden_size
    embed = (uses_embeddings_from or model.get_input_embeddings())(torch.tensor([[5, 9, 11, 3]]))
    width = source.fc.in_features - (d if isinstance(source, EagleHead) else 0)
    features = torch.randn(1, 4, width)
    with torch.inference_mode():
        torch.testing.assert_close(head(embed, features, torch.arange(4)[None], None),
                                   source(embed, features, torch.arange(4)[None], None), rtol=1e-4, atol=1e-5)
    drafted = 0
    for prompt in PROMPTS:
        ids = engine.encode(prompt=prompt)
        got = engine.generate(prompt_ids=ids, max_new_tokens=16)
        assert got.output_ids == hf_greedy(model, ids, 16), (directory.name, prompt)
        drafted += sum(s.tree_size for s in got.steps)
    assert drafted > 0  # the head really drafted


def test_safeailab_eagle1_fp32_bin_with_fc_bias_and_no_kv_heads_field(smollm, tmp_path):
    """Vicuna / LLaMA2 heads: fp32 in pytorch_model.bin although the config says float16, fc.bias, embeddings
    included, no layer-0 input norm, and no num_key_value_heads in the config."""
    model, tokenizer = smollm
    config = _config(model, torch_dtype="float16")
    heads = config["num_attention_heads"]
    config.pop("num_key_value_heads")  # absent: it defaults to the attention heads (full multi-head attention)
    config.pop("head_dim", None)
    source = _eagle1_head(model, dict(config, num_key_value_heads=heads), 1)
    state = _state(source) | {"embed_tokens.weight": model.get_input_embeddings().weight.detach()}
    _write(tmp_path / "vicuna", state, config, torch.float32, "pytorch_model.bin")
    _check("smollm2-135m", model, tokenizer, tmp_path / "vicuna", source)


def test_safeailab_eagle1_fp16_bin_without_fc_bias(smollm, tmp_path):
    """LLaMA3 heads: fp16 in pytorch_model.bin, `"bias": false` and no fc.bias, rope_theta set."""
    model, tokenizer = smollm
    config = _config(model, bias=False, torch_dtype="float16", rope_theta=100000.0)
    config.pop("rope_parameters", None)
    source = _eagle1_head(model, config, 2, fc_bias=False)
    _write(tmp_path / "llama3", _state(source), config, torch.float16, "pytorch_model.bin")
    _check("smollm2-135m", model, tokenizer, tmp_path / "llama3", _rounded(source, torch.float16))


def test_safeailab_qwen2_eagle1_with_qkv_bias_and_full_multi_head_attention(qwen_small, tmp_path):
    """EAGLE-Qwen2 heads: a Qwen2ForCausalLM config with `"qkv_bias": true` (q/k/v biases, none on o_proj), as
    many KV heads as attention heads while the target groups its KV heads, rope_theta 1e6, bf16 weights."""
    model, tokenizer = qwen_small
    heads = model.config.num_attention_heads
    assert model.config.num_key_value_heads < heads
    config = _config(model, architectures=["Qwen2ForCausalLM"], model_type="qwen2", qkv_bias=True,
                     num_key_value_heads=heads, rope_theta=1000000.0, sliding_window=131072,
                     use_sliding_window=False, max_window_layers=28, torch_dtype="bfloat16")
    config.pop("rope_parameters", None)
    source = _eagle1_head(model, config, 3, qkv_bias=True)
    state = _state(source)
    assert "layers.0.self_attn.q_proj.bias" in state and "layers.0.self_attn.o_proj.bias" not in state
    _write(tmp_path / "qwen2", state, config, torch.bfloat16, "pytorch_model.bin")
    _check("qwen2.5-coder-0.5b", model, tokenizer, tmp_path / "qwen2", _rounded(source, torch.bfloat16))


def _eagle3_head(model, config: dict, draft_vocab: int, layers: tuple[int, ...], seed: int,
                 fc_norm: bool = False) -> Eagle3Head:
    from transformers import LlamaConfig

    fields = {k: v for k, v in config.items() if k not in ("model_type", "draft_vocab_size", "eagle_config")}
    fields["vocab_size"] = model.config.vocab_size
    return _randomise(Eagle3Head(LlamaConfig(**fields), model.config.hidden_size, draft_vocab, layers,
                                 fc_norm=fc_norm), seed).eval()


def _vocabulary(model, size: int, seed: int) -> dict:
    vocab = model.config.vocab_size
    chosen = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[:size].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return {"d2t": chosen - torch.arange(size), "t2d": t2d}


def test_safeailab_eagle3_fp16_bin_with_midlayer_and_offsets(smollm, tmp_path):
    """EAGLE-3 heads from the EAGLE repo: fp16 pytorch_model.bin, midlayer.*, d2t int64 offsets, t2d bool, no
    embeddings, architectures LlamaForCausalLM with draft_vocab_size, no aux-layer ids (the default three)."""
    model, tokenizer = smollm
    config = _config(model, draft_vocab_size=4096, torch_dtype="float16")
    layers = eagle3_feature_layers(model.config.num_hidden_layers)
    source = _eagle3_head(model, config, 4096, layers, 4)
    state = _state(source) | _vocabulary(model, 4096, 4)
    _write(tmp_path / "eagle3", state, config, torch.float16, "pytorch_model.bin")
    source.load_state_dict(state)
    _check("smollm2-135m", model, tokenizer, tmp_path / "eagle3", _rounded(source, torch.float16))


def test_specforge_eagle3_with_aux_ids_head_dim_and_fc_norm(qwen_small, tmp_path):
    """SpecForge / SGLang heads: model.safetensors (bf16), LlamaForCausalLMEagle3, model_type llama for a Qwen
    target, explicit head_dim, eagle_config aux ids (a layer's output: hidden_states index id + 1), fc_norm."""
    model, tokenizer = qwen_small
    n = model.config.num_hidden_layers
    aux = [1, n // 2 - 1, n - 4]
    config = _config(model, architectures=["LlamaForCausalLMEagle3"], model_type="llama", draft_vocab_size=8192,
                     head_dim=model.config.hidden_size // model.config.num_attention_heads, fc_norm=True,
                     eagle_config={"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
                     target_model_type="qwen2", dtype="bfloat16")
    source = _eagle3_head(model, config, 8192, tuple(i + 1 for i in aux), 5, fc_norm=True)
    state = _state(source) | _vocabulary(model, 8192, 5)
    assert "fc_norm.2.weight" in state
    _write(tmp_path / "specforge", state, config, torch.bfloat16, "model.safetensors")
    source.load_state_dict(state)
    _check("qwen2.5-coder-0.5b", model, tokenizer, tmp_path / "specforge", _rounded(source, torch.bfloat16))


def test_vllm_speculators_eagle3_with_layers_0_keys_and_the_full_vocabulary(smollm, tmp_path):
    """vLLM speculators heads: Eagle3Speculator config (the layer's config nested as transformer_layer_config,
    aux ids on top counted as the hidden state entering a layer), layers.0.* keys, its own embed_tokens, and no
    d2t / t2d because the draft vocabulary is the target's."""
    model, tokenizer = smollm
    n = model.config.num_hidden_layers
    layer_config = _config(model)
    aux = [2, n // 2, n - 3]
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "speculators_version": "0.1.0.dev14", "auto_map": {"": "eagle3.Eagle3SpeculatorConfig"},
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5}],
                                     "verifier": {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}},
              "transformer_layer_config": layer_config, "draft_vocab_size": model.config.vocab_size,
              "norm_before_residual": False, "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": aux,
              "torch_dtype": "float32"}
    source = _eagle3_head(model, layer_config, model.config.vocab_size, tuple(aux), 6)
    source.embed_tokens = nn.Embedding.from_pretrained(torch.randn(model.config.vocab_size, 576) * 0.05)
    state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
             for k, v in _state(source).items() if k not in ("d2t", "t2d")}
    _write(tmp_path / "speculators", state, config, torch.float32, "model.safetensors")
    _check("smollm2-135m", model, tokenizer, tmp_path / "speculators", source,
           uses_embeddings_from=source.embed_tokens)
    config["norm_before_fc"] = True
    (tmp_path / "speculators" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CastspecError, match="norm_before_fc: that variant is not supported"):
        Engine.load("smollm2-135m", head=str(tmp_path / "speculators"), dtype="fp32", **TREE)
