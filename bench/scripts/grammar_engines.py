"""xgrammar or llguidance for castspec's structured output: the measurement behind the choice (issue 41).

On the served target's tokenizer (Qwen2.5, 151,936 ids) and a JSON schema with nested objects, arrays, enums and
bounded integers, for each engine: the one-off tokenizer preparation, compiling the schema, the mask at every
position of a valid answer (median and max microseconds), a rollback of 5 tokens, and the installed size of the
package with what it pulls in. xgrammar is not a castspec dependency: install it into the venv for this run
(`pip install xgrammar`); the script says so if it is missing.

Run: .venv/bin/python bench/scripts/grammar_engines.py bench/structured/grammar-engines (writes .json and .md)"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from castspec.costs.table import machine_label
from castspec.models import resolve

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "job": {"type": "string", "enum": ["nurse", "teacher", "engineer"]},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "job", "address", "tags"], "additionalProperties": False}
ANSWER = {"name": "Maria Lopez", "age": 34, "job": "nurse", "address": {"city": "Valencia", "zip": "46001"},
          "tags": ["kind", "fast", "a b c"]}
VOCAB = 151936


def site_size(packages: list[str]) -> float:
    """MiB on disk of these top-level packages in this venv's site-packages."""
    site = Path(np.__file__).parent.parent
    total = 0
    for name in packages:
        for path in site.glob(name):
            total += sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
    return round(total / 2**20, 1)


def time_llguidance(tokenizer, ids: list[int]) -> dict:
    import llguidance
    import llguidance.hf

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB)
    prepare = time.perf_counter() - start
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    compile_s = time.perf_counter() - start
    bits = np.zeros((VOCAB + 31) // 32, dtype=np.int32)
    masks = []
    for token in ids:
        start = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        masks.append(time.perf_counter() - start)
        assert matcher.consume_token(token), matcher.get_error()
    start = time.perf_counter()
    matcher.rollback(5)
    rollback = time.perf_counter() - start
    return {"prepare_s": prepare, "compile_s": compile_s, "mask_us_median": statistics.median(masks) * 1e6,
            "mask_us_max": max(masks) * 1e6, "rollback_us": rollback * 1e6,
            "installed_mib": site_size(["llguidance"])}


def time_xgrammar(tokenizer, ids: list[int]) -> dict:
    import torch
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB)
    compiler = xgrammar.GrammarCompiler(info, max_threads=2)
    prepare = time.perf_counter() - start
    start = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)), max_rollback_tokens=64)
    compile_s = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, VOCAB)
    masks = []
    for token in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        masks.append(time.perf_counter() - start)
        assert matcher.accept_token(token)
    start = time.perf_counter()
    matcher.rollback(5)
    rollback = time.perf_counter() - start
    del torch
    return {"prepare_s": prepare, "compile_s": compile_s, "mask_us_median": statistics.median(masks) * 1e6,
            "mask_us_max": max(masks) * 1e6, "rollback_us": rollback * 1e6,
            "installed_mib": site_size(["xgrammar", "triton", "tvm_ffi"])}


def main() -> None:
    out = Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve("qwen2.5-coder-1.5b"))
    ids = tokenizer.encode(json.dumps(ANSWER))
    result = {"meta": {"machine": machine_label(), "date": time.strftime("%Y-%m-%d %H:%M"),
                       "tokens": len(ids), "command": "python " + " ".join(sys.argv),
                       "versions": subprocess.run([sys.executable, "-m", "pip", "list", "--format=freeze"],
                                                  capture_output=True, text=True).stdout.split()},
              "engines": {}}
    result["meta"]["versions"] = [v for v in result["meta"]["versions"] if v.split("==")[0] in
                                  ("llguidance", "xgrammar", "triton")]
    for name, run in (("llguidance", time_llguidance), ("xgrammar", time_xgrammar)):
        try:
            result["engines"][name] = {k: round(v, 3) if isinstance(v, float) else v
                                       for k, v in run(tokenizer, ids).items()}
        except ImportError:
            print(f"{name} is not installed here: pip install {name} to compare it", file=sys.stderr)
    out.with_name(out.name + ".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Grammar engines on Qwen2.5's tokenizer ({VOCAB} ids), {result['meta']['machine']}", "",
             f"`{result['meta']['command']}` ({result['meta']['date']}); a valid answer of {len(ids)} tokens; "
             f"{', '.join(result['meta']['versions'])}.", "",
             "| engine | tokenizer prep s | schema compile s | mask us median | mask us max | rollback 5 us "
             "| installed MiB |", "|---|---|---|---|---|---|---|"]
    for name, r in result["engines"].items():
        lines.append(f"| {name} | {r['prepare_s']:.2f} | {r['compile_s']:.3f} | {r['mask_us_median']:.0f} | "
                     f"{r['mask_us_max']:.0f} | {r['rollback_us']:.0f} | {r['installed_mib']} |")
    out.with_name(out.name + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
