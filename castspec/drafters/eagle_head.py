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
`embed_tokens.weight` (absent: the target's embeddings are used)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from castspec import kv
from castspec.drafters.draft_model import DraftModelDrafter
from castspec.errors import CastspecError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def head_config(target_model, layers: int = 1) -> LlamaConfig:
    """A head config matching the target's attention geometry (what a head trained here uses)."""
    t = target_model.config
    return LlamaConfig(
        vocab_size=target_model.get_output_embeddings().weight.shape[0], hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, num_hidden_layers=layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=getattr(t, "num_key_value_heads", t.num_attention_heads),
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads, rms_norm_eps=t.rms_norm_eps,
        max_position_embeddings=t.max_position_embeddings, rope_parameters=dict(t.rope_parameters),
        architectures=["LlamaForCausalLM"], torch_dtype="float32",
    )


class EagleHead(nn.Module):
    def __init__(self, config: LlamaConfig, fc_bias: bool = False) -> None:
        super().__init__()
        config._attn_implementation = "sdpa"  # takes the boolean tree masks as they are
        self.config = config
        self.embed_tokens: nn.Embedding | None = None  # None: the target's own embeddings
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, embeddings: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """[B, n, d] token embeddings and target features -> [B, n, d] predicted next features."""
        hidden = self.fc(torch.cat([embeddings, features.to(embeddings.dtype)], dim=-1))
        rope = self.rotary(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=positions, cache=cache,
                           use_cache=cache is not None, position_embeddings=rope)
        return hidden


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


def load_eagle_head(source: str, target_model) -> EagleHead:
    """An EAGLE-1/2 head from a local directory or a hub id, checked against the target it will draft for."""
    directory = _locate(source)
    if not (directory / "config.json").is_file():
        raise CastspecError(f"{directory} has no config.json: not an EAGLE head checkpoint")
    weights = _read_weights(directory)
    if any(k.startswith("midlayer.") or k in ("d2t", "t2d") for k in weights):
        raise CastspecError(f"{source} is an EAGLE-3 head (midlayer / d2t / t2d keys): castspec loads EAGLE-1/2 "
                            "heads only so far")
    if "fc.weight" not in weights:
        raise CastspecError(f"{source}: no fc.weight: not an EAGLE head (keys: {', '.join(sorted(weights)[:6])} ...)")
    try:
        fields = json.loads((directory / "config.json").read_text())
        config = LlamaConfig(**{k: v for k, v in fields.items() if k != "transformers_version"})
    except Exception as e:  # JSON errors and the config class's own validators (not all ValueErrors)
        raise CastspecError(f"{directory / 'config.json'} is not a valid Llama config for an EAGLE head: {e}") from e
    target_hidden = target_model.config.hidden_size
    target_vocab = target_model.get_output_embeddings().weight.shape[0]
    if config.hidden_size != target_hidden or weights["fc.weight"].shape != (target_hidden, 2 * target_hidden):
        raise CastspecError(f"the EAGLE head {source} works on features of size {config.hidden_size} "
                            f"(fc {tuple(weights['fc.weight'].shape)}); the target's are {target_hidden}")
    embed = weights.pop("embed_tokens.weight", None)
    if embed is not None and embed.shape[0] != target_vocab:
        raise CastspecError(f"the EAGLE head {source} embeds {embed.shape[0]} tokens, the target predicts "
                            f"{target_vocab}: it was trained for another tokenizer")
    head = EagleHead(config, fc_bias="fc.bias" in weights)
    weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
    missing, unexpected = head.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.startswith(("embed_tokens", "rotary"))]
    if missing or unexpected:
        raise CastspecError(f"the EAGLE head {source} does not match the EAGLE layout: missing {missing[:5]}, "
                            f"unexpected {unexpected[:5]}")
    if embed is not None:
        head.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
    dtype = next(target_model.parameters()).dtype
    return head.to(device=next(target_model.parameters()).device, dtype=dtype).eval()


def save_eagle_head(head: EagleHead, directory: Path, extra: dict | None = None) -> None:
    """Write the head in the EAGLE layout (no embeddings, no lm_head: both are the target's)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous() for k, v in head.state_dict().items()
             if not k.startswith(("embed_tokens", "rotary"))}
    save_file(state, str(directory / "model.safetensors"))
    config = head.config.to_dict()
    config.pop("_attn_implementation_internal", None)
    if extra:
        config["castspec"] = extra
    (directory / "config.json").write_text(json.dumps(config, indent=1, default=str))


class EagleHeadDrafter(DraftModelDrafter):
    """Drafts with an EAGLE head over the target's features; the target must be verified with
    `feature_layers` (the engine does it when a drafter asks)."""

    name = "eagle-head"
    feature_layers = (-1,)  # the target's last hidden state, after its final norm

    def __init__(self, head: EagleHead, target_model) -> None:
        self.head = head
        self.embed = head.embed_tokens or target_model.get_input_embeddings()
        self.lm_head = target_model.get_output_embeddings()
        super().__init__(head)

    def reset(self, batch_size: int = 1) -> None:
        super().reset(batch_size)
        self.cache = kv.new_cache(self.head)
        self.node_features: list[dict[int, torch.Tensor]] = [{} for _ in range(batch_size)]

    def _paired(self, new_tokens: list[list[int]], features: list[torch.Tensor] | None) -> list[list[int]]:
        if features is None:
            raise CastspecError("the EAGLE head drafts from the target's features: the engine gave none")
        # only the sequence's first token has no feature before it; it is never a head input
        return [tokens[len(tokens) - len(f):] for tokens, f in zip(new_tokens, features, strict=True)]

    @torch.inference_mode()
    def _run(self, tokens, positions, mask, features, last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.head(self.embed(tokens), features, positions, mask, self.cache)
        if last_only:
            hidden = hidden[:, -1:]
        return self.lm_head(hidden), hidden

    def _remember(self, row: int, node: int, hidden: torch.Tensor) -> None:
        self.node_features[row][node] = hidden

    def _parent_feature(self, row: int, pool, node: int) -> torch.Tensor:
        return self.node_features[row][int(pool.parents[node])]

    def end_step(self) -> None:
        super().end_step()
        self.node_features = [{} for _ in self.node_features]

    def keep_rows(self, rows: list[int]) -> None:
        super().keep_rows(rows)
        self.node_features = [{} for _ in rows]
