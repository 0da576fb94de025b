"""The conversation benchmark against castspec and vLLM for CPU with the same client (issue 39).

Servers run one at a time (each takes both cores): vLLM 0.32 for CPU with its prefix caching (on by default in
its V1 engine), with and without its n-gram speculation, and castspec servers (empty $CASTSPEC_HOME each, the
fetched weights linked in). Each level runs every session of `castspec.bench.conversations` once, `c` at a time,
every turn resending the whole history, from an empty prefix cache (`POST /reset_prefix_cache` on both; vLLM
serves it with VLLM_SERVER_DEV_MODE=1). The client asks for token ids (`return_token_ids`, which castspec always
sends and vLLM sends when asked), so tokens and chunk times are counted alike. vLLM is installed into its own
venv by `peer_vllm.py` (never a castspec dependency). Writes NAME.json, NAME.md, NAME.png.

Run: .venv/bin/python bench/scripts/peer_vllm_conversations.py bench/conversations/NAME [--concurrency 1,4]
     [--sessions 4] [--turns 4] [--max-tokens 96] [--servers vllm,vllm-ngram,castspec-ar,castspec-cast-suffix]
     [--trace]"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from peer_vllm import (  # noqa: E402
    SERVED,
    finish,
    fresh_home,
    install_vllm,
    keep_server,
    new_result,
    peer_parser,
    running,
    server_command,
)

from castspec.bench.conversations import conversation_sessions, reset_prefix_cache, sessions_at_concurrency  # noqa: E402
from castspec.bench.serving import _pct, free_port, scrape, stream_request, summarise_level  # noqa: E402
from castspec.models import resolve  # noqa: E402

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
CASTSPEC = {"castspec-ar": ["--method", "ar"], "castspec-cast-suffix": ["--drafter", "suffix"],
            "castspec-cast-ngram": [], "castspec-cast-suffix-chunk64": ["--drafter", "suffix", "--prefill-chunk", "64"],
            "castspec-cast-suffix-chunk256": ["--drafter", "suffix", "--prefill-chunk", "256"]}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def command_for(name: str, vllm: Path, model_dir: str, port: int, home: Path, trace: Path | None = None
                ) -> tuple[list[str], dict]:
    """The server's command; a castspec server writes its step trace (`serve --trace`) to `trace` when given."""
    vllm_args = {"vllm": ["--enable-prefix-caching"],
                 "vllm-ngram": ["--enable-prefix-caching", "--speculative-config", NGRAM]}
    castspec = {name: [*args, "--trace", str(trace)] if trace else args for name, args in CASTSPEC.items()}
    return server_command(name, vllm, model_dir, port, home, castspec, vllm_args, {"VLLM_SERVER_DEV_MODE": "1"})


def hit_rate(before: dict, after: dict) -> float | None:
    for prefix in ("castspec", "vllm"):
        queries = after.get(f"{prefix}:prefix_cache_queries_total", 0.0) - before.get(
            f"{prefix}:prefix_cache_queries_total", 0.0)
        if queries:
            return (after.get(f"{prefix}:prefix_cache_hits_total", 0.0)
                    - before.get(f"{prefix}:prefix_cache_hits_total", 0.0)) / queries
    return None


def main() -> None:
    parser = peer_parser(__doc__, "vllm,vllm-ngram,castspec-ar,castspec-cast-suffix")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--trace", action="store_true", help="castspec servers write NAME-SERVER-trace.jsonl")
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    vllm = install_vllm(Path(args.venv))
    model_dir = str(resolve(SERVED))
    sessions = conversation_sessions(args.sessions, args.turns)
    levels = [int(c) for c in args.concurrency.split(",")]
    result = new_result(sessions=[s["id"] for s in sessions], turns=args.turns, max_tokens=args.max_tokens)
    for name in args.servers.split(","):
        home = fresh_home()
        trace = out.parent / f"{out.name}-{name}-trace.jsonl" if args.trace else None
        command, env = command_for(name, vllm, model_dir, free_port(), home, trace)
        log(f"{name}: starting ...")
        with running(command, env, out.parent / f"{out.name}-{name}.log") as (base, startup_s):
            asyncio.run(sessions_at_concurrency(base, SERVED, conversation_sessions(1, 1), 1, 4, 600,
                                                stream_request))  # warm-up, then a cold cache per level
            levels_out = {}
            for c in levels:
                reset_prefix_cache(base)
                before, started = scrape(base), time.perf_counter()
                records = asyncio.run(sessions_at_concurrency(base, SERVED, sessions, c, args.max_tokens, 3600,
                                                              stream_request))
                wall = time.perf_counter() - started
                after = scrape(base)
                row = summarise_level(records, wall, before, after, [])
                row["prefix_hit_rate"] = hit_rate(before, after)
                row["itl_p50_s"] = _pct([b - a for r in records if r.error is None
                                         for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)], 50)
                levels_out[str(c)] = {k: v for k, v in row.items() if k not in ("tree_size_by_batch",)}
                log(f"  {name} c={c}: {row['throughput_tok_s']} tok/s, TTFT turn 1 {row['ttft_turn1_p50_s']:.2f} s, "
                    f"later {row['ttft_later_p50_s']:.2f} s, hit rate {row['prefix_hit_rate']}, errors "
                    f"{len(row['errors'])}")
        keep_server(result, out, name, startup_s, levels_out)
    finish(out, report(result, levels), lambda path: plot(result, levels, path))


def report(result: dict, levels: list[int]) -> str:
    meta, servers = result["meta"], result["servers"]
    peer = max((s for n, s in servers.items() if n.startswith("vllm")),
               key=lambda s: sum(s["levels"][str(c)]["throughput_tok_s"] for c in levels), default=None)
    reference = servers.get("castspec-ar")
    lines = [f"# Conversations: castspec beside vLLM for CPU, {meta['model']} bf16, {meta['machine']}", "",
             f"`{meta['command']}` ({meta['date']}); {len(meta['sessions'])} sessions x {meta['turns']} turns, "
             f"{meta['max_tokens']} tokens per answer, greedy; each turn resends the history; each level from an "
             "empty prefix cache; one server at a time. 'x best vLLM': against the vLLM configuration with the "
             "higher throughput summed over the levels.", ""]
    header = "| server | c | tok/s (x best vLLM) | TTFT turn 1 p50 s | TTFT later p50 / p99 s | ITL p50 s | " \
             "prefix hit rate | answers = castspec AR |"
    lines += [header, "|" + "---|" * 8]
    for name, s in servers.items():
        for c in levels:
            row = s["levels"][str(c)]
            ref = peer["levels"][str(c)]["throughput_tok_s"] if peer else None
            same = "-"
            if reference is not None:
                outputs = reference["levels"][str(c)]["outputs"]
                same = f"{sum(outputs.get(k) == v for k, v in row['outputs'].items())}/{len(row['outputs'])}"
            hit = row.get("prefix_hit_rate")
            lines.append(f"| {name} | {c} | {row['throughput_tok_s']:.2f}"
                         + (f" ({row['throughput_tok_s'] / ref:.2f}x)" if ref else "")
                         + f" | {row['ttft_turn1_p50_s']:.2f} | {row['ttft_later_p50_s']:.2f} / "
                         f"{row['ttft_later_p99_s']:.2f} | {row['itl_p50_s']:.3f} | "
                         f"{'-' if hit is None else f'{hit:.3f}'} | {same} |")
    return "\n".join(lines)


def plot(result: dict, levels: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["servers"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        rows = [result["servers"][name]["levels"][str(c)] for c in levels]
        xs = [i + k * width for i in range(len(levels))]
        left.bar(xs, [r["throughput_tok_s"] for r in rows], width, label=name)
        right.bar(xs, [r["ttft_later_p50_s"] for r in rows], width, label=name)
    for ax, what in ((left, "generated tokens / s"), (right, "TTFT p50 of turns >= 2 (s)")):
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(levels))], [f"c = {c}" for c in levels])
        ax.set_ylabel(what)
        ax.grid(alpha=0.3, axis="y")
    left.legend(fontsize=8)
    fig.suptitle(f"conversations, {result['meta']['model']} bf16, {result['meta']['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
