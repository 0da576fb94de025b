"""Which part of calibrated CAST costs the n-gram drafter: the conditional utilities or the payoff gate?
Replays (exact acceptance, verify priced by the table) on the 9 tuning prompts, 64 tokens, Qwen bf16.
Run from the repository root: .venv/bin/python bench/scripts/calibration_split.py"""
import json
import statistics

from castspec.api import Engine, drafter_identity, find_cost_table
from castspec.bench.replay import replay
from castspec.bench.runner import encode_prompts
from castspec.cli.options import prompt_rows as _prompts
from castspec.costs.table import setup_key
from castspec.drafters.ngram import NgramDrafter
from castspec.models import load_model
from castspec.policies.cast import CastPolicy

target, tok = load_model("qwen2.5-coder-1.5b", "bf16")
costs = find_cost_table(setup_key(target), drafter_identity(None))
prompts = _prompts("mtbench,humaneval,gsm8k", 3, 40)
engine = Engine(target, tok)
ids = encode_prompts(engine, prompts)
refs = [engine.generate(prompt_ids=i, max_new_tokens=64).output_ids for i in ids]


def variant(name):
    p = CastPolicy(costs, auto=True, calibrate=name != "auto")
    if name == "utilities only":
        p.payoff = None
    if name == "payoff only":
        p.calibration = None
    return p


out = {}
for name in ("auto", "calibrated (both)", "utilities only", "payoff only"):
    rs = [replay(NgramDrafter(), variant(name), i, r, costs, 64) for i, r in zip(ids, refs, strict=True)]
    steps = sum(len(r.accepted) for r in rs)
    dec, ar = sum(r.decode_s for r in rs), sum(r.ar_s for r in rs)
    out[name] = {"predicted_speedup": round(ar / dec, 3), "tau": round(sum(r.new_tokens - 1 for r in rs) / steps, 3),
                 "verify": round(statistics.fmean(n for r in rs for n in r.tree_sizes), 2),
                 "drafting_steps": round(statistics.fmean(d > 0 for r in rs for d in r.depths), 3)}
    print(name, out[name], flush=True)
with open("bench/calibration/calibration-split-ngram-qwen1.5b-bf16.json", "w") as f:
    json.dump(out, f, indent=1)
