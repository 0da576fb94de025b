"""Memory under a long stream of conversations: the prefix cache stays at its bound and the server's RSS flat
(issue 39: "500 conversation turns through the server, RSS flat after warm-up, the cache at its bound").

One `castspec serve` with a small `--prefix-cache-gb`, loaded by the conversation benchmark's sessions (every turn
resends the history) at a fixed concurrency until `--turns-total` turns have run; after every session the server's
RSS (from /proc) and its prefix-cache gauges and counters (from /metrics) are sampled. Writes NAME.json, NAME.md,
NAME.png.

Run: .venv/bin/python bench/scripts/prefix_cache_memory.py bench/prefix-cache/NAME [--model smollm2-135m]
     [--prefix-cache-gb 0.25] [--turns-total 500] [--concurrency 4] [--max-tokens 24]"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from castspec.bench.conversations import conversation_sessions, run_session
from castspec.bench.serving import launch_server, scrape, stream_request
from castspec.costs.table import machine_label


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def server_rss(base_pid: int) -> int:
    """RSS in bytes of the server process (the one child of this process running castspec serve)."""
    for child in psutil.Process(base_pid).children(recursive=True):
        if "serve" in " ".join(child.cmdline()):
            return child.memory_info().rss
    raise RuntimeError("no castspec serve process found")


async def drive(base: str, model: str, sessions: list[dict], concurrency: int, max_tokens: int, samples: list,
                turns_total: int) -> None:
    queue = list(sessions)
    done = {"turns": 0}
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        async def worker():
            while queue and done["turns"] < turns_total:
                records = await run_session(client, model, queue.pop(0), max_tokens, stream_request)
                errors = [r.error for r in records if r.error]
                if errors:
                    raise RuntimeError(f"a turn failed: {errors[0]}")
                done["turns"] += len(records)
                metrics = await asyncio.to_thread(scrape, base)
                samples.append({"turns": done["turns"], "time": time.time(),
                                "rss_bytes": server_rss(psutil.Process().pid),
                                "cache_bytes": metrics.get("castspec:prefix_cache_bytes", 0.0),
                                "cache_blocks": metrics.get("castspec:prefix_cache_blocks", 0.0),
                                "evictions": metrics.get("castspec:prefix_cache_evictions_total", 0.0),
                                "hits": metrics.get("castspec:prefix_cache_hits_total", 0.0),
                                "queries": metrics.get("castspec:prefix_cache_queries_total", 0.0)})
                if len(samples) % 10 == 0:
                    s = samples[-1]
                    log(f"{s['turns']} turns: RSS {s['rss_bytes'] / 2**20:.0f} MiB, cache "
                        f"{s['cache_bytes'] / 2**20:.0f} MiB in {s['cache_blocks']:.0f} blocks, "
                        f"{s['evictions']:.0f} evictions")

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="results path without suffix, e.g. bench/prefix-cache/memory")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--method", default="cast", help="castspec serve --method (the default drafter)")
    parser.add_argument("--drafter", default="suffix")
    parser.add_argument("--prefix-cache-gb", type=float, default=0.25)
    parser.add_argument("--turns-total", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    sessions = conversation_sessions((args.turns_total + 3) // 4 + args.concurrency, 4)
    samples: list[dict] = []
    flags = ["--method", args.method, "--drafter", args.drafter, "--prefix-cache-gb", str(args.prefix_cache_gb),
             "--served-model-name", "m"]
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp, launch_server(args.model, flags, Path(tmp) / "server.log",
                                                             args.dtype) as base:
        asyncio.run(drive(base, "m", sessions, args.concurrency, args.max_tokens, samples, args.turns_total))
    bound = args.prefix_cache_gb * 2**30
    warm = [s for s in samples if s["turns"] >= samples[-1]["turns"] // 5]  # after the first fifth
    summary = {"turns": samples[-1]["turns"], "minutes": round((time.time() - started) / 60, 1),
               "rss_first_mib": samples[0]["rss_bytes"] / 2**20, "rss_warm_min_mib": min(s["rss_bytes"] for s in warm)
               / 2**20, "rss_warm_max_mib": max(s["rss_bytes"] for s in warm) / 2**20,
               "rss_last_mib": samples[-1]["rss_bytes"] / 2**20, "cache_bound_mib": bound / 2**20,
               "cache_max_mib": max(s["cache_bytes"] for s in samples) / 2**20,
               "evictions": samples[-1]["evictions"],
               "hit_rate": samples[-1]["hits"] / samples[-1]["queries"] if samples[-1]["queries"] else None}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "python bench/scripts/prefix_cache_memory.py " + " ".join(sys.argv[1:])
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine_label(), "command": command,
            **{k: v for k, v in vars(args).items() if k != "out"}}
    out.with_name(out.name + ".json").write_text(json.dumps({"meta": meta, "summary": summary,
                                                            "samples": samples}, indent=1))
    out.with_name(out.name + ".md").write_text("\n".join([
        f"# Server memory over {summary['turns']} conversation turns, prefix cache bounded at "
        f"{args.prefix_cache_gb:g} GiB", "",
        f"{meta['date']}, {meta['machine']}, {args.model} {args.dtype}, castspec serve --method {args.method} "
        f"--drafter {args.drafter}, {args.concurrency} concurrent sessions of 4 turns, {args.max_tokens} tokens "
        f"per answer, {summary['minutes']} min.", "", "```", command, "```", "",
        "| turns | RSS first / warm min / warm max / last MiB | cache bound / max MiB | evictions (blocks) | "
        "prefix hit rate |", "|---|---|---|---|---|",
        f"| {summary['turns']} | {summary['rss_first_mib']:.0f} / {summary['rss_warm_min_mib']:.0f} / "
        f"{summary['rss_warm_max_mib']:.0f} / {summary['rss_last_mib']:.0f} | {summary['cache_bound_mib']:.0f} / "
        f"{summary['cache_max_mib']:.0f} | {summary['evictions']:.0f} | "
        f"{'-' if summary['hit_rate'] is None else format(summary['hit_rate'], '.3f')} |", "",
        f"'warm' = from turn {warm[0]['turns']} on.", "", f"![plot]({out.name}.png)", ""]))
    plot(samples, bound, out.with_name(out.name + ".png"))
    print(out.with_name(out.name + ".md"))


def plot(samples: list[dict], bound: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [s["turns"] for s in samples]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    ax.plot(turns, [s["rss_bytes"] / 2**20 for s in samples], marker=".", label="server RSS")
    ax.plot(turns, [s["cache_bytes"] / 2**20 for s in samples], marker=".", label="prefix cache")
    ax.axhline(bound / 2**20, color="grey", linestyle="--", label="--prefix-cache-gb")
    ax.set(xlabel="conversation turns served", ylabel="MiB", title="memory while conversations stream through")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
