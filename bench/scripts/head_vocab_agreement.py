"""Held-out agreement of heads with the target's own greedy choice over its WHOLE vocabulary, one and two nodes
deep: what the first two draft layers of a chain would accept. Unlike train-head's validation (agreement within
the head's draft vocabulary), a target token outside the draft vocabulary counts as a miss here, so heads with
different draft vocabularies (`castspec head-vocab`) compare fairly. Deterministic: no timing, no tree policy.

    .venv/bin/python bench/scripts/head_vocab_agreement.py DATA MAX_LENGTH OUT.json HEAD [HEAD ...]
    .venv/bin/python bench/scripts/head_vocab_agreement.py bench/RUN.json 0 OUT.json HEAD [HEAD ...]

DATA and MAX_LENGTH as the heads were trained with (`train-head --data/--max-length`): the held-out sequences
and the cached target features are the training run's own. A benchmark run's JSON instead: its AR rows (prompt +
the target's greedy output, each output token scored), the target's features computed here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from castspec.api import encode_text
from castspec.bench.prompts import PROMPT_SETS, load_prompt_set
from castspec.cli.heads import _conversations, _data_name
from castspec.drafters.eagle_head import Eagle3Head, load_eagle_head
from castspec.heads.train import (
    TrainingSequence,
    _batch,
    feature_layers,
    training_items,
    training_sequences,
    unrolled_passes,
)
from castspec.models import castspec_home, load_model

TARGET = "qwen2.5-coder-1.5b"


def main() -> None:
    data, max_length, out, heads = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]
    model, tokenizer = load_model(TARGET, "bf16")
    if data.endswith(".json"):
        sequences = _benchmark_outputs(tokenizer, json.loads(Path(data).read_text()))
        features = castspec_home() / "features" / f"{TARGET}-bf16-{Path(data).stem}-ar-eagle3"
    else:
        sequences = training_sequences(tokenizer, _conversations(data, 600), max_length)
        features = castspec_home() / "features" / f"{TARGET}-bf16-{_data_name(data)}-x{max_length}-eagle3"
    # benchmark outputs are all evaluated; training data only where train-head's defaults hold it out
    benchmark = data.endswith(".json")
    # EAGLE-3's three layers and the last one: what either kind of head reads, and the target's own choice
    layers = feature_layers("eagle3", model)
    rest, held = training_items(model, sequences, features, "responses", 0 if benchmark else 24, layers=layers)
    held = rest if benchmark else held
    d = model.config.hidden_size
    tokens, inputs, targets, scored = _batch(held)  # every layer on both sides: each kind of head takes its own
    inputs_of = {True: inputs[..., :-d], False: inputs[..., -d:]}  # EAGLE-3's fused layers, or the last one
    targets = targets[..., -d:]
    lm_module = model.get_output_embeddings()
    lm_head = lm_module.weight.detach()
    embed = model.get_input_embeddings().weight.detach().float()
    results = []
    for source in heads:
        head = load_eagle_head(source, model, dtype=torch.float32)
        ids = head.draft_ids
        fused = isinstance(head, Eagle3Head)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            passes = unrolled_passes(head, F.embedding(tokens, embed), inputs_of[fused], 2)
        result = {"head": source, "draft_vocabulary": None if ids is None else len(ids),
                  "sequences": len(held)}
        for depth, hidden in enumerate(passes, 1):
            counted = scored[:, depth - 1:]
            want = F.linear(targets[:, depth - 1:][counted].to(lm_head.dtype), lm_head).argmax(-1)
            with torch.no_grad():
                best = head.draft_logits(hidden[counted].float(), lm_module)[0].argmax(-1)
            got = best if ids is None else ids[best]
            result[f"agree_{depth}"] = round((got == want).float().mean().item(), 4)
            result[f"target_token_in_vocabulary_{depth}"] = 1.0 if ids is None else round(
                torch.isin(want, ids).float().mean().item(), 4)
            result[f"pairs_{depth}"] = int(counted.sum())
        print(json.dumps(result), flush=True)
        results.append(result)
    out.write_text(json.dumps({"data": data, "max_length": max_length, "target": TARGET, "results": results,
                               "command": " ".join(sys.argv)}, indent=1))


def _benchmark_outputs(tokenizer, run: dict) -> list[TrainingSequence]:
    """The AR rows of a `castspec bench` run as sequences: the prompt as the benchmark encoded it, then the
    target's greedy output, whose tokens are the ones scored."""
    prompts = {row["id"]: row for name in PROMPT_SETS for row in load_prompt_set(name)}
    out = []
    for row in run["rows"]:
        if row["method"] == "ar":
            prompt = encode_text(tokenizer, messages=prompts[row["prompt_id"]]["messages"])
            out.append(TrainingSequence(prompt + row["output_ids"],
                                        [False] * len(prompt) + [True] * len(row["output_ids"])))
    return out


if __name__ == "__main__":
    main()
