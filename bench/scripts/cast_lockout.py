"""Can a bad draft price lock CAST out? The real pair from an empty $CASTSPEC_HOME (a fresh probe), and from the
learned table with its draft seconds multiplied by a factor (as `--cost-table T --force-table` would start it),
beside AR and two fixed trees over the same draft model, on the same prompts, in one run.

Run: .venv/bin/python bench/scripts/cast_lockout.py qwen2.5-coder-1.5b qwen2.5-coder-0.5b 20 96 \
    bench/cast-exploration/NAME
(writes NAME.json and NAME.md; the models are read from $CASTSPEC_HOME, the cost tables live in a scratch home)."""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from castspec import Engine
from castspec.api import drafter_identity, make_policy
from castspec.bench.prompts import load_prompt_set
from castspec.bench.runner import encode_prompts
from castspec.costs.probe import online_cost_model
from castspec.costs.table import CostGrid, CostTable, machine_label
from castspec.drafters.draft_model import DraftModelDrafter
from castspec.models import load_model
from castspec.policies.base import ChainPolicy, Eagle2Policy


def scaled(grid: CostGrid, factor: float) -> CostGrid:
    return CostGrid(list(grid.batch_sizes), list(grid.contexts), list(grid.tokens),
                    [[[s * factor for s in row] for row in plane] for plane in grid.seconds])


def run(label: str, engine: Engine, prompts: list[list[int]], max_new: int) -> dict:
    steps, tokens, wall = [], 0, 0.0
    for ids in prompts:
        g = engine.generate(prompt_ids=ids, max_new_tokens=max_new)
        steps += g.steps
        tokens += len(g.output_ids)
        wall += g.wall_s
    tries = [i for i, s in enumerate(steps) if "exploring" in s.draft.decisions]
    own = [i for i, s in enumerate(steps) if s.tree_size > 0 and "exploring" not in s.draft.decisions]
    row = {"method": label, "tokens": tokens, "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 3),
           "steps": len(steps), "drafting_steps": sum(s.tree_size > 0 for s in steps), "tries": len(tries),
           "first_own_drafting_step": own[0] if own else None,
           "mean_tree_size": round(sum(s.tree_size for s in steps) / len(steps), 2),
           "tau": round(sum(s.accepted for s in steps) / len(steps), 3)}
    print(json.dumps(row), flush=True)
    return row


def plot(result: dict, out: str) -> None:
    """Speed-up over AR per method, with the drafting steps (tries apart) written on each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    colours = ["#999999" if r["method"] == "ar" else "#4c72b0" if r["method"].startswith("cast") else "#dd8452"
               for r in rows]
    bars = ax.barh([r["method"] for r in rows], [r["speedup"] for r in rows], color=colours)
    for bar, r in zip(bars, rows, strict=True):
        ax.text(bar.get_width() + 0.02, bar.get_y() + bar.get_height() / 2,
                f"{r['speedup']:.2f}x, drafted {r['drafting_steps'] - r['tries']}/{r['steps']} steps"
                + (f" + {r['tries']} tries" if r["tries"] else ""), va="center", fontsize=8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(r["speedup"] for r in rows) * 1.6)
    ax.set_xlabel("speed-up over AR (tokens/s, same prompts, one run)")
    meta = result["meta"]
    ax.set_title(f"{meta['model']} + {meta['draft']}, {meta['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)
    plt.close(fig)


def main(model: str, draft: str, factor: float, max_new: int, out: str) -> None:
    target, tokenizer = load_model(model, "bf16")
    draft_model, _ = load_model(draft, "bf16")
    prompts = [load_prompt_set(name)[0] for name in ("mtbench", "humaneval", "gsm8k")]
    ids = encode_prompts(Engine(target, tokenizer), prompts)
    drafter_id = drafter_identity(draft_model)
    models_dir = Path(os.environ.get("CASTSPEC_HOME", Path.home() / ".cache" / "castspec")) / "models"
    rows = [run("ar", Engine(target, tokenizer), ids, max_new),
            run("chain, length 3", Engine(target, tokenizer, DraftModelDrafter(draft_model), ChainPolicy(3)), ids,
                max_new),
            run("eagle2 2/3/6", Engine(target, tokenizer, DraftModelDrafter(draft_model), Eagle2Policy(2, 3, 6)),
                ids, max_new)]
    with tempfile.TemporaryDirectory() as home:
        (Path(home) / "models").symlink_to(models_dir)
        os.environ["CASTSPEC_HOME"] = home  # empty of cost tables: CAST starts from a probe, as on a new machine
        drafter = DraftModelDrafter(draft_model)
        start = time.perf_counter()
        fresh = online_cost_model(target, drafter, drafter_id, fresh=True)
        probe_s = time.perf_counter() - start
        rows.append(run("cast, empty home", Engine(target, tokenizer, drafter, make_policy("cast", cost_table=fresh)),
                        ids, max_new))
        wrong = CostTable({"target": {}, "draft": {"model": drafter_id}}, fresh.target, scaled(fresh.draft, factor))
        drafter = DraftModelDrafter(draft_model)
        costs = online_cost_model(target, drafter, drafter_id, seed=wrong, chosen_seed=True, save=False)
        policy = make_policy("cast", cost_table=costs)
        rows.append(run(f"cast, draft costs x{factor:g}", Engine(target, tokenizer, drafter, policy), ids, max_new))
        rows[-1]["draft_price_at_end"] = round(costs.normalised_draft(1, 256, 1), 4)
        rows[-1]["draft_price_at_start"] = round(wrong.normalised_draft(1, 256, 1), 4)
    ar = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup"] = round(row["tokens_per_s"] / ar, 3)
    result = {"meta": {"machine": machine_label(), "date": time.strftime("%Y-%m-%d %H:%M"), "model": model,
                       "draft": draft, "factor": factor, "max_new_tokens": max_new, "probe_s": round(probe_s, 1),
                       "prompts": [p["id"] for p in prompts],
                       "command": "python " + " ".join(shlex.quote(a) for a in sys.argv)},
              "rows": rows}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# CAST from a bad draft price: {model} with {draft}, bf16, {result['meta']['machine']}",
             "", f"`{result['meta']['command']}` ({result['meta']['date']}; {len(prompts)} prompts x {max_new} "
             "tokens, methods one after another on the same prompts; probe "
             f"{result['meta']['probe_s']} s)", "",
             "| method | tok/s | speed-up | tau | mean tree | drafting steps | tries | first own drafting step |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['tokens_per_s']} | {r['speedup']}x | {r['tau']} | {r['mean_tree_size']} | "
              f"{r['drafting_steps']}/{r['steps']} | {r['tries']} | {r['first_own_drafting_step']} |" for r in rows]
    last = rows[-1]
    lines += ["", f"Draft price (one-token draft forward in target steps at c=256): {last['draft_price_at_start']} "
                  f"at the start of the x{factor:g} run, {last['draft_price_at_end']} at its end."]
    Path(out + ".md").write_text("\n".join(lines) + "\n")
    plot(result, out)
    print("\n".join(lines))


if __name__ == "__main__":
    if len(sys.argv) != 6:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
