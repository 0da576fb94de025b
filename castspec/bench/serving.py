"""Load benchmark over the real HTTP API: for each method a `castspec serve` process on 127.0.0.1, streaming
clients at fixed concurrency levels and at Poisson arrival rates, methods side by side in one run.

Per level: throughput (generated tokens / wall time), time to first token, inter-token latency (gap between two
streamed chunks of a request; a speculative step may bring several tokens), time per output token, end-to-end
latency (p50 / p99), and from the server's own metrics and trace: mean batch size, mean tree size, tau, and the
tree sizes chosen at each batch size."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from castspec.bench import PER_CLIENT
from castspec.bench.conversations import reset_prefix_cache, sessions_at_concurrency, turn_latencies
from castspec.bench.runner import MethodSpec
from castspec.errors import CastspecError
from castspec.serve.metrics import PUSH_EVERY_S

START_TIMEOUT_S = 600
WARM_UP = {"id": "warm-up", "messages": [{"role": "user", "content": "Say hello."}]}
CLI_FLAGS = {"chain_length": "--chain-length", "top_k": "--top-k", "depth": "--depth",
             "total_tokens": "--total-tokens", "cast_c1": "--cast-c1", "cast_c2": "--cast-c2", "cast_c3": "--cast-c3",
             "cast_r": "--cast-r", "cast_max_depth": "--cast-max-depth", "prefix_cache_gb": "--prefix-cache-gb",
             "prefill_chunk": "--prefill-chunk", "prefill_slack": "--prefill-slack",
             "prefill_at_once": "--prefill-at-once"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def launch_server(model: str, args: list[str], log_path: Path, dtype: str = "bf16",
                  start_timeout_s: float = START_TIMEOUT_S):
    """A `castspec serve` process on 127.0.0.1 and a free port; yields its base URL once /health answers, and
    stops it on the way out (terminate, then kill)."""
    port = free_port()
    command = [sys.executable, "-m", "castspec.cli", "serve", "--model", model, "--dtype", dtype, "--host",
               "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        base = f"http://127.0.0.1:{port}"
        try:
            log.flush()
            wait_until_up(proc, f"{base}/health", start_timeout_s, log_path)
            yield base
        finally:
            stop(proc, 30)


def wait_until_up(proc: subprocess.Popen, url: str, timeout_s: float, log_path: Path) -> float:
    """Seconds until `url` answers 200; the server's log in the error if it exits or does not come up."""
    start = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise CastspecError(f"{proc.args[0]} exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise CastspecError(f"{proc.args[0]} did not come up in {timeout_s:.0f} s (log: {log_path})")
        time.sleep(0.3)


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def server_args(spec: MethodSpec, draft: str | None, head: str | None) -> list[str]:
    """`castspec serve` flags for a bench method item ('cast:draft', 'eagle2:ngram:top_k=4', ...)."""
    if spec.method.startswith("hf-"):
        raise CastspecError(f"{spec.label}: the HF baselines have no server")
    args = ["--method", spec.method]
    drafter = spec.drafter or ""
    if drafter.startswith("draft"):
        if not draft:
            raise CastspecError(f"{spec.label} needs --draft")
        args += ["--draft", draft]
    elif drafter.startswith("head"):
        if not head:
            raise CastspecError(f"{spec.label} needs --head")
        args += ["--head", head]
    elif drafter in ("ngram", "suffix"):
        args += ["--drafter", drafter]
    if drafter.endswith("+ngram"):
        args.append("--with-ngram")
    if drafter.endswith("+suffix"):
        args.append("--with-suffix")
    for key, value in spec.options.items():
        if key == "auto":
            args += ["--cast-mode", "auto" if value else "paper"]
        elif key == "calibrate":
            args += ["--cast-calibration", "on" if value else "off"]
        elif key == "online":
            if value not in (0, 1):
                raise CastspecError(f"{spec.label}: a server reads its costs online (online=1) or from a fixed "
                                    "table (online=0)")
            args += ["--cost-model", "online" if value else "fixed"]
        elif key == "payoff":
            args += ["--cast-payoff", "on" if value else "off"]
        elif key in CLI_FLAGS:
            args += [CLI_FLAGS[key], str(value)]
        else:
            raise CastspecError(f"{spec.label}: option {key} has no castspec serve flag")
    return args


@dataclass
class RequestRecord:
    prompt_id: str
    sent: float
    first_token: float | None = None
    done: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    text: str = ""  # the answer (a conversation's next turn sends it back)
    turn: int = 0  # the turn of its conversation (0: not part of one)


async def stream_request(client: httpx.AsyncClient, model: str, prompt: dict, max_tokens: int) -> RequestRecord:
    """One greedy streamed chat request; the arrival time of every chunk and the tokens it brought."""
    record = RequestRecord(prompt["id"], time.perf_counter())
    # return_token_ids: vLLM's flag for the token ids castspec always sends, so that one client counts both alike
    body = {"model": model, "messages": prompt["messages"], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = chunk["error"]["message"]
                    return record
                ids = [t for choice in chunk["choices"] for t in choice.get("token_ids") or []]
                record.text += "".join((choice.get("delta") or {}).get("content") or "" for choice in chunk["choices"])
                if ids:
                    now = time.perf_counter()
                    record.first_token = record.first_token or now
                    record.chunk_times.append(now)
                    record.chunk_tokens.append(len(ids))
                    record.token_ids += ids
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
    record.done = time.perf_counter()
    return record


def level_prompts(prompts: list[dict], concurrency: int, per_client: int) -> list[dict]:
    """What one concurrency level sends: every prompt once, cycled on until each client has sent `per_client`
    requests. A level of exactly `concurrency` prompts is one wave that drains: its last requests run in a batch
    emptied by the ones that finished early (speculation finishes some rows much sooner than others), which
    measures the tail of a wave, not a server under steady load."""
    count = max(len(prompts), concurrency * per_client)
    return [prompts[i % len(prompts)] for i in range(count)]


async def at_concurrency(base: str, model: str, prompts: list[dict], concurrency: int, max_tokens: int,
                         timeout_s: float) -> list[RequestRecord]:
    """`concurrency` clients, each sending its next prompt as soon as its last one finished."""
    queue = list(prompts)
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(base_url=base, timeout=timeout_s) as client:
        async def worker():
            while queue:
                records.append(await stream_request(client, model, queue.pop(0), max_tokens))

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout_s)
    return records


async def at_rate(base: str, model: str, prompts: list[dict], rate: float, max_tokens: int, timeout_s: float,
                  seed: int = 0) -> list[RequestRecord]:
    """Requests arriving as a Poisson process of `rate` per second (exponential gaps, seeded)."""
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, timeout=timeout_s) as client:
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(stream_request(client, model, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.wait_for(asyncio.gather(*tasks), timeout_s))


def scrape(base: str) -> dict[str, float]:
    """Sums of the server's metrics by name (labels folded)."""
    totals: dict[str, float] = defaultdict(float)
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            totals[series.split("{")[0]] += float(value)
    return dict(totals)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    lo = int(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


def summarise_level(records: list[RequestRecord], wall: float, before: dict, after: dict,
                    trace_steps: list[dict]) -> dict:
    ok = [r for r in records if r.error is None and r.token_ids]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    ttft = [r.first_token - r.sent for r in ok]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    tpot = [(r.done - r.first_token) / (len(r.token_ids) - 1) for r in ok if len(r.token_ids) > 1]
    e2e = [r.done - r.sent for r in ok]
    tokens = sum(len(r.token_ids) for r in ok)
    by_batch: dict[int, list[int]] = defaultdict(list)
    for step in trace_steps:
        if step.get("kind", "decode") == "decode":
            by_batch[step["batch_size"]] += step["tree_sizes"]
    drafts = delta.get("castspec:spec_decode_num_drafts_total", 0.0)
    steps = delta.get("castspec:batch_size_sum", 0.0)  # row-steps: every running row in every decode step
    return {
        "requests": len(records), "errors": [r.error for r in records if r.error],
        "tokens": tokens, "wall_s": round(wall, 3), "throughput_tok_s": round(tokens / wall, 3) if wall else None,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99),
        "tpot_p50_s": _pct(tpot, 50), "e2e_p50_s": _pct(e2e, 50), "e2e_p99_s": _pct(e2e, 99),
        "mean_batch_size": (steps / delta["castspec:batch_size_count"]
                            if delta.get("castspec:batch_size_count") else None),
        "mean_tree_size": (delta["castspec:tree_size_sum"] / delta["castspec:tree_size_count"]
                           if delta.get("castspec:tree_size_count") else None),
        "tau": (tokens - len(ok)) / steps if steps else None,
        "acceptance_rate": (delta.get("castspec:spec_decode_num_accepted_tokens_total", 0.0)
                            / delta["castspec:spec_decode_num_draft_tokens_total"]
                            if delta.get("castspec:spec_decode_num_draft_tokens_total") else None),
        "drafted_row_steps": drafts,
        "tree_size_by_batch": {b: round(statistics.fmean(v), 2) for b, v in sorted(by_batch.items())},
        # vLLM's meaning: prompt tokens found in the prefix cache over prompt tokens looked up
        "prefix_hit_rate": (delta.get("castspec:prefix_cache_hits_total", 0.0)
                            / delta["castspec:prefix_cache_queries_total"]
                            if delta.get("castspec:prefix_cache_queries_total") else None),
        **(turn_latencies(ok) if any(r.turn for r in ok) else {}),
        "outputs": {r.prompt_id: r.token_ids for r in ok},
    }


def _read_traces(path: Path, seen: dict[Path, int]) -> list[dict]:
    """Steps written since the last read to `path`, or with Ray replicas to each replica's STEM.<id>.jsonl."""
    steps = []
    for trace in [path, *sorted(path.parent.glob(f"{path.stem}.*{path.suffix}"))]:
        if trace.exists():
            lines = trace.read_text().splitlines()
            steps += [json.loads(line) for line in lines[seen.get(trace, 0):]]
            seen[trace] = len(lines)
    return steps


def _label(spec: MethodSpec, replicas: int | None) -> str:
    if replicas is None:
        return spec.label
    return f"{spec.label} @ {'1 process' if replicas == 0 else f'{replicas} replica' + ('s' if replicas > 1 else '')}"


def run_bench_serve(model: str, specs: list[MethodSpec], prompts: list[dict], concurrency: list[int],
                    rates: list[float], max_tokens: int, dtype: str, max_batch_size: int, draft: str | None = None,
                    head: str | None = None, timeout_s: float = 3600, replicas: list[int] | None = None,
                    replica_cpus: float = 1.0, log=print, per_client: int = PER_CLIENT,
                    trace_dir: Path | None = None, sessions: list[dict] | None = None) -> dict:
    """Every level against every method's server; returns rows and a summary.

    One process per method (no `replicas`): all the servers are started first, then each level runs against each
    of them in turn, in alternating order (A B C, then C B A, ...), so that the machine's drift over minutes (on a
    shared 2-core machine the same forward's time wanders by 20 % or more) hits every method alike instead of
    deciding a ratio. With `replicas` (0 = one process without Ray, N = N Ray Serve replicas of `replica_cpus`
    CPUs and threads each) the servers compete for the same CPUs, so they run one after another. A concurrency
    level sends `level_prompts(prompts, c, per_client)`. With `trace_dir`, every server's per-step trace (prefill
    and decode steps, with their times) is kept there as INDEX-trace.jsonl. With `sessions` (the conversation
    benchmark), a concurrency level runs every session once (`concurrency` at a time, each turn sending the whole
    history), each level starting from an empty prefix cache."""
    served = Path(model).name
    plans = [(spec, count) for spec in specs for count in (replicas or [None])]
    levels = [("concurrency", c) for c in concurrency] + [("rate", r) for r in rates]
    rows: list[tuple[int, int, dict]] = []
    with tempfile.TemporaryDirectory(prefix="castspec-bench-serve-") as tmp:

        def start(stack: contextlib.ExitStack, index: int, spec: MethodSpec, count: int | None) -> dict:
            label = _label(spec, count)
            trace = (trace_dir or Path(tmp)) / f"{index}-trace.jsonl"
            trace.parent.mkdir(parents=True, exist_ok=True)
            trace.unlink(missing_ok=True)
            args = [*server_args(spec, draft, head), "--max-batch-size", str(max_batch_size), "--trace", str(trace),
                    "--served-model-name", served]
            if count:
                args += ["--replicas", str(count), "--replica-cpus", str(replica_cpus)]
            log(f"[{label}] starting castspec serve {' '.join(args)}")
            base = stack.enter_context(launch_server(model, args, Path(tmp) / f"{index}.log", dtype))
            warm_up = [WARM_UP] if sessions else prompts[:1]  # not a session's turn: that would be a cached prefix
            for _ in range(max(1, count or 1)):  # warm-up: every replica probably gets one
                asyncio.run(at_concurrency(base, served, warm_up, 1, 4, timeout_s))
            server = {"index": index, "label": label, "spec": spec, "count": count, "trace": trace, "base": base,
                      "seen": {}}
            _read_traces(trace, server["seen"])
            return server

        def measure(server: dict, level_index: int) -> None:
            kind, value = levels[level_index]
            base, count = server["base"], server["count"]
            if count:
                time.sleep(PUSH_EVERY_S + 0.5)
            if sessions:
                reset_prefix_cache(base)
            before, started = scrape(base), time.perf_counter()
            if sessions:
                level = sessions_at_concurrency(base, served, sessions, value, max_tokens, timeout_s, stream_request)
            elif kind == "concurrency":
                level = at_concurrency(base, served, level_prompts(prompts, value, per_client), value, max_tokens,
                                       timeout_s)
            else:
                level = at_rate(base, served, prompts, value, max_tokens, timeout_s)
            try:
                records = asyncio.run(level)
            except TimeoutError:  # the level is reported as failed; the run goes on
                records = [RequestRecord(p["id"], started, error=f"level timed out after {timeout_s:.0f} s")
                           for p in prompts]
            wall = time.perf_counter() - started
            if count:  # every replica's metrics snapshot taken after the level's last request
                time.sleep(PUSH_EVERY_S + 0.5)
            row = {"method": server["label"], "spec": server["spec"].label, "replicas": count, "kind": kind,
                   "level": value, **summarise_level(records, wall, before, scrape(base),
                                                     _read_traces(server["trace"], server["seen"])),
                   "records": [asdict(r) for r in records]}
            rows.append((server["index"], level_index, row))
            log(f"[{server['label']}] {kind}={value}: {row['throughput_tok_s']} tok/s, mean batch "
                f"{_fmt(row['mean_batch_size'])}, mean tree {_fmt(row['mean_tree_size'])}, tau "
                f"{_fmt(row['tau'])}, tree by B {row['tree_size_by_batch']}, errors {len(row['errors'])}")

        if replicas is None:
            with contextlib.ExitStack() as stack:
                servers = [start(stack, i, spec, count) for i, (spec, count) in enumerate(plans)]
                for level_index in range(len(levels)):
                    for server in servers if level_index % 2 == 0 else servers[::-1]:
                        measure(server, level_index)
        else:
            for i, (spec, count) in enumerate(plans):
                with contextlib.ExitStack() as stack:
                    server = start(stack, i, spec, count)
                    for level_index in range(len(levels)):
                        measure(server, level_index)
    ordered = [row for _, _, row in sorted(rows, key=lambda r: (r[0], r[1]))]  # per method, its levels in order
    return {"rows": ordered, "summary": summarise_runs(ordered)}


def summarise_runs(rows: list[dict]) -> list[dict]:
    """One line per (method, level): the figures above, the speed-up over AR at the same level (and the same
    replicas), and whether every output equals AR's."""
    ar = {(r["kind"], r["level"], r.get("replicas")): r for r in rows if r.get("spec", r["method"]) == "ar"}
    out = []
    for r in rows:
        base = ar.get((r["kind"], r["level"], r.get("replicas")))
        line = {k: v for k, v in r.items() if k not in ("records", "outputs")}
        line["speedup_vs_ar"] = (round(r["throughput_tok_s"] / base["throughput_tok_s"], 3)
                                 if base and base["throughput_tok_s"] else None)
        # every request against AR's output for its prompt (a level cycles its prompts: a prompt is asked again)
        line["same_as_ar"] = (sum(rec["token_ids"] == base["outputs"].get(rec["prompt_id"])
                                  for rec in r["records"] if rec["error"] is None and rec["token_ids"])
                              if base else None)
        out.append(line)
    return out


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown_table(summary: list[dict]) -> str:
    lines = ["| method | load | tok/s | vs AR | TTFT p50 / p99 s | ITL p50 / p99 s | E2E p50 / p99 s | mean B | "
             "mean tree | tau | tree by B | same as AR |", "|" + "---|" * 12]
    for s in summary:
        load = f"c={s['level']}" if s["kind"] == "concurrency" else f"{s['level']}/s"
        by_b = ", ".join(f"{b}: {v}" for b, v in s["tree_size_by_batch"].items()) or "-"
        lines.append(f"| `{s['method']}` | {load} | {_fmt(s['throughput_tok_s'])} | {_fmt(s['speedup_vs_ar'])}x | "
                     f"{_fmt(s['ttft_p50_s'])} / {_fmt(s['ttft_p99_s'])} | {_fmt(s['itl_p50_s'], 3)} / "
                     f"{_fmt(s['itl_p99_s'], 3)} | {_fmt(s['e2e_p50_s'], 1)} / {_fmt(s['e2e_p99_s'], 1)} | "
                     f"{_fmt(s['mean_batch_size'])} | {_fmt(s['mean_tree_size'], 1)} | {_fmt(s['tau'])} | {by_b} | "
                     f"{_fmt(s['same_as_ar'])}/{s['requests']} |")
    if any("ttft_later_p50_s" in s for s in summary):
        lines += ["", "Conversations: TTFT of first turns and of later turns (which resend the history), and the "
                  "share of prompt tokens found in the prefix cache.", "",
                  "| method | load | prefix hit rate | TTFT turn 1 p50 s | TTFT turns >= 2 p50 / p99 s | "
                  "TTFT p50 by turn s |", "|" + "---|" * 6]
        for s in summary:
            if "ttft_later_p50_s" not in s:
                continue
            by_turn = ", ".join(f"{t}: {v:.2f}" for t, v in s["ttft_p50_by_turn"].items())
            lines.append(f"| `{s['method']}` | c={s['level']} | {_fmt(s.get('prefix_hit_rate'), 3)} | "
                         f"{_fmt(s['ttft_turn1_p50_s'])} | {_fmt(s['ttft_later_p50_s'])} / "
                         f"{_fmt(s['ttft_later_p99_s'])} | {by_turn} |")
    return "\n".join(lines)


def plot(summary: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.6))
    methods = list(dict.fromkeys(s["method"] for s in summary))
    levels = sorted({s["level"] for s in summary if s["kind"] == "concurrency"})
    for i, method in enumerate(methods):
        style = {"marker": "o", "label": method, "color": f"C{i % 10}"}
        fixed = [s for s in summary if s["method"] == method and s["kind"] == "concurrency"]
        if fixed:
            left.plot([s["level"] for s in fixed], [s["throughput_tok_s"] for s in fixed], **style)
            middle.plot([s["level"] for s in fixed], [s["itl_p50_s"] for s in fixed], **style)
        trees: dict[int, list[float]] = {}
        for s in summary:
            if s["method"] == method:
                for b, size in s["tree_size_by_batch"].items():
                    trees.setdefault(int(b), []).append(size)
        if trees:
            bs = sorted(trees)
            right.plot(bs, [statistics.fmean(trees[b]) for b in bs], **style)
    left.set(xlabel="concurrent clients", ylabel="generated tokens / s", title="throughput")
    middle.set(xlabel="concurrent clients", ylabel="seconds", title="inter-chunk latency p50")
    right.set(xlabel="rows in the step", ylabel="drafted nodes verified per row",
              title="tree size chosen per batch size (mean over levels)")
    for ax in (left, middle, right):
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    for ax in (left, middle):
        ax.set_xticks(levels, [str(v) for v in levels])
    right.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    left.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def save(result: dict, out_dir: Path, name: str, command: str, title: str, meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"meta": {**meta, "command": command}, **result}
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    meta_line = ", ".join(f"{k} {v}" for k, v in meta.items())
    (out_dir / f"{name}.md").write_text(f"# {title}\n\nCommand:\n\n```\n{command}\n```\n\n{meta_line}\n\n"
                                        f"{markdown_table(result['summary'])}\n\n![plot]({name}.png)\n")
    plot(result["summary"], out_dir / f"{name}.png", title)
    if any("ttft_p50_by_turn" in s for s in result["summary"]):
        plot_turns(result["summary"], out_dir / f"{name}-turns.png", title)
        with (out_dir / f"{name}.md").open("a") as f:
            f.write(f"\n![TTFT by turn]({name}-turns.png)\n")


def plot_turns(summary: list[dict], out: Path, title: str) -> None:
    """TTFT p50 per turn of the conversations, one line per method and load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.6))
    for i, s in enumerate(x for x in summary if "ttft_p50_by_turn" in x):
        turns = sorted(int(t) for t in s["ttft_p50_by_turn"])
        ax.plot(turns, [s["ttft_p50_by_turn"][t] if t in s["ttft_p50_by_turn"] else s["ttft_p50_by_turn"][str(t)]
                        for t in turns], marker="o", color=f"C{i % 10}", label=f"{s['method']} c={s['level']}")
    ax.set(xlabel="turn of the conversation", ylabel="time to first token p50 (s)", yscale="log",
           title="TTFT by turn (each turn resends the history)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
