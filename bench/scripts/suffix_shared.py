"""Does the shared suffix tree make a task family faster over time? Three passes over the repetitive workload's
families, each prompt decoded side by side by CAST over the suffix drafter without and with a shared tree (one
engine each; the shared one keeps a tree over every earlier output):
  pass 1: rows 0..K-1 of every family, the shared tree empty at the start (it fills as the pass goes);
  pass 2: rows K..2K-1, NEW prompts of the same families, read against pass 1's outputs;
  pass 3: pass 1's prompts again (repeated traffic: their own outputs are in the tree).
Reports tokens/s and tau per pass and engine, and whether the outputs agree.

Run: .venv/bin/python bench/scripts/suffix_shared.py qwen2.5-coder-1.5b 2 96 bench/suffix/shared-tree-qwen1.5b-bf16"""

import json
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from castspec.api import Engine, make_policy  # noqa: E402
from castspec.bench.prompts import load_prompt_set  # noqa: E402
from castspec.costs.table import device_name  # noqa: E402
from castspec.drafters.suffix import SharedSuffixTrie, SuffixDrafter  # noqa: E402

model_name, per_family, max_new, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
rows = load_prompt_set("repetitive")
families = sorted({r["family"] for r in rows})
by_family = {f: [r for r in rows if r["family"] == f] for f in families}
passes = {"1: first rows": [by_family[f][i] for i in range(per_family) for f in families],
          "2: new rows, same families": [by_family[f][i] for i in range(per_family, 2 * per_family) for f in families],
          "3: first rows again": [by_family[f][i] for i in range(per_family) for f in families]}

plain = Engine.load(model_name, "cast", drafter="suffix")
# the same target and the same (online) cost model; only the drafter keeps a shared tree
shared = Engine(plain.model, plain.tokenizer, SuffixDrafter(shared=SharedSuffixTrie(200_000), share=True),
                make_policy("cast", cost_table=plain.policy.costs, cast_calibrate=True,
                            cast_max_depth=plain.policy.max_depth))
engines = {"no shared tree": plain, "shared tree": shared}
for engine in engines.values():  # warm-up outside the workload; its output must not seed the shared tree
    engine.generate(messages=[{"role": "user", "content": "Say hello."}], max_new_tokens=8)
shared.drafter.shared.clear()

results = []
for pass_name, prompts in passes.items():
    for prompt in prompts:
        ids = plain.encode(messages=prompt["messages"])
        outputs = {}
        for label, engine in engines.items():
            got = engine.generate(prompt_ids=ids, max_new_tokens=max_new)
            outputs[label] = got.output_ids
            results.append({"pass": pass_name, "prompt_id": prompt["id"], "family": prompt["family"],
                            "engine": label, "tokens": len(got.output_ids), "wall_s": got.wall_s,
                            "steps": len(got.steps), "tau": got.mean_accepted})
        results[-1]["same_as_no_shared"] = outputs["shared tree"] == outputs["no shared tree"]
        print(pass_name, prompt["id"], [(r["engine"], round(r["tokens"] / r["wall_s"], 2), round(r["tau"], 2))
                                        for r in results[-2:]], flush=True)

summary = []
for pass_name in passes:
    for label in engines:
        sel = [r for r in results if r["pass"] == pass_name and r["engine"] == label]
        tokens, wall, steps = (sum(r[k] for r in sel) for k in ("tokens", "wall_s", "steps"))
        summary.append({"pass": pass_name, "engine": label, "tokens_per_s": round(tokens / wall, 3),
                        "tau": round((tokens - len(sel)) / steps, 3), "prompts": len(sel),
                        "same_outputs": sum(r.get("same_as_no_shared", True) for r in sel
                                            if label == "shared tree")})
meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": device_name(plain.model.device), "model": model_name,
        "dtype": "bf16", "max_new_tokens": max_new, "per_family": per_family, "families": families,
        "command": "python " + " ".join(sys.argv), "shared_tokens_at_end": shared.drafter.shared.tokens}
out.parent.mkdir(parents=True, exist_ok=True)
record = {"meta": meta, "summary": summary, "rows": results}
(out.parent / (out.name + ".json")).write_text(json.dumps(record, indent=1))
lines = [f"# Shared suffix tree over a task family ({model_name} bf16, {meta['machine']}, {meta['date']})", "",
         f"Command: `{meta['command']}`", "",
         "CAST over the suffix drafter, each prompt decoded by both engines side by side; max_new_tokens "
         f"{max_new}, {per_family} prompts per family per pass, families: {', '.join(families)}.", "",
         "| pass | engine | tokens/s | tau | shared vs none |", "|---|---|---|---|---|"]
for pass_name in passes:
    none, with_tree = (next(s for s in summary if s["pass"] == pass_name and s["engine"] == e) for e in engines)
    lines.append(f"| {pass_name} | no shared tree | {none['tokens_per_s']} | {none['tau']} | |")
    lines.append(f"| {pass_name} | shared tree | {with_tree['tokens_per_s']} | {with_tree['tau']} | "
                 f"{with_tree['tokens_per_s'] / none['tokens_per_s']:.2f}x (outputs equal: "
                 f"{with_tree['same_outputs']}/{with_tree['prompts']}) |")
(out.parent / (out.name + ".md")).write_text("\n".join(lines) + f"\n\n![plot]({out.name}.png)\n")
fig, ax = plt.subplots(figsize=(7, 3.5))
for i, label in enumerate(engines):
    values = [next(s["tokens_per_s"] for s in summary if s["pass"] == p and s["engine"] == label) for p in passes]
    ax.bar([j + 0.38 * i for j in range(len(passes))], values, width=0.38, label=label)
ax.set_xticks([j + 0.19 for j in range(len(passes))], list(passes), fontsize=8)
ax.set_ylabel("tokens/s")
ax.set_title("CAST + suffix drafter: shared tree across a task family")
ax.legend()
fig.tight_layout()
fig.savefig(out.parent / (out.name + ".png"), dpi=110)
print("\n".join(lines))
