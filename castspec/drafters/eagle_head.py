"""EAGLE-1/2 feature-level draft head as a drafter.

The head predicts the target's next last-layer feature from (current feature, next token):
    h_t = layers(fc([embed(x_{t+1}) ; f_t]))  ~  f_{t+1},     next-token logits = target.lm_head(h_t).
Pair t sits at head position t. After the target has verified a step, every newly accepted token x_{t+1} comes
with the target's feature f_t of the token before it (the verify pass computed it), so the head absorbs exact
pairs; inside a draft tree a node's input feature is its parent's head output (the head runs on its own
predictions). The head's layers are stock `transformers` Llama decoder layers driven with a tree mask, like
the draft model; the KV bookkeeping is the draft model's (`DraftModelDrafter`), only the forward differs.

Checkpoints use the public EAGLE layout: `config.json` (a Llama config, `num_hidden_layers` = head layers) and
`model.safetensors` or `pytorch_model.bin` with `fc.weight` [d, 2d] (+ optional `fc.bias`), `layers.{i}.*` as in a
Llama decoder layer (layer 0 without `input_layernorm`: EAGLE feeds it the fc output unnormalised) and optionally
`embed_tokens.weight` (absent: the target's embeddings are used); Qwen2 heads add q/k/v biases. EAGLE-3 checkpoints
(`midlayer.*`, `fc.weight` [d, 3 d_target], `norm.weight`, `lm_head.weight` [draft vocab, d], `d2t`, `t2d`; SpecForge
`fc_norm.*`; vLLM speculators' `layers.0.*` with a nested `transformer_layer_config`) load as `Eagle3Head`
(docs/eagle_heads.md lists every published layout and its test)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from castspec.decode import kv
from castspec.drafters.base import Candidates, top_candidates
from castspec.drafters.draft_model import DraftModelDrafter
from castspec.errors import CastspecError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def head_config(target_model, layers: int = 1, attention_bias: bool = False) -> LlamaConfig:
    """A head config matching the target's attention geometry (what a head trained here uses)."""
    t = target_model.config
    return LlamaConfig(attention_bias=attention_bias,
        vocab_size=target_model.get_output_embeddings().weight.shape[0], hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, num_hidden_layers=layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=getattr(t, "num_key_value_heads", t.num_attention_heads),
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads, rms_norm_eps=t.rms_norm_eps,
        max_position_embeddings=t.max_position_embeddings, rope_parameters=dict(t.rope_parameters),
        architectures=["LlamaForCausalLM"], torch_dtype="float32",
    )


class EagleHead(nn.Module):
    feature_layers: tuple[int, ...] = (-1,)  # the target's last hidden state, after its final norm

    def __init__(self, config: LlamaConfig, fc_bias: bool = False, input_norm: bool = False) -> None:
        super().__init__()
        config._attn_implementation = "sdpa"  # takes the boolean tree masks as they are
        self.config = config
        self.embed_tokens: nn.Embedding | None = None  # None: the target's own embeddings
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        if not input_norm:  # EAGLE's layout; a head started from a target layer keeps that layer's norm
            self.layers[0].input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", None)  # None: the target's whole vocabulary
        self._draft_weight: tuple[tuple, torch.Tensor] | None = None  # ((lm_head, dtype) it was made for, rows)

    def restrict_vocabulary(self, token_ids: torch.Tensor) -> None:
        """Draft only among `token_ids` (target ids): the head's logits are the target lm_head's rows for those
        tokens, so a head over 16 k of Qwen's 152 k tokens spends a ninth of the time in its lm_head. Saved as
        EAGLE-3's `d2t` (target id = draft id + d2t[draft id]); tokens outside get probability 0, which the
        verification takes as the draft distribution, so output stays exact."""
        ids = torch.as_tensor(token_ids, dtype=torch.long).unique(sorted=True)
        self.d2t = ids - torch.arange(len(ids))
        self._draft_weight = None

    @property
    def draft_ids(self) -> torch.Tensor | None:
        """The target ids of the draft vocabulary (None: the whole vocabulary)."""
        return _target_ids(self)

    def forward(self, embeddings: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """[B, n, d] token embeddings and target features -> [B, n, d] predicted next features."""
        hidden = self.fc(torch.cat([embeddings, features.to(embeddings.dtype)], dim=-1))
        rope = self.rotary(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=positions, cache=cache,
                           use_cache=cache is not None, position_embeddings=rope)
        return hidden

    def draft_logits(self, hidden: torch.Tensor, target_lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits over the draft vocabulary, its target ids), or (logits over the target's, None): what
        drafting needs, since a top-k never leaves the draft vocabulary and placing 16 k logits among 152 k
        costs more than computing them."""
        ids = self.draft_ids
        if ids is None:
            return target_lm_head(hidden), None
        made_for = (target_lm_head.weight, hidden.dtype)
        if self._draft_weight is None or any(a is not b for a, b in zip(self._draft_weight[0], made_for, strict=True)):
            self._draft_weight = (made_for, target_lm_head.weight.detach()[ids].to(hidden.dtype))
        return torch.nn.functional.linear(hidden, self._draft_weight[1]), ids

    def logits(self, hidden: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """Target-vocabulary logits: tokens outside the draft vocabulary get -inf (probability 0)."""
        return in_target_vocabulary(*self.draft_logits(hidden, target_lm_head), target_lm_head.weight.shape[0])


class Eagle3Head(nn.Module):
    """EAGLE-3: fc fuses three target layers' hidden states (low, middle, high) into one feature; the single
    `midlayer` attends over [input_layernorm(embedding) ; hidden_norm(feature)] (2d wide q/k/v) and adds the
    result to the feature; its own norm + lm_head predict over a reduced draft vocabulary, mapped to target ids
    by d2t (target id = draft id + d2t[draft id]). Inside a tree a node's feature is its parent's output,
    taken as it is (not through fc)."""

    def __init__(self, config: LlamaConfig, target_hidden: int, draft_vocab: int, feature_layers: tuple[int, ...],
                 fc_norm: bool = False) -> None:
        super().__init__()
        config._attn_implementation = "sdpa"
        self.config, self.feature_layers = config, tuple(feature_layers)
        d, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or d // heads
        self.embed_tokens: nn.Embedding | None = None
        self.fc = nn.Linear(len(self.feature_layers) * target_hidden, d, bias=False)
        # SpecForge "fc_norm": each target layer's hidden state through its own RMSNorm before fc
        self.fc_norm = nn.ModuleList(LlamaRMSNorm(target_hidden, eps=config.rms_norm_eps)
                                     for _ in self.feature_layers) if fc_norm else None
        self.midlayer = LlamaDecoderLayer(config, 0)
        bias = bool(getattr(config, "attention_bias", False))
        self.midlayer.self_attn.q_proj = nn.Linear(2 * d, heads * head_dim, bias=bias)
        self.midlayer.self_attn.k_proj = nn.Linear(2 * d, kv_heads * head_dim, bias=bias)
        self.midlayer.self_attn.v_proj = nn.Linear(2 * d, kv_heads * head_dim, bias=bias)
        self.midlayer.hidden_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(d, draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, embeddings: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        features = features.to(embeddings.dtype)
        # target features arrive as the fused layers (wider than d); a tree node's feature is already d wide
        if features.shape[-1] != self.config.hidden_size:
            if self.fc_norm is not None:
                parts = features.chunk(len(self.fc_norm), dim=-1)
                features = torch.cat([norm(part) for norm, part in zip(self.fc_norm, parts, strict=True)], dim=-1)
            hidden = self.fc(features)
        else:
            hidden = features
        layer = self.midlayer
        fused = torch.cat([layer.input_layernorm(embeddings), layer.hidden_norm(hidden)], dim=-1)
        attended, _ = layer.self_attn(hidden_states=fused, attention_mask=mask, position_ids=positions,
                                      cache=cache, use_cache=cache is not None,
                                      position_embeddings=self.rotary(hidden, positions))
        hidden = hidden + attended
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    @property
    def draft_ids(self) -> torch.Tensor:
        """The target ids of the draft vocabulary."""
        return _target_ids(self)

    def draft_logits(self, hidden: torch.Tensor, target_lm_head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits over the draft vocabulary, its target ids)."""
        return self.lm_head(self.norm(hidden)), _target_ids(self)

    def logits(self, hidden: torch.Tensor, target_lm_head: nn.Module) -> torch.Tensor:
        """Target-vocabulary logits: tokens outside the draft vocabulary get -inf (probability 0)."""
        return in_target_vocabulary(*self.draft_logits(hidden, target_lm_head), self.t2d.shape[0])


def eagle3_feature_layers(target_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default low / middle / high features: the hidden states entering layers 2, L/2 and L-3
    (outputs of the layer before each); in `transformers`' hidden_states tuple (entry 0 = embeddings) that is
    index i for "entering layer i". A checkpoint's config names them as `eagle_aux_hidden_state_layer_ids`,
    counted from 0 for the output of layer 0, i.e. index - 1."""
    return 2, target_layers // 2, target_layers - 3


def _target_ids(head: EagleHead | Eagle3Head) -> torch.Tensor | None:
    """The target ids of a head's draft vocabulary (target id = draft id + d2t[draft id]); made per call, since
    it costs microseconds and `d2t` may be replaced or loaded into at any time."""
    d2t = head.d2t
    return None if d2t is None else torch.arange(len(d2t), device=d2t.device) + d2t


def in_target_vocabulary(draft_logits: torch.Tensor, target_ids: torch.Tensor | None, vocab_size: int
                         ) -> torch.Tensor:
    """Logits over a draft vocabulary placed at their target ids; every other token gets -inf (probability 0).
    `target_ids` None: the logits already cover the target's vocabulary."""
    if target_ids is None:
        return draft_logits
    full = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))
    full[..., target_ids] = draft_logits
    return full


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = directory / name
        if file.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
    raise CastspecError(f"{directory} holds no head weights (looked for {', '.join(WEIGHT_FILES)})")


def _locate(source: str) -> Path:
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists() or source.count("/") != 1:
        raise CastspecError(f"EAGLE head {source!r}: not a directory with config.json (nor a hub id 'owner/name')")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, allow_patterns=["config.json", *WEIGHT_FILES]))
    except Exception as e:  # no network here, a missing repo, ...: one clear message
        raise CastspecError(f"could not fetch the EAGLE head {source!r} from the hub: {e}") from e


def load_eagle_head(source: str, target_model, dtype: torch.dtype | None = None) -> EagleHead | Eagle3Head:
    """An EAGLE-1/2 or EAGLE-3 head from a local directory or a hub id, checked against the target it will
    draft for, in `dtype` (default: the target's)."""
    directory = _locate(source)
    if not (directory / "config.json").is_file():
        raise CastspecError(f"{directory} has no config.json: not an EAGLE head checkpoint")
    weights = _read_weights(directory)
    if "fc.weight" not in weights:
        raise CastspecError(f"{source}: no fc.weight: not an EAGLE head (keys: {', '.join(sorted(weights)[:6])} ...)")
    try:
        fields = json.loads((directory / "config.json").read_text())
    except ValueError as e:
        raise CastspecError(f"{directory / 'config.json'} is not valid JSON: {e}") from e
    fields, aux_ids_shift = _head_fields(source, fields)
    try:
        config = LlamaConfig(**fields)
    except Exception as e:  # the config class's own validators (not all ValueErrors)
        raise CastspecError(f"{directory / 'config.json'} is not a valid Llama config for an EAGLE head: {e}") from e
    weights = _canonical_keys(source, weights)
    target_hidden = target_model.config.hidden_size
    target_vocab = target_model.get_output_embeddings().weight.shape[0]
    if any(k.startswith("midlayer.") for k in weights):
        head = _eagle3(source, config, weights, target_model, target_hidden, target_vocab, aux_ids_shift)
    else:
        head = _eagle1(source, config, weights, target_hidden, target_vocab)
    param = next(target_model.parameters())
    return head.to(device=param.device, dtype=dtype or param.dtype).eval()


def _head_fields(source: str, fields: dict) -> tuple[dict, int]:
    """A published head's config as LlamaConfig fields, and how its aux-layer ids count: SpecForge / SGLang
    ids name a layer's output (hidden_states index id + 1), vLLM speculators' the hidden state entering it."""
    if not isinstance(fields, dict):
        raise CastspecError(f"the EAGLE head {source}: config.json is not a JSON object")
    shift = 1
    if "transformer_layer_config" in fields:  # vLLM speculators: the layer's config nested, the rest on top
        for flag in ("norm_before_fc", "norm_before_residual"):
            if fields.get(flag):
                raise CastspecError(f"the EAGLE-3 head {source} sets {flag}: that variant is not supported")
        outer = fields
        fields = dict(outer["transformer_layer_config"] or {})
        for key in ("draft_vocab_size", "target_hidden_size", "fc_norm"):
            if outer.get(key) is not None:
                fields[key] = outer[key]
        if outer.get("eagle_aux_hidden_state_layer_ids"):
            fields["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": outer["eagle_aux_hidden_state_layer_ids"]}
            shift = 0
    fields = {k: v for k, v in fields.items() if k not in ("transformers_version", "model_type", "auto_map")}
    if "max_position_embeddings" not in fields and "max_sequence_length" in fields:  # Vicuna-33B's head
        fields["max_position_embeddings"] = fields["max_sequence_length"]
    return fields, shift


def _canonical_keys(source: str, weights: dict) -> dict:
    """Weights under the key names this module uses: vLLM speculators write EAGLE-3's `midlayer.` as
    `layers.0.`; a layer this module cannot build is refused by name."""
    if "layers.0.hidden_norm.weight" in weights:
        weights = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                   for k, v in weights.items()}
    unsupported = [k for k in weights if k.endswith(("q_norm.weight", "k_norm.weight")) or k.startswith("input_norm")]
    if unsupported:
        raise CastspecError(f"the EAGLE head {source} has {unsupported[0]} (Qwen3-style q/k norms or a norm before "
                            "fc): a head layout this loader does not build")
    return weights


def _match_projection_biases(layer: nn.Module, prefix: str, weights: dict) -> None:
    """Give q/k/v/o exactly the biases the checkpoint has: Qwen2 EAGLE heads (`qkv_bias`) carry q/k/v biases
    and none on o_proj, which no single LlamaConfig flag builds."""
    attention = layer.self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        old = getattr(attention, name)
        wanted = f"{prefix}self_attn.{name}.bias" in weights
        if wanted != (old.bias is not None):
            setattr(attention, name, nn.Linear(old.in_features, old.out_features, bias=wanted))


def _eagle1(source: str, config: LlamaConfig, weights: dict, target_hidden: int, target_vocab: int) -> EagleHead:
    if config.hidden_size != target_hidden or weights["fc.weight"].shape != (target_hidden, 2 * target_hidden):
        raise CastspecError(f"the EAGLE head {source} works on features of size {config.hidden_size} "
                            f"(fc {tuple(weights['fc.weight'].shape)}); the target's are {target_hidden}")
    embed = weights.pop("embed_tokens.weight", None)
    if embed is not None and embed.shape[0] != target_vocab:
        raise CastspecError(f"the EAGLE head {source} embeds {embed.shape[0]} tokens, the target predicts "
                            f"{target_vocab}: it was trained for another tokenizer")
    head = EagleHead(config, fc_bias="fc.bias" in weights, input_norm="layers.0.input_layernorm.weight" in weights)
    for i, layer in enumerate(head.layers):
        _match_projection_biases(layer, f"layers.{i}.", weights)
    d2t = weights.pop("d2t", None)
    weights = {k: v for k, v in weights.items() if not k.startswith(("lm_head.", "t2d"))}
    missing, unexpected = head.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens", "rotary"))]
    if missing or unexpected:
        raise CastspecError(f"the EAGLE head {source} does not match the EAGLE layout: missing {missing[:5]}, "
                            f"unexpected {unexpected[:5]}")
    if embed is not None:
        head.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
    if d2t is not None:  # a draft vocabulary (heads trained here with --draft-vocab)
        ids = torch.arange(len(d2t)) + d2t
        if len(d2t) == 0 or int(ids.min()) < 0 or int(ids.max()) >= target_vocab:
            raise CastspecError(f"the EAGLE head {source} drafts over token ids outside the target's vocabulary of "
                                f"{target_vocab}: it was trained for another tokenizer")
        head.restrict_vocabulary(ids)
    return head


def _eagle3(source: str, config: LlamaConfig, weights: dict, target_model, target_hidden: int,
            target_vocab: int, aux_ids_shift: int = 1) -> Eagle3Head:
    if "lm_head.weight" not in weights:
        raise CastspecError(f"the EAGLE-3 head {source} has no lm_head.weight (a head drafting through the "
                            "target's lm_head is not supported)")
    if "d2t" not in weights:  # speculators leave the mapping out when the draft vocabulary is the target's
        if weights["lm_head.weight"].shape[0] != target_vocab:
            raise CastspecError(f"the EAGLE-3 head {source} has no d2t, and its lm_head predicts "
                                f"{weights['lm_head.weight'].shape[0]} tokens, not the target's {target_vocab}")
        weights["d2t"] = torch.zeros(target_vocab, dtype=torch.long)
        weights.setdefault("t2d", torch.ones(target_vocab, dtype=torch.bool))
    aux = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = (tuple(i + aux_ids_shift for i in aux) if aux
              else eagle3_feature_layers(target_model.config.num_hidden_layers))
    fc = weights["fc.weight"]
    if fc.shape[1] != len(layers) * target_hidden:
        raise CastspecError(f"the EAGLE-3 head {source} fuses features of width {fc.shape[1]}; this target gives "
                            f"{len(layers)} x {target_hidden} = {len(layers) * target_hidden}")
    draft_vocab = weights["lm_head.weight"].shape[0]
    t2d = weights.get("t2d")
    if (t2d is not None and t2d.shape[0] != target_vocab) or int((torch.arange(draft_vocab) + weights["d2t"]).max()
                                                                  ) >= target_vocab:
        raise CastspecError(f"the EAGLE-3 head {source} maps its {draft_vocab} draft tokens into a vocabulary other "
                            f"than the target's {target_vocab}: it was trained for another tokenizer")
    config.vocab_size = target_vocab
    head = Eagle3Head(config, target_hidden, draft_vocab, layers,
                      fc_norm=any(k.startswith("fc_norm.") for k in weights))
    _match_projection_biases(head.midlayer, "midlayer.", weights)
    embed = weights.pop("embed_tokens.weight", None)
    weights.setdefault("t2d", torch.zeros(target_vocab, dtype=torch.bool))
    missing, unexpected = head.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CastspecError(f"the EAGLE-3 head {source} does not match the EAGLE-3 layout: missing {missing[:5]}, "
                            f"unexpected {unexpected[:5]}")
    if embed is not None:
        if embed.shape[0] != target_vocab:
            raise CastspecError(f"the EAGLE-3 head {source} embeds {embed.shape[0]} tokens, the target has "
                                f"{target_vocab}: it was trained for another tokenizer")
        head.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
    return head


def save_eagle_head(head: EagleHead | Eagle3Head, directory: Path, extra: dict | None = None) -> None:
    """Write the head in the EAGLE layout (no embeddings, no lm_head: both are the target's), or an EAGLE-3
    head in the EAGLE-3 layout (its own lm_head, d2t, t2d; the target's embeddings)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().float() if v.is_floating_point() else v).contiguous() for k, v in head.state_dict().items()
             if not k.startswith(("embed_tokens", "rotary"))}
    save_file(state, str(directory / "model.safetensors"))
    config = head.config.to_dict()
    config.pop("_attn_implementation_internal", None)
    if extra:
        config["castspec"] = extra
    (directory / "config.json").write_text(json.dumps(config, indent=1, default=str))


class EagleHeadDrafter(DraftModelDrafter):
    """Drafts with an EAGLE-1/2 or EAGLE-3 head over the target's features; the engine verifies with the
    head's `feature_layers` and hands the features to `begin`."""

    name = "eagle-head"

    def __init__(self, head: EagleHead | Eagle3Head, target_model) -> None:
        self.head, self.feature_layers = head, head.feature_layers
        self.embed = head.embed_tokens or target_model.get_input_embeddings()
        self.lm_head = target_model.get_output_embeddings()
        self.draft_ids: torch.Tensor | None = None  # of the latest forward's logits (None: the whole vocabulary)
        super().__init__(head)

    def reset(self, batch_size: int = 1) -> None:
        super().reset(batch_size)
        self.cache = kv.new_cache(self.head)
        self._forget_tree(batch_size)

    def _paired(self, new_tokens: list[list[int]], features: list[torch.Tensor] | None) -> list[list[int]]:
        if features is None:
            raise CastspecError("the EAGLE head drafts from the target's features: the engine gave none")
        # only the sequence's first token has no feature before it; it is never a head input
        return [tokens[len(tokens) - len(f):] for tokens, f in zip(new_tokens, features, strict=True)]

    @torch.inference_mode()
    def _run(self, tokens, positions, mask, features, last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits over the head's draft vocabulary (`_candidates` maps them to target ids)."""
        hidden = self.head(self.embed(tokens), features, positions, mask, self.cache)
        if last_only:
            hidden = hidden[:, -1:]
        logits, self.draft_ids = self.head.draft_logits(hidden, self.lm_head)
        return logits, hidden

    def _candidates(self, logits: torch.Tensor, top_k: int) -> Candidates:
        if self.draft_ids is None:
            return super()._candidates(logits, top_k)
        if self.sampling is not None:  # verification needs the proposal over the target's whole vocabulary
            return super()._candidates(in_target_vocabulary(logits, self.draft_ids, self.lm_head.weight.shape[0]),
                                       top_k)
        top = top_candidates(logits, top_k)  # the softmax over the draft vocabulary: tokens outside have p = 0
        return Candidates(self.draft_ids[top.tokens], top.probs)

    def _remember_roots(self, hidden: torch.Tensor) -> None:
        self.step_hidden = hidden[:, None]  # [B, slots, d]: this step's predicted features, the roots' first
        self.hidden_slot = [{0: 0} for _ in range(hidden.shape[0])]  # per row: pool node -> slot

    def _remember_frontier(self, frontiers: list[list[int]], hidden: torch.Tensor) -> None:
        offset = self.step_hidden.shape[1]
        self.step_hidden = torch.cat([self.step_hidden, hidden], dim=1)
        for slots, frontier in zip(self.hidden_slot, frontiers, strict=True):
            slots.update(zip(frontier, range(offset, offset + len(frontier)), strict=True))

    def _frontier_features(self, pools, frontiers: list[list[int]], width: int) -> torch.Tensor:
        index = [[slots[pool.parents[node]] for node in frontier] + [0] * (width - len(frontier))
                 for slots, pool, frontier in zip(self.hidden_slot, pools, frontiers, strict=True)]
        index = torch.tensor(index, device=self.step_hidden.device)[:, :, None]
        return self.step_hidden.gather(1, index.expand(-1, -1, self.step_hidden.shape[2]))

    def end_step(self) -> None:
        super().end_step()
        self._forget_tree(len(self.lengths))

    def _forget_tree(self, rows: int) -> None:
        self.step_hidden: torch.Tensor | None = None
        self.hidden_slot: list[dict[int, int]] = [{} for _ in range(rows)]

    def keep_rows(self, rows: list[int]) -> None:
        super().keep_rows(rows)
        self._forget_tree(len(rows))

    def add_rows(self, count: int) -> None:
        super().add_rows(count)
        self._forget_tree(len(self.lengths))
