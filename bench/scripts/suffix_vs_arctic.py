"""Our suffix drafter against Snowflake arctic-inference's SuffixDecoding (the speculator vLLM runs), replayed on
the same target outputs: accepted tokens per step (tau) and drafted tokens verified per step.

Greedy decoding is lossless, so each step starts from a prefix of the AR output stored in a benchmark JSON;
a proposal's accepted length is how far it follows that output. arctic-inference is driven through its
SuffixDecodingCache as its vLLM integration does (prompt in a per-request tree, the output appended as it is
accepted; no global cache: one request at a time, like ours without a shared tree), with its defaults
(max depth 64, max_spec_factor 1, min_token_prob 0.1), as a chain and as a tree. Ours through castspec.bench.replay
(the real drafter and policy; verify forwards priced by this machine's learned cost table for the suffix drafter).

arctic-inference 0.3.0 ships only as an sdist; its suffix tree is a standalone C++ extension (nanobind), built
here with: cmake -S csrc/suffix_decoding -B build -Dnanobind_DIR=$(python -m nanobind --cmake_dir) && cmake
--build build; then PYTHONPATH holds the built module beside arctic_inference/suffix_decoding/cache.py.

Run: PYTHONPATH=/tmp/arctic-py .venv/bin/python bench/scripts/suffix_vs_arctic.py OUT BENCH.json [BENCH.json ...]"""

import json
import statistics
import sys
import time
from pathlib import Path

from arctic_inference.suffix_decoding.cache import SuffixDecodingCache

from castspec.api import encode_text, make_policy, online_cost_model
from castspec.bench.prompts import load_prompt_set
from castspec.bench.replay import replay
from castspec.costs.table import device_name
from castspec.drafters.suffix import SuffixDrafter
from castspec.models import load_model
from castspec.policies.base import ChainPolicy

out, bench_files = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
model_name = json.loads(bench_files[0].read_text())["meta"]["settings"]["model"]
model, tokenizer = load_model(model_name, "bf16")
# what this machine learned for the suffix drafter (a probe of a few forwards where nothing is saved yet)
costs = online_cost_model(model, SuffixDrafter(), "suffix")
rows_by_id = {row["id"]: row for name in ("mtbench", "humaneval", "gsm8k", "repetitive")
              for row in load_prompt_set(name)}


def arctic_replay(prompt: list[int], reference: list[int], max_new: int, tree: bool) -> tuple[int, int, int]:
    """(tokens emitted, steps, drafted tokens verified) for arctic's speculator against `reference`."""
    cache = SuffixDecodingCache(max_tree_depth=64, max_cached_requests=0)
    cache.start_request("r", prompt)
    emitted = [reference[0]]
    cache.add_active_response("r", emitted)
    steps = verified = 0
    while len(emitted) < min(max_new, len(reference)):
        draft = cache.speculate("r", prompt + emitted, max_spec_tokens=min(64, max_new - len(emitted) - 1),
                                use_tree_spec=tree)
        verified += len(draft.token_ids)
        at, node, new = len(emitted), -1, []
        while at + len(new) < len(reference):
            nxt = reference[at + len(new)]
            child = next((i for i, (t, p) in enumerate(zip(draft.token_ids, draft.parents, strict=True))
                          if t == nxt and p == node), None)
            if child is None:
                break
            new.append(nxt)
            node = child
        if at + len(new) < len(reference):
            new.append(reference[at + len(new)])  # the target's own token after the accepted path
        steps += 1
        emitted += new
        cache.add_active_response("r", new)
    return min(len(emitted), max_new), steps, verified


results = []
for bench_file in bench_files:
    bench = json.loads(bench_file.read_text())
    max_new = bench["meta"]["max_new_tokens"]
    # one CAST policy over the whole file, as the benchmark keeps one engine per method: its calibration of the
    # suffix scores carries from prompt to prompt
    cast = make_policy("cast", cost_table=costs, cast_calibrate=True, cast_max_depth=24)
    for row in (r for r in bench["rows"] if r["method"] == "ar"):
        prompt = encode_text(tokenizer, messages=rows_by_id[row["prompt_id"]]["messages"])
        reference = row["output_ids"]
        entry = {"bench": bench_file.stem, "prompt_id": row["prompt_id"], "task": row.get("task")}
        for label, tree in (("arctic chain", False), ("arctic tree", True)):
            tokens, steps, verified = arctic_replay(prompt, reference, max_new, tree)
            entry[label] = {"tau": (tokens - 1) / max(1, steps), "verified_per_step": verified / max(1, steps)}
        for label, policy in (("castspec chain 16", ChainPolicy(16)), ("castspec cast", cast)):
            result = replay(SuffixDrafter(), policy, prompt, reference, costs, max_new)
            steps = max(1, len(result.accepted))
            entry[label] = {"tau": (min(sum(result.accepted), max_new) - 1) / steps,
                            "verified_per_step": sum(result.tree_sizes) / steps}
        results.append(entry)
        print(entry["prompt_id"], {k: round(v["tau"], 2) for k, v in entry.items() if isinstance(v, dict)},
              flush=True)

labels = ["arctic chain", "arctic tree", "castspec chain 16", "castspec cast"]
meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": device_name(model.device), "model": model_name,
        "command": "python " + " ".join(sys.argv), "benches": [str(p) for p in bench_files]}
groups = sorted({(r["bench"], r["task"]) for r in results})
lines = [f"# Suffix drafters replayed on the same outputs ({model_name}, {meta['date']})", "",
         f"Command: `{meta['command']}`", "",
         "tau = tokens emitted per verify step (the target's bonus token included); verified = drafted tokens "
         "per step. Means over prompts.", "",
         "| outputs of | set | prompts | " + " | ".join(f"{lab} tau / verified" for lab in labels) + " |",
         "|---|---|---|" + "---|" * len(labels)]
for bench_name, task in groups:
    sel = [r for r in results if r["bench"] == bench_name and r["task"] == task]
    cells = [f"{statistics.mean(r[lab]['tau'] for r in sel):.2f} / "
             f"{statistics.mean(r[lab]['verified_per_step'] for r in sel):.1f}" for lab in labels]
    lines.append(f"| {bench_name} | {task} | {len(sel)} | " + " | ".join(cells) + " |")
out.parent.mkdir(parents=True, exist_ok=True)
(out.parent / (out.name + ".json")).write_text(json.dumps({"meta": meta, "rows": results}, indent=1))
(out.parent / (out.name + ".md")).write_text("\n".join(lines) + "\n")
print("\n".join(lines))
