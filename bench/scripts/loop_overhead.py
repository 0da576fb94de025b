# Our engine's AR loop vs HF generate(do_sample=False) on the same prompts, interleaved; 128 new tokens, bf16.
import statistics, time, torch, transformers
from castspec.api import Engine
from castspec.bench import encode_prompts
from castspec.cli import _prompts
from castspec.models import load_model
model, tok = load_model("qwen2.5-coder-1.5b", "bf16")
engine = Engine(model, tok, None, None)
prompts = _prompts("mtbench,humaneval,gsm8k", 2, 0)
ids_all = encode_prompts(engine, prompts)
cfg = transformers.GenerationConfig(max_new_tokens=128, do_sample=False, eos_token_id=model.generation_config.eos_token_id, pad_token_id=tok.pad_token_id)
def hf(ids):
    x = torch.tensor([ids])
    with torch.inference_mode():
        return model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)[0, len(ids):].tolist()
def ours(ids):
    return engine.generate(prompt_ids=ids, max_new_tokens=128).output_ids
for f in (hf, ours):
    f(ids_all[0][:32])
ratios = []
for p, ids in zip(prompts, ids_all):
    row = {}
    for name, f in (("ours", ours), ("hf", hf)):
        t = time.perf_counter(); out = f(ids); row[name] = (len(out) / (time.perf_counter() - t), out)
    ratios.append(row["hf"][0] / row["ours"][0])
    print(p["id"], f"ours {row['ours'][0]:.2f} tok/s, hf {row['hf'][0]:.2f} tok/s, same output {row['ours'][1] == row['hf'][1]}", flush=True)
print(f"HF plain greedy / our AR, mean of per-prompt ratios: {statistics.fmean(ratios):.3f}")
