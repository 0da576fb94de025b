"""What the suffix drafter costs per step beside a target forward, at contexts up to 8k tokens.

For each context length: a history of real text (the repetitive and headline prompts' token ids, repeated to
length) is absorbed once (what a prefill step adds); then per decoding step the drafter absorbs the accepted
tokens and drafts a tree of 8 layers of up to 8 nodes (the shape CAST grows on this CPU); both are timed and
set beside one target decode forward (1 token, and a 16-token tree) at the same context, and the trie's size.

Run: .venv/bin/python bench/scripts/suffix_cost.py qwen2.5-coder-1.5b bench/suffix/cost-per-step-qwen1.5b-bf16
(writes NAME.json and NAME.md)"""

import json
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import torch

from castspec.api import encode_text
from castspec.bench.prompts import load_prompt_set
from castspec.costs import profile as cost
from castspec.costs.table import device_name
from castspec.decode.tree import TreePool
from castspec.drafters.suffix import SuffixDrafter
from castspec.models import load_model

model_name, out = sys.argv[1], Path(sys.argv[2])
model, tokenizer = load_model(model_name, "bf16")
corpus: list[int] = []
for name in ("repetitive", "humaneval", "mtbench", "gsm8k"):
    for row in load_prompt_set(name):
        corpus += encode_text(tokenizer, messages=row["messages"])


def history(length: int) -> list[int]:
    return (corpus * (length // len(corpus) + 1))[:length]


def one_step(drafter: SuffixDrafter, accepted: list[int]) -> float:
    """Absorb the accepted tokens, then 8 layers of up to 8 children per layer, the best 8 expanded."""
    start = time.perf_counter()
    (cands,) = drafter.begin([accepted], 8)
    pool = TreePool(accepted[-1])
    frontier = [0]
    for _ in range(8):
        tokens, parents = [], []
        for row, node in enumerate(frontier):
            for token, prob in zip(cands.tokens[row].tolist(), cands.probs[row].tolist(), strict=True):
                if prob > 0:
                    tokens.append(token)
                    parents.append(node)
        if not tokens:
            break
        frontier = list(pool.append(tokens[:8], parents[:8]))
        (cands,) = drafter.expand([pool], [frontier], 8)
    drafter.end_step()
    return time.perf_counter() - start


rows = []
for context in (512, 2048, 8192):
    text = history(context + 400)
    tracemalloc.start()
    drafter = SuffixDrafter()
    start = time.perf_counter()
    drafter.begin([text[:context]], 8)
    absorb = time.perf_counter() - start
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    drafter.end_step()
    steps, at = [], context
    while at + 4 <= len(text):
        steps.append(one_step(drafter, text[at: at + 4]))  # 4 tokens accepted per step, as on copy tasks
        at += 4
    with torch.inference_mode():
        forward_1 = cost.time_forward(model, 1, context, 1)
        forward_16 = cost.time_forward(model, 1, context, 16)
    step_ms = statistics.median(steps) * 1e3
    rows.append({"context": context, "trie_nodes": len(drafter.rows[0].trie), "trie_mb": round(memory / 2**20, 1),
                 "absorb_ms": round(absorb * 1e3, 1), "step_ms_median": round(step_ms, 3),
                 "step_ms_p90": round(sorted(steps)[int(0.9 * len(steps))] * 1e3, 3),
                 "target_forward_1_ms": round(forward_1 * 1e3, 1), "target_forward_16_ms": round(forward_16 * 1e3, 1),
                 "step_share_of_forward": round(step_ms / (forward_1 * 1e3), 4)})
    print(rows[-1], flush=True)

meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": device_name(next(model.parameters()).device),
        "model": model_name, "dtype": "bf16", "command": "python " + " ".join(sys.argv)}
out.parent.mkdir(parents=True, exist_ok=True)
(out.parent / (out.name + ".json")).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
lines = [f"# Suffix drafter cost per step ({model_name} bf16, {meta['machine']}, {meta['date']})", "",
         f"Command: `{meta['command']}`", "",
         "| context | trie nodes | trie MiB | absorb prompt ms | step ms (median / p90) | target forward 1 / 16 "
         "tokens ms | step / forward |", "|---|---|---|---|---|---|---|"]
lines += [f"| {r['context']} | {r['trie_nodes']} | {r['trie_mb']} | {r['absorb_ms']} | {r['step_ms_median']} / "
          f"{r['step_ms_p90']} | {r['target_forward_1_ms']} / {r['target_forward_16_ms']} | "
          f"{100 * r['step_share_of_forward']:.1f}% |" for r in rows]
(out.parent / (out.name + ".md")).write_text("\n".join(lines) + "\n")
print("\n".join(lines))
