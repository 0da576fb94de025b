"""Which head recipe learns most from little data? The same ShareGPT sequences and target features, one short
training run per recipe, held-out agreement with the target on response tokens after every epoch, one node
deep (`top1`, teacher-forced) and two (`top1_2`: the head on its own prediction, as a draft chain runs it).
Run: .venv/bin/python bench/scripts/head_recipe_ab.py [conversations] [epochs] > OUT.json"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

from castspec.bench.prompts import load_sharegpt
from castspec.heads.config import TrainConfig
from castspec.heads.train import train
from castspec.models import castspec_home, load_model

TARGET, MAX_LENGTH = "qwen2.5-coder-1.5b", 512
RECIPES = {
    "EAGLE: random layer, teacher-forced loss": {},
    "layer copied from the target's last": {"layer_init": "target"},
    "training-time test, 2 passes": {"unroll": 2},
    "target's layer + training-time test, 2 passes": {"layer_init": "target", "unroll": 2},
}


def main() -> None:
    conversations = int(sys.argv[1]) if len(sys.argv) > 1 else 160
    epochs = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    model, tokenizer = load_model(TARGET, "bf16")
    data = load_sharegpt(conversations)
    # the directory `castspec train-head --data sharegpt --max-length 512` uses: a later full run reuses the shards
    features = castspec_home() / "features" / f"{TARGET}-bf16-sharegpt-x{MAX_LENGTH}"
    base = TrainConfig(conversations=conversations, max_length=MAX_LENGTH, epochs=epochs, draft_vocab=16384,
                       save_every=10_000)
    results = []
    for name, change in RECIPES.items():
        cfg = dataclasses.replace(base, **change)
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            result = train(model, tokenizer, data, Path(out), features, cfg)
            history = json.loads((Path(out) / "training.json").read_text())["history"]
        per_epoch = [h["validation"] for h in history if "validation" in h] + [result["validation"]]
        results.append({"recipe": name, "change": change, "held_out_per_epoch": per_epoch,
                        "validation": result["validation"], "train_s": round(time.perf_counter() - start, 1),
                        "scored_pairs": result["scored_pairs"], "tokens": result["tokens"]})
        print(json.dumps(results[-1]), file=sys.stderr)
    print(json.dumps({"target": TARGET, "dtype": "bf16", "conversations": conversations, "epochs": epochs,
                      "config": dataclasses.asdict(base), "results": results}, indent=1))


if __name__ == "__main__":
    main()
