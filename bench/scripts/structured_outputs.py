"""Structured output beside vLLM for CPU, one client, one sitting (issue 41).

The task set of `castspec.bench.structured` (GSM8K facts and HumanEval cards under JSON schemas, tool calls with
`tool_choice="required"`) is sent to one server at a time, as chat requests (greedy, non-streamed) `c` at a
time: castspec constrained AR, constrained CAST (the default server: CAST over the n-gram drafter) and the same
CAST unconstrained (same messages, no grammar: what the constraint costs or buys); vLLM 0.32 for CPU with its
structured outputs (xgrammar, compact JSON), without and with its n-gram speculation. Every answer is checked
with `jsonschema` (tool calls: the name is a tool's, the arguments valid under its parameters). Servers start
from an empty $CASTSPEC_HOME each (weights linked in); vLLM lives in its own venv (`peer_vllm.py`).

Run: .venv/bin/python bench/scripts/structured_outputs.py bench/structured/NAME [--concurrency 1,4]
     [--per-kind 11] [--c1-per-kind 4] [--max-tokens 192] [--servers ...] (writes NAME.json, NAME.md, NAME.png)"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from peer_vllm import (  # noqa: E402
    SERVED,
    bar_plot,
    finish,
    fresh_home,
    install_vllm,
    keep_server,
    new_result,
    peer_parser,
    running,
    server_command,
)

from castspec.bench.serving import free_port  # noqa: E402
from castspec.bench.structured import check_answer, request_body, structured_tasks  # noqa: E402
from castspec.models import resolve  # noqa: E402

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
CASTSPEC = {"castspec-ar": ["--method", "ar"], "castspec-cast": [], "castspec-cast-unconstrained": []}
# tool_choice "required" needs a tool-call parser in vLLM; compact JSON (no free whitespace) as castspec writes it,
# so that both servers write answers of about the same length
VLLM_COMMON = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--structured-outputs-config",
               json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
VLLM_ARGS = {"vllm": VLLM_COMMON, "vllm-ngram": [*VLLM_COMMON, "--speculative-config", NGRAM]}
SERVERS = "castspec-ar,castspec-cast,castspec-cast-unconstrained,vllm,vllm-ngram"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def run_level(base: str, tasks: list[dict], concurrency: int, max_tokens: int, constrained: bool) -> dict:
    """Every task once, `concurrency` in flight; per task its latency, tokens and validity."""
    queue: asyncio.Queue = asyncio.Queue()
    for task in tasks:
        queue.put_nowait(task)
    records = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            task = queue.get_nowait()
            start = time.perf_counter()
            response = await client.post("/v1/chat/completions",
                                         json=request_body(task, SERVED, max_tokens, constrained))
            seconds = time.perf_counter() - start
            body = response.json()
            if response.status_code != 200:
                records.append({"id": task["id"], "kind": task["kind"], "seconds": seconds, "tokens": 0,
                                "error": f"HTTP {response.status_code}: {json.dumps(body)[:200]}"})
                continue
            choice = body["choices"][0]
            problem = check_answer(task, choice["message"]) if constrained else None
            records.append({"id": task["id"], "kind": task["kind"], "seconds": round(seconds, 3),
                            "tokens": body["usage"]["completion_tokens"], "finish_reason": choice["finish_reason"],
                            "valid": problem is None, "problem": problem,
                            "answer": choice["message"].get("content") or [
                                c["function"] for c in choice["message"].get("tool_calls") or []]})

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=base, timeout=900) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in records)
    return {"wall_s": round(wall, 2), "tokens": tokens, "tok_s": round(tokens / wall, 3),
            "mean_latency_s": round(sum(r["seconds"] for r in records) / len(records), 3),
            "valid": sum(1 for r in records if r.get("valid")) if constrained else None,
            "errors": sum(1 for r in records if "error" in r), "requests": len(records), "records": records}


def main() -> None:
    parser = peer_parser(__doc__, SERVERS)
    parser.add_argument("--per-kind", type=int, default=11, help="tasks of each kind at concurrency > 1")
    parser.add_argument("--c1-per-kind", type=int, default=4, help="tasks of each kind at concurrency 1")
    parser.add_argument("--max-tokens", type=int, default=192)
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    vllm = install_vllm(Path(args.venv)) if "vllm" in args.servers else Path("vllm")
    model_dir = str(resolve(SERVED))
    tasks = structured_tasks(args.per_kind)
    few = [t for kind in ("facts", "card", "tool") for t in [t for t in tasks if t["kind"] == kind][:args.c1_per_kind]]
    levels = [int(c) for c in args.concurrency.split(",")]
    result = new_result(tasks=[t["id"] for t in tasks], c1_tasks=[t["id"] for t in few], max_tokens=args.max_tokens)
    for name in args.servers.split(","):
        home = fresh_home()
        command, env = server_command(name, vllm, model_dir, free_port(), home, CASTSPEC, VLLM_ARGS)
        log(f"{name}: starting ...")
        with running(command, env, out.parent / f"{out.name}-{name}.log") as (base, startup_s):
            # one short request first: both servers build their grammar machinery at the first constrained one
            asyncio.run(run_level(base, tasks[:1], 1, 8, True))
            levels_out = {}
            for c in levels:
                chosen = few if c == 1 else tasks
                levels_out[str(c)] = level = asyncio.run(run_level(base, chosen, c, args.max_tokens,
                                                                   not name.endswith("unconstrained")))
                log(f"  {name} c={c}: {level['tok_s']:.2f} tok/s, valid {level['valid']}/{level['requests']}, "
                    f"errors {level['errors']}")
        keep_server(result, out, name, startup_s, levels_out)
    finish(out, report(result, levels), lambda path: plot(result, levels, path))


def report(result: dict, levels: list[int]) -> str:
    meta, servers = result["meta"], result["servers"]
    lines = [f"# Structured output: castspec beside vLLM for CPU, {meta['model']} bf16, {meta['machine']}", "",
             f"`{meta['command']}` ({meta['date']}); chat requests, greedy, at most {meta['max_tokens']} tokens; "
             f"c=1 runs {len(meta['c1_tasks'])} tasks, other levels all {len(meta['tasks'])}; one server at a time, "
             "each warmed by one 8-token request first.",
             "", "| server | " + " | ".join(f"set wall s c={c} | tok/s c={c} | tokens/answer c={c} | valid c={c}"
                                          for c in levels)
             + " | " + " | ".join(f"mean latency s c={c}" for c in levels) + " |",
             "|---|" + "---|---|---|---|" * len(levels) + "---|" * len(levels)]
    for name, s in servers.items():
        cells = []
        for c in levels:
            level = s["levels"][str(c)]
            valid = "-" if level["valid"] is None else f"{level['valid']}/{level['requests']}"
            cells += [f"{level['wall_s']:.1f}", f"{level['tok_s']:.2f}", f"{level['tokens'] / level['requests']:.0f}",
                      valid]
        cells += [f"{s['levels'][str(c)]['mean_latency_s']:.2f}" for c in levels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "Speed-ups by the time to answer the whole set (same answers asked of every server; the "
              "unconstrained run answers other, longer or shorter, texts), then by output tokens per second:"]
    for c in levels:
        wall = {name: s["levels"][str(c)]["wall_s"] for name, s in servers.items()}
        tps = {name: s["levels"][str(c)]["tok_s"] for name, s in servers.items()}
        pairs = [("castspec-cast", "castspec-ar"), ("castspec-cast", "castspec-cast-unconstrained"),
                 ("castspec-cast", "vllm"), ("castspec-cast", "vllm-ngram"), ("castspec-ar", "vllm")]
        lines.append(f"- c={c}: " + ", ".join(f"{a} vs {b}: {wall[b] / wall[a]:.2f}x by time, "
                                             f"{tps[a] / tps[b]:.2f}x by tok/s" for a, b in pairs
                                             if a in wall and b in wall and wall[a] and tps[b]))
    return "\n".join(lines)


def plot(result: dict, levels: list[int], path: Path) -> None:
    bar_plot(result, levels, path, lambda level: level["tok_s"], "output tokens / s (structured tasks)")


if __name__ == "__main__":
    main()
