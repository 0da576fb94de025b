"""Inter-token latency of running requests while a 2k-token prompt joins, per prefill chunk (issue 39, item 2).

One `castspec serve` per (method, --prefill-chunk) setting, all started first and measured in turn, in
alternating order over the repeats (the machine drifts over minutes). Per measurement: two streaming clients
decode long answers; once both stream steadily, a ~2k-token prompt arrives; the gaps between the running clients'
chunks are split into "steady" (both running, before it arrived) and "joining" (from its arrival to its first
token). The prefix
cache is off, so the long prompt is prefilled in full every time. Writes NAME.json, NAME.md, NAME.png.

Run: .venv/bin/python bench/scripts/chunked_prefill_itl.py bench/prefix-cache/NAME
     [--servers ar:0,ar:64,ar:auto,cast-ngram:auto] (METHOD:CHUNK, 0 = a whole prompt at once, auto = sized by
     time, the server's default) [--repeats 2]
     [--model qwen2.5-coder-1.5b]"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from castspec.bench.prompts import load_prompt_set
from castspec.bench.serving import _pct, launch_server
from castspec.costs.table import machine_label

METHODS = {"ar": ["--method", "ar"], "cast-suffix": ["--drafter", "suffix"], "cast-ngram": []}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def long_prompt(tokenizer, tokens: int, salt: int) -> str:
    """A code-review request over HumanEval functions, cut to about `tokens` tokens (salted: never a cache hit)."""
    parts, text = [f"Review #{salt}. Read these functions and say which one is the most error-prone.\n\n"], ""
    for row in load_prompt_set("humaneval"):
        parts.append(row["messages"][-1]["content"] + "\n")
        text = "".join(parts)
        if len(tokenizer(text)["input_ids"]) > tokens:
            break
    ids = tokenizer(text)["input_ids"][:tokens]
    return tokenizer.decode(ids)


async def stream(client: httpx.AsyncClient, content: str, max_tokens: int, times: list[float]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if any(choice.get("token_ids") for choice in chunk.get("choices", [])):
                    times.append(time.perf_counter())


async def measure(base: str, joining: str, runners: list[str], steady_chunks: int = 16) -> dict:
    """Two running streams; the long prompt joins once both have `steady_chunks` chunks."""
    async with httpx.AsyncClient(base_url=base, timeout=1800) as client:
        times: list[list[float]] = [[], []]
        tasks = [asyncio.create_task(stream(client, text, 1000, t)) for text, t in zip(runners, times, strict=True)]
        for _ in range(6000):  # at most 5 minutes
            if min(len(t) for t in times) >= steady_chunks:
                break
            if any(task.done() for task in tasks):
                raise RuntimeError(f"a running stream ended early: {[t.exception() for t in tasks if t.done()]}")
            await asyncio.sleep(0.05)
        sent = time.perf_counter()
        first: list[float] = []
        await stream(client, joining, 1, first)
        joined = first[0] if first else time.perf_counter()
        await asyncio.sleep(2.0)  # a few steps after the join, then the runners go
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
            await asyncio.gather(*tasks)
    steady, during = [], []
    both_running = max(t[1] for t in times)  # from the second chunk of the later runner: its own join is past
    for t in times:
        for a, b in zip(t, t[1:], strict=False):
            if both_running <= a and b <= sent:
                steady.append(b - a)
            elif a < joined and b > sent:  # a gap that overlaps the join's prefill
                during.append(b - a)
    return {"steady": steady, "joining": during, "ttft_joining_s": joined - sent}


def summary(samples: list[dict]) -> dict:
    steady = [g for s in samples for g in s["steady"]]
    during = [g for s in samples for g in s["joining"]]
    out = {"steady_p50_s": _pct(steady, 50), "steady_p99_s": _pct(steady, 99), "joining_p50_s": _pct(during, 50),
           "joining_p99_s": _pct(during, 99), "ttft_joining_s": statistics.fmean(s["ttft_joining_s"] for s in samples),
           "steady_gaps": len(steady), "joining_gaps": len(during)}
    out["p99_ratio"] = out["joining_p99_s"] / out["steady_p99_s"] if steady and during else None
    out["p99_over_steady_p50"] = out["joining_p99_s"] / out["steady_p50_s"] if steady and during else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="results path without suffix, e.g. bench/prefix-cache/chunked-itl")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--servers", default="ar:0,ar:64,ar:128,cast-ngram:128",
                        help=f"METHOD:CHUNK items, METHOD one of {', '.join(METHODS)}")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from castspec.models import resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve(args.model))
    runners = [m["messages"][-1]["content"] for m in load_prompt_set("mtbench")[:2]]
    plans = [(method, chunk) for method, chunk in (item.split(":") for item in args.servers.split(","))]
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        servers = []
        for i, (method, chunk) in enumerate(plans):
            flags = [*METHODS[method], "--prefill-chunk", chunk, "--prefix-cache-gb", "0",
                     "--served-model-name", "m"]
            log(f"starting castspec serve {' '.join(flags)}")
            servers.append((f"{method} chunk={chunk}", stack.enter_context(
                launch_server(args.model, flags, Path(tmp) / f"{i}.log", args.dtype))))
        for repeat in range(args.repeats):
            for label, base in servers if repeat % 2 == 0 else servers[::-1]:
                joining = long_prompt(tokenizer, args.prompt_tokens, len(results.get(label, [])) + 100 * repeat)
                sample = asyncio.run(measure(base, joining, runners))
                results.setdefault(label, []).append(sample)
                s = summary([sample])
                log(f"[{label}] steady p50 {s['steady_p50_s']:.3f} p99 {s['steady_p99_s']:.3f}; joining p50 "
                    f"{s['joining_p50_s']:.3f} p99 {s['joining_p99_s']:.3f}; TTFT of the 2k prompt "
                    f"{s['ttft_joining_s']:.1f} s")
    rows = [{"server": label, **summary(samples)} for label, samples in results.items()]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python bench/scripts/chunked_prefill_itl.py " + " ".join(sys.argv[1:])
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_label(), "model": args.model,
            "dtype": args.dtype, "prompt_tokens": args.prompt_tokens, "repeats": args.repeats, "command": command}
    out.with_name(out.name + ".json").write_text(json.dumps({"meta": meta, "rows": rows, "samples": results},
                                                            indent=1))
    lines = [f"# Inter-token latency while a {args.prompt_tokens}-token prompt joins two running requests", "",
             f"{meta['date']}, {meta['machine']}, {args.model} {args.dtype}, {args.repeats} repeats per server "
             "(alternating order), prefix cache off.", "", "```", command, "```", "",
             "| server | ITL steady p50 / p99 s | ITL while joining p50 / p99 s | joining p99 / steady p99 | "
             "joining p99 / steady p50 | TTFT of the long prompt s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['server']} | {r['steady_p50_s']:.3f} / {r['steady_p99_s']:.3f} | "
                     f"{r['joining_p50_s']:.3f} / {r['joining_p99_s']:.3f} | {r['p99_ratio']:.2f} | "
                     f"{r['p99_over_steady_p50']:.2f} | {r['ttft_joining_s']:.1f} |")
    lines += ["", f"![plot]({out.name}.png)", ""]
    out.with_name(out.name + ".md").write_text("\n".join(lines))
    plot(results, out.with_name(out.name + ".png"), args.prompt_tokens)
    print(out.with_name(out.name + ".md"))


def plot(results: dict[str, list[dict]], path: Path, tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    labels = list(results)
    steady = [[g for s in results[k] for g in s["steady"]] for k in labels]
    during = [[g for s in results[k] for g in s["joining"]] for k in labels]
    positions = range(len(labels))
    ax.boxplot(steady, positions=[p - 0.18 for p in positions], widths=0.3, whis=(1, 99), showfliers=False,
               patch_artist=True, boxprops={"facecolor": "C0", "alpha": 0.5})
    ax.boxplot(during, positions=[p + 0.18 for p in positions], widths=0.3, whis=(1, 99), showfliers=False,
               patch_artist=True, boxprops={"facecolor": "C3", "alpha": 0.5})
    ax.set_xticks(list(positions), labels, rotation=20, fontsize=8)
    ax.set(ylabel="seconds between a running request's chunks", yscale="log",
           title=f"ITL steady (blue) and while a {tokens}-token prompt joins (red); whiskers p1-p99")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
