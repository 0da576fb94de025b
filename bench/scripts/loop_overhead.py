"""Our engine's AR loop against HF generate(do_sample=False): same prompts (2 per set), 128 new tokens, bf16,
interleaved per prompt. Prints tokens/s per prompt and the mean per-prompt ratio HF / ours.

Run: .venv/bin/python bench/scripts/loop_overhead.py"""

import statistics
import time

import torch
import transformers

from castspec.api import Engine
from castspec.bench.runner import encode_prompts
from castspec.cli.options import prompt_rows as _prompts
from castspec.models import load_model

model, tokenizer = load_model("qwen2.5-coder-1.5b", "bf16")
engine = Engine(model, tokenizer, None, None)
prompts = _prompts("mtbench,humaneval,gsm8k", 2, 0)
encoded = encode_prompts(engine, prompts)
config = transformers.GenerationConfig(max_new_tokens=128, do_sample=False,
                                       eos_token_id=model.generation_config.eos_token_id,
                                       pad_token_id=tokenizer.pad_token_id)


def hf_greedy(ids: list[int]) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        return model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)[0, len(ids):].tolist()


def our_ar(ids: list[int]) -> list[int]:
    return engine.generate(prompt_ids=ids, max_new_tokens=128).output_ids


for warm in (hf_greedy, our_ar):
    warm(encoded[0][:32])
ratios = []
for prompt, ids in zip(prompts, encoded, strict=True):
    rates, outputs = {}, {}
    for name, run in (("ours", our_ar), ("hf", hf_greedy)):
        start = time.perf_counter()
        outputs[name] = run(ids)
        rates[name] = len(outputs[name]) / (time.perf_counter() - start)
    ratios.append(rates["hf"] / rates["ours"])
    print(f"{prompt['id']}: ours {rates['ours']:.2f} tok/s, hf {rates['hf']:.2f} tok/s, ratio {ratios[-1]:.3f}, "
          f"same output {outputs['ours'] == outputs['hf']}", flush=True)
print(f"HF plain greedy / our AR, mean of per-prompt ratios: {statistics.fmean(ratios):.3f}")
