"""The structured-output task set (issue 41): extraction and tool calling, made from the project's prompt sources,
and the check that every answer is valid.

Three kinds, each a chat request a server answers under a constraint:
- facts: a GSM8K problem's quantities and question as JSON under a schema (numbers, bounded strings, an array);
- card: a HumanEval function described as JSON (its name, parameters, return type, an enum of difficulty);
- tool: a GSM8K or MT-bench request answered by a call to one of three tools (calculator, web search, Python),
  sent as OpenAI `tools` with `tool_choice="required"`.
Strings are bounded in length so that every answer fits its token budget; the answers' validity is checked with
`jsonschema`, not assumed."""

from __future__ import annotations

import json

import jsonschema

from castspec.bench.prompts import load_prompt_set

FACTS_SCHEMA = {"type": "object", "properties": {
    "quantities": {"type": "array", "maxItems": 6, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "value": {"type": "number"}},
        "required": ["name", "value"], "additionalProperties": False}},
    "asked": {"type": "string", "maxLength": 100},
    "unit": {"type": "string", "maxLength": 20}},
    "required": ["quantities", "asked", "unit"], "additionalProperties": False}
CARD_SCHEMA = {"type": "object", "properties": {
    "function_name": {"type": "string", "maxLength": 40},
    "parameters": {"type": "array", "maxItems": 5, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                         "type": {"type": "string", "maxLength": 30}},
        "required": ["name", "type"], "additionalProperties": False}},
    "returns": {"type": "string", "maxLength": 30},
    "summary": {"type": "string", "maxLength": 160},
    "difficulty": {"enum": ["easy", "medium", "hard"]}},
    "required": ["function_name", "parameters", "returns", "summary", "difficulty"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                      "parameters": {"type": "object", "properties": {
                                          "expression": {"type": "string", "maxLength": 120}},
                                          "required": ["expression"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the web.",
                                      "parameters": {"type": "object", "properties": {
                                          "query": {"type": "string", "maxLength": 100},
                                          "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
                                          "required": ["query", "max_results"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "run_python", "description": "Run a short Python program.",
                                      "parameters": {"type": "object", "properties": {
                                          "code": {"type": "string", "maxLength": 300}},
                                          "required": ["code"], "additionalProperties": False}}},
]


def _user(row: dict) -> str:
    return row["messages"][-1]["content"]


def structured_tasks(per_kind: int = 11) -> list[dict]:
    """`per_kind` tasks of each kind (3 x 11 = 33 by default): {"id", "kind", "messages", and either
    "response_format" or "tools" + "tool_choice"}."""
    gsm8k, humaneval, mtbench = (load_prompt_set(name) for name in ("gsm8k", "humaneval", "mtbench"))
    tasks = []
    for row in gsm8k[:per_kind]:
        tasks.append({"id": f"facts-{row['id']}", "kind": "facts", "messages": [{"role": "user", "content": (
            "Read the problem below and write its given quantities, what it asks for and the unit of the answer "
            f"as JSON. Do not solve it.\n\n{_user(row)}")}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "facts", "schema": FACTS_SCHEMA,
                                                                       "strict": True}}})
    for row in humaneval[:per_kind]:
        tasks.append({"id": f"card-{row['id']}", "kind": "card", "messages": [{"role": "user", "content": (
            f"Describe the Python function below as JSON.\n\n{_user(row)}")}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "card", "schema": CARD_SCHEMA,
                                                                       "strict": True}}})
    sources = [r for pair in zip(gsm8k[per_kind:], mtbench, strict=False) for r in pair][:per_kind]
    for row in sources:
        tasks.append({"id": f"tool-{row['id']}", "kind": "tool", "messages": [{"role": "user", "content": (
            f"Use one of your tools to help with this request.\n\n{_user(row)}")}],
            "tools": TOOLS, "tool_choice": "required"})
    return tasks


def request_body(task: dict, model: str, max_tokens: int, constrained: bool = True) -> dict:
    """The chat request of a task (greedy); unconstrained: the same messages with no grammar (speed only)."""
    body = {"model": model, "messages": task["messages"], "max_tokens": max_tokens, "temperature": 0}
    if constrained:
        body.update({k: task[k] for k in ("response_format", "tools", "tool_choice") if k in task})
    return body


def check_answer(task: dict, message: dict) -> str | None:
    """None when the answer is valid for its task, else why not."""
    try:
        if task["kind"] == "tool":
            calls = message.get("tool_calls") or []
            if not calls:
                return "no tool call"
            schemas = {t["function"]["name"]: t["function"]["parameters"] for t in task["tools"]}
            for call in calls:
                name = call["function"]["name"]
                if name not in schemas:
                    return f"unknown tool {name!r}"
                jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
            return None
        schema = task["response_format"]["json_schema"]["schema"]
        jsonschema.validate(json.loads(message.get("content") or ""), schema)
        return None
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
