"""The conversation benchmark: sessions of several turns where every turn resends the whole history (the
server's own earlier answers included) plus a new instruction, as chat clients and agent loops do.

Four kinds of session, made from the project's prompt sets: a code edit loop (a HumanEval function, then
changes, tests, an explanation), document revision (an MT-bench question and its own second turn, then
rewrites), multi-step math (a GSM8K problem, then a check and a variant) and an agent-style loop whose "tool
output" repeats the assistant's last answer back to it. The answers are whatever the server answers (greedy, so
every lossless server builds the same histories), so nothing here depends on a stored transcript."""

from __future__ import annotations

import asyncio
import time

import httpx

from castspec.bench.prompts import load_prompt_set, mtbench_second_turns
from castspec.errors import CastspecError

KINDS = ("code-edit", "revision", "math", "agent")
LAST_ANSWER = "{last_answer}"  # in an instruction: replaced by the assistant's previous answer

FOLLOW_UPS = {
    "code-edit": ["Now add type hints and a docstring, and return the whole function again.",
                  "Add pytest tests for it; show the function and the tests together.",
                  "Explain briefly how the code works."],
    "revision": [None,  # MT-bench's own second turn
                 "Revise your last answer to be more concise, keeping every point.",
                 "Give it a title and return the final version in full."],
    "math": ["Check your answer step by step and correct it if needed.",
             "Now solve the same problem with every number doubled.",
             "Summarise both solutions in two sentences."],
    "agent": [f"Tool output (read_file solution.py):\n```\n{LAST_ANSWER}\n```\nThe tests fail on empty input. "
              "Fix it and return the whole file.",
              f"Tool output (read_file solution.py):\n```\n{LAST_ANSWER}\n```\nAdd input validation with a clear "
              "error message and return the whole file.",
              f"Tool output (run_tests):\n```\n{LAST_ANSWER}\n```\n3 passed. Write the commit message."],
}


def conversation_sessions(count: int, turns: int = 4) -> list[dict]:
    """`count` sessions of `turns` user turns each (the kinds in turn), as [{'id', 'kind', 'turns'}]."""
    if count < 1 or not 1 <= turns <= 1 + len(FOLLOW_UPS["math"]):
        raise CastspecError(f"conversations need >= 1 session and 1..{1 + len(FOLLOW_UPS['math'])} turns, got "
                            f"{count} and {turns}")
    humaneval, mtbench, gsm8k = (load_prompt_set(n) for n in ("humaneval", "mtbench", "gsm8k"))
    mt_second = mtbench_second_turns()
    sessions = []
    for i in range(count):
        kind, k = KINDS[i % len(KINDS)], i // len(KINDS)
        if kind == "code-edit":
            first = humaneval[k]
        elif kind == "revision":
            first = mtbench[k]
        elif kind == "math":
            first = gsm8k[k]
        else:
            first = humaneval[len(humaneval) - 1 - k]
        follow = [mt_second.get(first["id"]) if text is None else text for text in FOLLOW_UPS[kind]]
        follow = [text or "Continue, in more detail." for text in follow]
        sessions.append({"id": f"{kind}-{k}", "kind": kind,
                         "turns": [first["messages"][-1]["content"], *follow][:turns]})
    return sessions


async def run_session(client: httpx.AsyncClient, model: str, session: dict, max_tokens: int, stream) -> list:
    """The session's turns in order, each sending the whole history; `stream(client, model, prompt, max_tokens)`
    sends one turn and returns its record (with the answer's text). Returns the records, `turn` set on each."""
    history: list[dict] = []
    records = []
    last_answer = ""
    for turn, instruction in enumerate(session["turns"]):
        history.append({"role": "user", "content": instruction.replace(LAST_ANSWER, last_answer)})
        prompt = {"id": f"{session['id']}-t{turn + 1}", "messages": list(history)}
        record = await stream(client, model, prompt, max_tokens)
        record.turn = turn + 1
        records.append(record)
        if record.error is not None:
            break  # the rest of the session would build on a missing answer
        last_answer = record.text
        history.append({"role": "assistant", "content": record.text})
    return records


async def sessions_at_concurrency(base: str, model: str, sessions: list[dict], concurrency: int, max_tokens: int,
                                  timeout_s: float, stream) -> list:
    """`concurrency` clients, each running its next whole session as soon as its last one ended."""
    queue = list(sessions)
    records: list = []
    async with httpx.AsyncClient(base_url=base, timeout=timeout_s) as client:
        async def worker():
            while queue:
                records.extend(await run_session(client, model, queue.pop(0), max_tokens, stream))

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), timeout_s)
    return records


def reset_prefix_cache(base: str) -> bool:
    """Empty the server's prefix cache (vLLM's endpoint of the same name); False where it keeps none."""
    response = httpx.post(f"{base}/reset_prefix_cache", timeout=60)
    return response.status_code == 200


def turn_latencies(records: list) -> dict:
    """TTFT of first turns and of later turns (p50, p99), the figure a prefix cache changes."""
    from castspec.bench.serving import _pct

    ok = [r for r in records if r.error is None and r.first_token is not None]
    first = [r.first_token - r.sent for r in ok if r.turn == 1]
    later = [r.first_token - r.sent for r in ok if r.turn >= 2]
    by_turn = {}
    for turn in sorted({r.turn for r in ok}):
        values = [r.first_token - r.sent for r in ok if r.turn == turn]
        by_turn[turn] = round(_pct(values, 50), 4)
    return {"ttft_turn1_p50_s": _pct(first, 50), "ttft_later_p50_s": _pct(later, 50),
            "ttft_later_p99_s": _pct(later, 99), "ttft_p50_by_turn": by_turn, "turns": len(ok),
            "measured_at": time.time()}
