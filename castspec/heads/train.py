"""Training an EAGLE-1/2 or EAGLE-3 head for a target on this machine.

1. Conversations (ShareGPT, or a JSONL file) are rendered with the target's chat template and cut to
   `max_length` tokens; the responses are the data's own, or the target's when the file comes from
   `castspec regenerate`. `--init` starts from an existing head (fine-tuning) instead of a fresh one.
   With `--loss-on responses` (the default, as EAGLE's loss mask) only predictions of assistant tokens count:
   drafting only ever predicts responses, and prompts (user text, system prompts) would spend the head's small
   capacity on text it never drafts. The prompt tokens still feed the head as context.
2. The target runs once over every sequence; its last-layer features (after the final norm) are cached to disk
   in shards, so a second run (or `--resume`) skips what is done.
3. The head learns h_t = head(embed(x_{t+1}), f_t) ~ f_{t+1} with EAGLE's loss: smooth-L1 on the feature plus
   0.1 x cross-entropy between lm_head(h_t) and the target's own next-token distribution lm_head(f_{t+1}).
   Input features get a little noise so that the head tolerates its own (imperfect) predictions when it runs
   on them inside a draft tree. Checkpoints (head, optimiser, step) go to OUT/checkpoint.pt; the head itself
   to OUT/model.safetensors + config.json in the EAGLE layout after every checkpoint.
With `--arch eagle3` the head is EAGLE-3's: its input is the target's low, middle and high layers side by side
(cached with the last layer, which only gives the distribution to learn), it predicts through its own lm_head
over a draft vocabulary, and its loss is the cross-entropy alone; the checkpoint is in the EAGLE-3 layout."""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import DynamicCache

from castspec.decode.target import join_features
from castspec.drafters.eagle_head import (
    Eagle3Head,
    EagleHead,
    eagle3_feature_layers,
    head_config,
    load_eagle_head,
    save_eagle_head,
)
from castspec.errors import CastspecError
from castspec.heads.config import ARCH, LAYER_INIT, LOSS_ON, TrainConfig


class TrainingSequence(NamedTuple):
    ids: list[int]
    response: list[bool]  # per token: part of an assistant turn (what drafting predicts)


def training_sequences(tokenizer, conversations: list[list[dict]], max_length: int) -> list[TrainingSequence]:
    out = []
    for turns in conversations:
        try:
            ids = _template(tokenizer, turns)
            response = [False] * len(ids)
            for start, end in _assistant_spans(tokenizer, turns, ids):
                response[start:end] = [True] * (end - start)
        except Exception:  # noqa: BLE001 - a template that rejects a conversation's turn order: skip it
            continue
        if len(ids) >= 16:
            out.append(TrainingSequence(ids[:max_length], response[:max_length]))
    if not out:
        raise CastspecError("no usable training sequences (each needs at least 16 tokens)")
    return out


def _template(tokenizer, turns: list[dict], generation_prompt: bool = False) -> list[int]:
    ids = tokenizer.apply_chat_template(turns, tokenize=True, add_generation_prompt=generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _assistant_spans(tokenizer, turns: list[dict], ids: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each assistant turn's tokens in `ids` (its end-of-turn tokens included): where the
    conversation so far plus the generation prompt ends, up to where the conversation through that turn ends.
    A template whose renderings are not prefixes of each other (some rewrite earlier turns) gives the whole
    sequence: every token then counts, as with --loss-on all."""
    spans = []
    for i, turn in enumerate(turns):
        if turn.get("role") != "assistant":
            continue
        before, through = _template(tokenizer, turns[:i], True) if i else [], _template(tokenizer, turns[: i + 1])
        if ids[: len(before)] != before or ids[: len(through)] != through:
            return [(0, len(ids))]
        spans.append((len(before), len(through)))
    return spans


@torch.inference_mode()
def cache_features(model, sequences: list[list[int]], directory: Path, shard_size: int = 16,
                   layers: tuple[int, ...] = (-1,)) -> list[Path]:
    """The target's features of every sequence (the hidden states of `layers` side by side, as
    `target.join_features` gives them; -1 is the last layer's, after the final norm), in shards of `shard_size`
    sequences (bf16 on disk). A shard already there is kept when it holds exactly its sequences at this width,
    so data that grew at its end (a `regenerate` run continued) only costs its new sequences; other shards are
    computed again."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    width_per_token = len(layers) * model.config.hidden_size
    shards = [directory / f"shard-{i:05d}.safetensors" for i in range(math.ceil(len(sequences) / shard_size))]
    todo = [i for i, s in enumerate(shards)
            if not _holds(s, sequences[i * shard_size: (i + 1) * shard_size], width_per_token)]
    if todo:
        bar = tqdm(total=sum(len(s) for s in sequences), desc="target features", unit="tok")
        bar.update(sum(len(s) for i in range(len(shards)) if i not in todo
                       for s in sequences[i * shard_size: (i + 1) * shard_size]))
        for i in todo:
            chunk = sequences[i * shard_size: (i + 1) * shard_size]
            width = max(len(s) for s in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            lengths = torch.tensor([len(s) for s in chunk])
            for row, s in enumerate(chunk):
                ids[row, : len(s)] = torch.tensor(s)
            features = torch.zeros(len(chunk), width, width_per_token, dtype=torch.bfloat16)
            for row, s in enumerate(chunk):  # one at a time: no padding cost on a CPU
                # logits_to_keep=1: the features are all we need, not 152 k logits per token
                out = model(ids[row: row + 1, : len(s)], output_hidden_states=True, logits_to_keep=1)
                features[row, : len(s)] = join_features(out, layers)[0].to(torch.bfloat16)
                bar.update(len(s))
            tmp = shards[i].with_suffix(".tmp")
            save_file({"ids": ids, "lengths": lengths, "features": features}, str(tmp))
            tmp.rename(shards[i])  # a shard is there whole or not at all
        bar.close()
    return shards


def _holds(shard: Path, sequences: list[list[int]], width_per_token: int) -> bool:
    """Whether a cached shard holds exactly these sequences, `width_per_token` features each (read without
    the features themselves)."""
    from safetensors import safe_open

    if not shard.is_file():
        return False
    try:
        with safe_open(str(shard), "pt") as f:
            ids, lengths = f.get_tensor("ids"), f.get_tensor("lengths")
            width = f.get_slice("features").get_shape()[-1]
    except Exception:  # noqa: BLE001 - an unreadable shard is computed again
        return False
    return width == width_per_token and lengths.tolist() == [len(s) for s in sequences] and all(
        ids[row, : len(s)].tolist() == s for row, s in enumerate(sequences))


def draft_vocabulary(sequences: list[TrainingSequence], size: int) -> torch.Tensor:
    """The `size` tokens most frequent in the training data (fewer if fewer occur), ties by id: as EAGLE-3, a
    head that drafts only among them spends a fraction of the time in its lm_head and loses little, since
    the rest are rare."""
    counts = Counter(token for s in sequences for token in s.ids)
    ranked = sorted(counts, key=lambda token: (-counts[token], token))
    return torch.tensor(sorted(ranked[:size]), dtype=torch.long)


def widened_vocabulary(current: torch.Tensor, sequences: list[TrainingSequence], size: int) -> torch.Tensor:
    """`current` (target ids) grown to `size` tokens with the response tokens most frequent in `sequences`, ties by
    id. A head's lm_head rows are the target's own, so widening costs no training: the predicted feature scores
    the new rows in the target's own space. A vocabulary counted on a small training set misses tokens the target
    writes often elsewhere, and a token outside it is never drafted; whether the head would have predicted them
    is another matter (measured in bench/HISTORY.md: for one head, no better than before)."""
    if size < len(current):
        raise CastspecError(f"the head already drafts among {len(current)} tokens; --size {size} would drop some")
    counts = Counter(token for s in sequences for token, answer in zip(s.ids, s.response, strict=True) if answer)
    have = set(current.tolist())
    ranked = sorted((token for token in counts if token not in have), key=lambda token: (-counts[token], token))
    return torch.tensor(sorted(have | set(ranked[: size - len(have)])), dtype=torch.long)


def widen_head(source: str, model, tokenizer, conversations: list[list[dict]], size: int, out: Path) -> dict:
    """Write a copy of the EAGLE-1/2 head `source` to `out` with its draft vocabulary widened to `size` tokens
    (`widened_vocabulary`, counted on `conversations`)."""
    if out.resolve() == Path(source).expanduser().resolve():
        raise CastspecError("--out must be another directory than --head (the head is written anew there)")
    head = load_eagle_head(source, model, dtype=torch.float32)
    if not isinstance(head, EagleHead) or head.draft_ids is None:
        raise CastspecError(f"{source} drafts over the target's whole vocabulary or is an EAGLE-3 head (its own "
                            "lm_head): there is no draft vocabulary to widen")
    before = head.draft_ids
    ids = widened_vocabulary(before, training_sequences(tokenizer, conversations, 1 << 30), size)
    head.restrict_vocabulary(ids)
    record = {"from": str(source), "before": len(before), "after": len(ids)}
    save_eagle_head(head, out, {**(getattr(head.config, "castspec", None) or {}), "widened_vocabulary": record})
    return record


def head_from_target_layer(model) -> EagleHead:
    """A fresh head whose decoder layer starts as a copy of the target's last one (attention, MLP, both norms):
    that layer already reads and writes the space the head's input and output features live in, so a head
    trained on little data starts from the target's own weights rather than from noise."""
    last = model.get_decoder().layers[-1]
    attention = getattr(last, "self_attn", None)
    if attention is None or not hasattr(attention, "q_proj"):
        raise CastspecError("--layer-init target copies a Llama-shaped decoder layer (self_attn.q_proj, mlp, two "
                            f"norms); this target's last layer is a {type(last).__name__}")
    head = EagleHead(head_config(model, attention_bias=attention.q_proj.bias is not None), input_norm=True)
    missing, unexpected = head.layers[0].load_state_dict(last.state_dict(), strict=False)
    if "self_attn.o_proj.bias" in missing:  # a Llama layer with biases has one on o_proj, Qwen2's has none
        missing.remove("self_attn.o_proj.bias")
        torch.nn.init.zeros_(head.layers[0].self_attn.o_proj.bias)
    if missing or unexpected:
        raise CastspecError(f"--layer-init target: the target's last layer ({type(last).__name__}) does not match a "
                            f"Llama decoder layer: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return head


def fresh_eagle3_head(model, draft_ids: torch.Tensor) -> Eagle3Head:
    """A new EAGLE-3 head over the draft vocabulary `draft_ids` (target ids), reading the target's default low /
    middle / high layers. Its lm_head and final norm start as the target's (the rows of the draft vocabulary):
    the head's output then starts in the space the target's last layer writes, and the little data trained on
    here goes into the decoder layer rather than into relearning an output layer the target already has."""
    layers = eagle3_feature_layers(model.config.num_hidden_layers)
    ids = torch.as_tensor(draft_ids, dtype=torch.long).unique(sorted=True)
    config = head_config(model)
    config.draft_vocab_size = len(ids)  # the EAGLE-3 layout's own fields, so that other tools load it too
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers]}
    head = Eagle3Head(config, model.config.hidden_size, len(ids), layers)
    head.d2t = ids - torch.arange(len(ids))
    head.t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    head.t2d[ids] = True
    final_norm = getattr(model.get_decoder(), "norm", None)
    with torch.no_grad():
        head.lm_head.weight.copy_(model.get_output_embeddings().weight.detach()[ids].float())
        if final_norm is not None and getattr(final_norm, "weight", None) is not None:
            head.norm.weight.copy_(final_norm.weight.detach().float())
    return head


def _starting_head(cfg: TrainConfig, model) -> EagleHead | Eagle3Head:
    """The head `--init` names, in fp32 (the master weights), with its draft vocabulary."""
    if cfg.draft_vocab:
        raise CastspecError("--init keeps the starting head's draft vocabulary: leave out --draft-vocab")
    head = load_eagle_head(cfg.init, model, dtype=torch.float32)
    kind = "eagle3" if isinstance(head, Eagle3Head) else "eagle"
    if kind != cfg.arch:
        raise CastspecError(f"--init {cfg.init} is an {'EAGLE-3' if kind == 'eagle3' else 'EAGLE-1/2'} head: "
                            f"train it with --arch {kind}")
    head.embed_tokens = None  # training feeds the target's embeddings, as drafting does for heads trained here
    return head.train()


def _new_head(cfg: TrainConfig, model, sequences: list[TrainingSequence]) -> EagleHead | Eagle3Head:
    if cfg.init:
        return _starting_head(cfg, model)
    if cfg.arch == "eagle3":
        return fresh_eagle3_head(model, draft_vocabulary(sequences, cfg.draft_vocab))
    head = head_from_target_layer(model) if cfg.layer_init == "target" else EagleHead(head_config(model))
    if cfg.draft_vocab:
        head.restrict_vocabulary(draft_vocabulary(sequences, cfg.draft_vocab))
    return head


def feature_layers(arch: str, model) -> tuple[int, ...]:
    """The target layers cached for training a head of `arch`: its input features, then (EAGLE-3) the last
    layer's, whose lm_head gives the distribution the head learns."""
    if arch == "eagle3":
        return (*eagle3_feature_layers(model.config.num_hidden_layers), -1)
    return (-1,)


class _Item(NamedTuple):
    ids: torch.Tensor  # [n]
    features: torch.Tensor  # [n, d x layers] as cached (bf16): a million tokens of Qwen-1.5B's last layer is 3 GB
    scored: torch.Tensor  # [n - 1] bool: pair t (f_t, x_{t+1}) counts in the loss


def _load_shards(shards: list[Path]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from safetensors.torch import load_file

    out = []
    for shard in shards:
        data = load_file(str(shard))
        for row in range(data["ids"].shape[0]):
            n = int(data["lengths"][row])
            out.append((data["ids"][row, :n], data["features"][row, :n].clone()))  # not a view of the whole shard
    return out


def held_out_indices(sequences: list[list[int]], count: int, seed: int = 0) -> list[int]:
    """The `count` sequences held out for validation: those whose token ids hash lowest. The choice depends on
    the sequences alone, not their number or order, so when the data grows a held-out sequence only ever
    leaves the set for a new one; a run fine-tuned (`--init`) on grown data is then validated on sequences
    the runs before it did not train on, if they held out as many."""
    def key(index: int) -> bytes:
        return hashlib.sha256(f"{seed}:{sequences[index]}".encode()).digest()

    return sorted(sorted(range(len(sequences)), key=key)[:count])


def scored_pairs(response: list[bool], loss_on: str) -> torch.Tensor:
    """Which of a sequence's n - 1 head pairs count in the loss. Pair t (f_t, x_{t+1}) predicts f_{t+1}, whose
    token is x_{t+2}: it counts when x_{t+2} is a response token (the last pair, predicting past the end, when
    the last token is)."""
    if loss_on == "all":
        return torch.ones(len(response) - 1, dtype=torch.bool)
    return torch.tensor(response[2:] + response[-1:], dtype=torch.bool)


def _batch(items: list[_Item], target_width: int | None = None) -> tuple[torch.Tensor, ...]:
    """(next tokens, input features, target features, scored) of a batch, right-padded. `target_width` None:
    the cached features are both the input and the target (EAGLE-1/2); else the last `target_width` columns
    are the target (the last layer's) and the rest the input (EAGLE-3's fused layers)."""
    width = max(len(item.ids) for item in items) - 1
    cached = items[0].features.shape[-1]
    split = cached if target_width is None else cached - target_width
    tokens = torch.zeros(len(items), width, dtype=torch.long)
    inputs = torch.zeros(len(items), width, split)
    targets = torch.zeros(len(items), width, target_width or cached)
    scored = torch.zeros(len(items), width, dtype=torch.bool)
    for row, (ids, feats, counts) in enumerate(items):
        n = len(ids) - 1
        tokens[row, :n], scored[row, :n] = ids[1:], counts
        inputs[row, :n], targets[row, :n] = feats[:-1, :split], feats[1:, cached - targets.shape[-1]:]
    return tokens, inputs, targets, scored


def unrolled_mask(pairs: int, step: int) -> torch.Tensor:
    """[pairs - step, sum of the passes' widths] bool: in unrolled pass `step`, row t is pair t + step, drafted
    `step` deep from the exact pair t. It sees what a draft node sees: the exact pairs up to t (pass 0) and its
    own chain, one node per earlier unrolled pass (column t of each), itself last."""
    rows = pairs - step
    blocks = [torch.arange(pairs)[None] <= torch.arange(rows)[:, None]]
    blocks += [torch.eye(rows, pairs - j, dtype=torch.bool) for j in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def unrolled_passes(head: EagleHead | Eagle3Head, embeddings: torch.Tensor, inputs: torch.Tensor, steps: int
                    ) -> list[torch.Tensor]:
    """The head's outputs over a batch of pairs ([B, n, d] embeddings of x_{t+1} and features f_t), pass by
    pass: pass 0 is teacher-forced (EAGLE), pass k ([B, n - k, d]) feeds the head its own outputs of pass
    k - 1, as drafting k deep does, each row seeing the exact pairs before its chain (`unrolled_mask`)."""
    pairs = embeddings.shape[1]
    positions = torch.arange(pairs)[None].expand(embeddings.shape[0], -1)
    cache = DynamicCache(config=head.config) if steps > 1 else None
    features, passes = inputs, []
    for step in range(min(steps, pairs)):
        # pass 0 is causal: right padding never reaches a real pair; pass k masks as a draft chain
        mask = None if step == 0 else unrolled_mask(pairs, step)[None, None].expand(embeddings.shape[0], -1, -1, -1)
        passes.append(head(embeddings[:, step:], features, positions[:, step:], mask, cache))
        features = passes[-1][:, :-1]
    return passes


def head_loss(head: EagleHead | Eagle3Head, embed, lm_head, batch, noise: float = 0.0, p_weight: float = 0.1,
              steps: int = 1) -> tuple[torch.Tensor, dict]:
    """EAGLE's loss: smooth-L1 on the predicted feature + p_weight x cross-entropy against the target's
    next-token distribution (`lm_head` of the target feature, over the draft vocabulary if the head has one).
    An EAGLE-3 head's output is no target feature, so its loss is the cross-entropy alone, of its own lm_head.
    With `steps` > 1, the training-time test of HASS / EAGLE-3: the loss of unrolled pass k (the head on its
    own predictions, k deep) is added at weight 0.8^k. Stats: `v` (EAGLE-1/2), `p`, `top1` of the
    teacher-forced pass; `top1_k` of pass k - 1 (agreement with the target k nodes deep)."""
    own_output = isinstance(head, Eagle3Head)
    tokens, inputs, targets, scored = batch
    if noise > 0:
        inputs = inputs + torch.randn_like(inputs) * noise * inputs.pow(2).mean().sqrt()
    with torch.no_grad():
        embeddings = embed(tokens)
    total, stats = 0.0, {}
    for step, hidden in enumerate(unrolled_passes(head, embeddings, inputs, steps)):
        counted = scored[:, step:]
        with torch.no_grad():
            target_probs = torch.softmax(lm_head(targets[:, step:][counted]), dim=-1)
        predicted = hidden[counted].float()
        logits = head.draft_logits(predicted, None)[0].float() if own_output else lm_head(predicted)
        logp = torch.log_softmax(logits, dim=-1)
        p_loss = -(target_probs * logp).sum(-1).mean()
        top1 = (logp.argmax(-1) == target_probs.argmax(-1)).float().mean().item()
        if own_output:
            total = total + 0.8 ** step * p_loss
            deep = {"p": p_loss.item()}
        else:
            v_loss = F.smooth_l1_loss(predicted, targets[:, step:][counted])
            total = total + 0.8 ** step * (v_loss + p_weight * p_loss)
            deep = {"v": v_loss.item(), "p": p_loss.item()}
        deep = {**deep, "top1": top1} if step == 0 else {f"top1_{step + 1}": top1}
        stats.update(deep)
    return total, stats


def training_items(model, sequences: list[TrainingSequence], feature_dir: Path, loss_on: str, validation: int,
                   seed: int = 0, layers: tuple[int, ...] = (-1,)) -> tuple[list[_Item], list[_Item]]:
    """The sequences with their target features (of `layers`, cached in `feature_dir`) and scored pairs, split
    into training and `validation` held-out items; a sequence with nothing to score (e.g. cut off before its
    first response token) is left out of both."""
    loaded = _load_shards(cache_features(model, [s.ids for s in sequences], feature_dir, layers=layers))
    items = [_Item(ids, feats, scored_pairs(s.response, loss_on))
             for (ids, feats), s in zip(loaded, sequences, strict=True)]
    items = [item for item in items if item.scored.any()]
    held = set(held_out_indices([item.ids.tolist() for item in items], validation, seed))
    return ([item for i, item in enumerate(items) if i not in held],
            [item for i, item in enumerate(items) if i in held])


def train(model, tokenizer, conversations: list[list[dict]], out: Path, feature_dir: Path, cfg: TrainConfig,
          resume: bool = False, meta: dict | None = None, max_minutes: float | None = None,
          stop_after_steps: int | None = None) -> dict:
    """Train (or, `resume`, continue training) a head into `out`. `max_minutes` / `stop_after_steps` end this
    run early after a checkpoint; `--resume` continues exactly where it stopped (same batches, same noise)."""
    checkpoint = out / "checkpoint.pt"
    if checkpoint.exists() and not resume:
        raise CastspecError(f"{out} already holds a training run: pass --resume to continue it, or another --out")
    if resume and not checkpoint.exists():
        raise CastspecError(f"nothing to resume: {checkpoint} does not exist")
    if cfg.loss_on not in LOSS_ON:
        raise CastspecError(f"--loss-on must be one of {', '.join(LOSS_ON)}, got {cfg.loss_on!r}")
    if cfg.layer_init not in LAYER_INIT:
        raise CastspecError(f"--layer-init must be one of {', '.join(LAYER_INIT)}, got {cfg.layer_init!r}")
    if cfg.unroll < 1:
        raise CastspecError(f"--unroll must be at least 1 (1: EAGLE's teacher-forced loss), got {cfg.unroll}")
    if cfg.init and cfg.layer_init != "random":
        raise CastspecError("--init starts from a trained head's weights: leave out --layer-init")
    if cfg.arch not in ARCH:
        raise CastspecError(f"--arch must be one of {', '.join(ARCH)}, got {cfg.arch!r}")
    if cfg.arch == "eagle3" and cfg.layer_init != "random":
        raise CastspecError("--layer-init target copies a layer into an EAGLE-1/2 head; an EAGLE-3 head's layer "
                            "reads [embedding ; feature] (twice as wide): leave out --layer-init")
    if cfg.arch == "eagle3" and not cfg.init and not cfg.draft_vocab:
        raise CastspecError("an EAGLE-3 head has its own lm_head over a draft vocabulary: give --draft-vocab N "
                            "(e.g. 16384 or 32000)")
    sequences = training_sequences(tokenizer, conversations, cfg.max_length)
    layers = feature_layers(cfg.arch, model)
    train_items, held_out = training_items(model, sequences, feature_dir, cfg.loss_on, cfg.validation, cfg.seed,
                                           layers)
    if not train_items:
        raise CastspecError("no training sequences left after the validation split: use more --conversations")
    target_width = model.config.hidden_size if cfg.arch == "eagle3" else None
    torch.manual_seed(cfg.seed)
    head = _new_head(cfg, model, sequences)
    # a bf16 target trains its head under bf16 autocast (fp32 master weights): the lm_head over the whole vocabulary
    # is most of a step's work, and on a CPU with bf16 units bf16 matmuls are several times faster than fp32
    low_precision = next(model.parameters()).dtype == torch.bfloat16
    embed_weight = model.get_input_embeddings().weight.detach().float()  # copies: the target stays as it is
    lm_head_weight = model.get_output_embeddings().weight.detach()
    lm_head_weight = lm_head_weight if low_precision else lm_head_weight.float()
    if head.draft_ids is not None:  # the loss sees what drafting will: the target's distribution within the vocabulary
        lm_head_weight = lm_head_weight[head.draft_ids]

    def embed(tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, embed_weight)

    def lm_head(hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.to(lm_head_weight.dtype), lm_head_weight).float()
    optimiser = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0)
    per_epoch = math.ceil(len(train_items) / cfg.batch_size)
    total = per_epoch * cfg.epochs
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    step, history = 0, []
    if resume:
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
        # settings added since take their defaults; runs from before --loss-on scored every pair
        saved = {**asdict(TrainConfig()), "loss_on": "all", **state["config"]}
        if saved != asdict(cfg):
            raise CastspecError(f"--resume with different settings than {checkpoint} was made with: "
                                f"{state['config']} vs {asdict(cfg)}")
        head.load_state_dict(state["head"])
        optimiser.load_state_dict(state["optimiser"])
        schedule.load_state_dict(state["schedule"])
        step, history = state["step"], state["history"]
        torch.set_rng_state(state["rng"])

    def save() -> None:
        tmp = checkpoint.with_suffix(".tmp")
        torch.save({"head": head.state_dict(), "optimiser": optimiser.state_dict(), "schedule": schedule.state_dict(),
                    "step": step, "history": history, "config": asdict(cfg), "rng": torch.get_rng_state()}, tmp)
        tmp.rename(checkpoint)
        save_eagle_head(head, out, {**(meta or {}), "train": asdict(cfg), "step": step,
                                    "sequences": len(train_items), "last": history[-1] if history else None})

    def validate() -> dict:
        head.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=low_precision):
            _, stats = head_loss(head, embed, lm_head, _batch(held_out, target_width), 0.0, cfg.p_weight,
                                 max(2, cfg.unroll))
        head.train()
        return stats

    out.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=total, initial=step, desc="train head", unit="step")
    head.train()
    start, started_at = time.perf_counter(), step
    while step < total:
        epoch, index = divmod(step, per_epoch)
        epoch_order = list(range(len(train_items)))
        random.Random(cfg.seed + epoch).shuffle(epoch_order)  # the same order again after a resume
        chosen = epoch_order[index * cfg.batch_size: (index + 1) * cfg.batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low_precision):
            batch = _batch([train_items[i] for i in chosen], target_width)
            loss, stats = head_loss(head, embed, lm_head, batch, cfg.noise, cfg.p_weight, cfg.unroll)
        optimiser.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        optimiser.step()
        schedule.step()
        step += 1
        history.append({"step": step, "loss": round(loss.item(), 4), **{k: round(v, 4) for k, v in stats.items()}})
        bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{stats['top1']:.3f}")
        bar.update()
        if step % per_epoch == 0 and step < total and held_out:  # the last epoch's is the final validation below
            history[-1]["validation"] = {k: round(v, 4) for k, v in validate().items()}
        out_of_time = max_minutes is not None and time.perf_counter() - start > 60 * max_minutes
        stopping = out_of_time or (stop_after_steps is not None and step - started_at >= stop_after_steps)
        if step % cfg.save_every == 0 or step == total or stopping:
            save()
        if stopping and step < total:
            bar.close()
            return {"steps": step, "of": total, "stopped": "time" if out_of_time else "steps",
                    "resume": "run the same command with --resume"}
    bar.close()
    val = validate() if held_out else {}
    head.eval()
    result = {"steps": step, "train_s": round(time.perf_counter() - start, 1), "validation": val,
              "sequences": len(train_items), "tokens": sum(len(item.ids) for item in train_items),
              "scored_pairs": sum(int(item.scored.sum()) for item in train_items), "loss_on": cfg.loss_on}
    (out / "training.json").write_text(json.dumps({**result, "history": history, "config": asdict(cfg),
                                                   **(meta or {})}, indent=1))
    save()
    return result
