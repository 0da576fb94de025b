"""Why does HF prompt lookup beat our n-gram methods? Replay both on the headline benchmark's own prompts.

No model runs: the references are the AR outputs stored in the headline JSON, the prompts are re-encoded with the
target's tokenizer, verify forwards are priced by the n-gram cost table (as `castspec tune` does). HF's proposer
is re-implemented from what transformers 5.24's PromptLookupCandidateGenerator does (read in the installed
source): the last 2 tokens, else the last 1, are looked up in prompt + output; the earliest earlier occurrence wins
and the (up to) 10 tokens that followed it are the chain. Ours: NgramDrafter(max_n, min_n) under chain /
EAGLE-2 / CAST policies.

Run: .venv/bin/python bench/scripts/ngram_vs_prompt_lookup.py [HEADLINE.json] \
    > bench/ngram/ngram-vs-prompt-lookup-qwen1.5b-bf16-avx512bf16.txt"""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from transformers import AutoTokenizer

from castspec.api import encode_text, make_policy
from castspec.bench.prompts import load_prompt_set
from castspec.bench.replay import replay
from castspec.costs.table import CostTable
from castspec.drafters.ngram import NgramDrafter
from castspec.models import castspec_home, converted_dir

headline_path = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/headline/headline-qwen1.5b-bf16-avx512bf16.json")
headline = json.loads(headline_path.read_text())
max_new = headline["meta"]["max_new_tokens"]
setup = headline["meta"]["settings"]
tokenizer = AutoTokenizer.from_pretrained(str(converted_dir(setup["model"])))
tables = sorted((castspec_home() / "costs").glob("*ngram*avx512bf16.json"))
if not tables:
    sys.exit("no n-gram cost table in $CASTSPEC_HOME/costs (copy bench/cost/qwen1.5b-ngram-bf16-b1-*.json there)")
costs = CostTable.load(tables[-1])
print(f"cost table: {tables[-1].name} ({costs.meta['target']['device']})")

references = {r["prompt_id"]: r["output_ids"] for r in headline["rows"] if r["method"] == "ar"}
rows_by_id = {row["id"]: row for name in ("mtbench", "humaneval", "gsm8k") for row in load_prompt_set(name)}


def hf_lookup(history: list[int], max_ngram: int = 2, num_tokens: int = 10) -> list[int]:
    for n in range(min(max_ngram, len(history) - 1), 0, -1):
        suffix = history[-n:]
        for start in range(len(history) - n):  # earliest occurrence first, the suffix itself excluded
            if history[start: start + n] == suffix:
                return history[start + n: start + n + num_tokens]
    return []


def replay_hf(prompt: list[int], reference: list[int]) -> dict:
    emitted, steps, proposed, verify_s, ar_s, accepted = 1, 0, 0, 0.0, 0.0, []
    end = min(len(reference), max_new)
    while emitted < end:
        context = len(prompt) + emitted - 1
        chain = hf_lookup(prompt + reference[:emitted])[: max(0, max_new - emitted - 1)]
        hits = 0
        while hits < len(chain) and emitted + hits < len(reference) and chain[hits] == reference[emitted + hits]:
            hits += 1
        new = min(hits + 1, end - emitted)
        verify_s += costs.f_target(1, context, 1 + len(chain))
        ar_s += sum(costs.f_target(1, context + i, 1) for i in range(new))
        steps, proposed = steps + 1, proposed + (len(chain) > 0)
        accepted.append(hits + 1)
        emitted += new
    return {"ar_s": ar_s, "decode_s": verify_s, "steps": steps, "proposed": proposed, "accepted": accepted,
            "sizes": []}


def replay_ours(prompt: list[int], reference: list[int], method: str, options: dict, max_n: int, min_n: int) -> dict:
    policy = make_policy(method, **({"cost_table": costs} if method == "cast" else {}), **options)
    r = replay(NgramDrafter(max_n=max_n, min_n=min_n), policy, prompt, reference, costs, max_new)
    return {"ar_s": r.ar_s, "decode_s": r.decode_s, "steps": len(r.accepted),
            "proposed": sum(s > 0 for s in r.tree_sizes), "accepted": r.accepted, "sizes": r.tree_sizes}


configs = {"hf-prompt-lookup (re-implemented)": None}
for max_n, min_n in ((4, 2), (4, 1), (2, 1)):
    configs[f"chain:ngram:chain_length=10 n={min_n}..{max_n}"] = ("chain", {"chain_length": 10}, max_n, min_n)
    configs[f"eagle2:ngram:4/7/16 n={min_n}..{max_n}"] = ("eagle2", {"top_k": 4, "depth": 7, "total_tokens": 16},
                                                        max_n, min_n)
    configs[f"cast:ngram (auto) n={min_n}..{max_n}"] = ("cast", {"cast_auto": True}, max_n, min_n)
    configs[f"cast:ngram (auto, calibrated) n={min_n}..{max_n}"] = ("cast", {"cast_auto": True,
                                                                            "cast_calibrate": True}, max_n, min_n)

per_task: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
for prompt_id, reference in references.items():
    row = rows_by_id[prompt_id]
    prompt = encode_text(tokenizer, row.get("prompt"), row.get("messages"))
    task = prompt_id.split("-")[0]
    for label, config in configs.items():
        result = replay_hf(prompt, reference) if config is None else replay_ours(prompt, reference, *config)
        per_task[task][label].append(result)
        per_task["all"][label].append(result)

print(f"{len(references)} prompts, {max_new} new tokens; predicted speed-up = priced AR time / (measured drafting "
      "+ priced verify), summed per task")
print(f"{'task':10} {'method':50} {'speed-up':>8} {'tau':>6} {'proposing steps':>16} {'mean size':>9}")
for task in ("gsm8k", "humaneval", "mtbench", "all"):
    for label in configs:
        results = per_task[task][label]
        steps = sum(r["steps"] for r in results)
        sizes = [s for r in results for s in r["sizes"]]
        print(f"{task:10} {label:50} {sum(r['ar_s'] for r in results) / sum(r['decode_s'] for r in results):8.2f}x"
              f" {statistics.fmean(a for r in results for a in r['accepted']):6.2f}"
              f" {sum(r['proposed'] for r in results) / steps:16.2f}"
              f" {statistics.fmean(sizes) if sizes else float('nan'):9.2f}")
