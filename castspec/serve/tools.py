"""Tool calls and structured output on the OpenAI surface: which grammar a request asks for, and how an answer
becomes `tool_calls`.

`tool_choice` "required" or a named function: the answer is decoded under a grammar whose only sentences are a
JSON list of calls ({"name": ..., "arguments": {...}}, the tools' own parameter schemas), so every call names a
real tool with valid arguments. "auto" (the default with tools): the model decides; a call it writes in its chat
template's own form (`<tool_call>{...}</tool_call>`, the Hermes / Qwen form) becomes a tool call. "none": text."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from castspec.decode.constraints import Grammar, GrammarError, grammar_from_response_format, tool_call_schema
from castspec.serve import protocol as P

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TAGGED_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
# vLLM's structured_outputs keys -> castspec grammar kinds
STRUCTURED_OUTPUT_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark",
                           "json_object": "json_object"}


@dataclass(frozen=True)
class ToolMode:
    """How a chat request's answer is read: `forced` (required / named: the whole answer is a list of calls),
    `auto` (calls in the template's tags, text otherwise) or neither (text)."""

    forced: bool = False
    auto: bool = False


def request_grammar(body: P._SamplingRequest) -> tuple[Grammar | None, ToolMode]:
    """The grammar a request asks for (response_format, structured_outputs or forced tool calls; one at most)
    and how to read its answer. GrammarError (a 400 naming the field) for a request that cannot be served."""
    asked = [name for name in ("response_format", "structured_outputs") if getattr(body, name) is not None]
    grammar, mode = None, ToolMode()
    if body.response_format is not None:
        grammar = grammar_from_response_format(body.response_format)
    if body.structured_outputs is not None:
        grammar = structured_outputs_grammar(body.structured_outputs)
    tools = getattr(body, "tools", None)
    choice = getattr(body, "tool_choice", None)
    if choice is not None and not tools and choice != "none":
        raise GrammarError("tool_choice needs tools", "tool_choice")
    if tools:
        choice = choice or "auto"
        if isinstance(choice, P.NamedToolChoice) or choice == "required":
            asked.append("tool_choice")
            name = choice.function.name if isinstance(choice, P.NamedToolChoice) else None
            schema = tool_call_schema([t.model_dump() for t in tools], name)
            if not body.parallel_tool_calls:
                schema["maxItems"] = 1
            grammar, mode = Grammar("json_schema", schema, "tools"), ToolMode(forced=True)
        elif choice == "auto" and grammar is None:
            mode = ToolMode(auto=True)
    if len(asked) > 1:
        raise GrammarError(f"give one constraint at most; this request asks for {' and '.join(asked)}", asked[1])
    return grammar, mode


def structured_outputs_grammar(spec: dict) -> Grammar:
    """vLLM's `structured_outputs`: exactly one of json (a schema), regex, choice, grammar (Lark), json_object."""
    given = [key for key in spec if spec[key] is not None and spec[key] is not False]
    unknown = [key for key in given if key not in STRUCTURED_OUTPUT_KINDS]
    if unknown:
        raise GrammarError(f"structured_outputs has no option {unknown[0]!r} castspec serves (it serves "
                           f"{', '.join(STRUCTURED_OUTPUT_KINDS)})", "structured_outputs")
    if len(given) != 1:
        raise GrammarError("structured_outputs needs exactly one of " + ", ".join(STRUCTURED_OUTPUT_KINDS),
                           "structured_outputs")
    key = given[0]
    return Grammar(STRUCTURED_OUTPUT_KINDS[key], None if key == "json_object" else spec[key], "structured_outputs")


def _call(name: str, arguments, number: int, request_id: str) -> P.ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return P.ToolCall(id=f"call-{request_id[-12:]}-{number}", function=P.FunctionCall(name=name, arguments=text))


def forced_calls(text: str, request_id: str) -> list[P.ToolCall] | None:
    """The calls of a forced answer (a JSON list of {"name", "arguments"}); None when it is cut short."""
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [_call(c["name"], c["arguments"], i, request_id) for i, c in enumerate(calls)]


def tagged_calls(text: str, request_id: str, tool_names: set[str]) -> tuple[str | None, list[P.ToolCall]]:
    """An auto answer: the calls written in `<tool_call>` tags (those that parse and name a tool), and the text
    around them (None when nothing is left)."""
    calls = []
    for match in _TAGGED_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and call.get("name") in tool_names:
            calls.append(_call(call["name"], call.get("arguments", {}), len(calls), request_id))
    if not calls:
        return text, []
    rest = _TAGGED_CALL.sub("", text).strip()
    return rest or None, calls


def streamable_prefix(text: str) -> str:
    """In auto mode, how much of the answer so far can be streamed as text: everything before a tool call's
    opening tag, or before a tail that could still become one."""
    at = text.find(TOOL_CALL_OPEN)
    if at >= 0:
        return text[:at]
    for keep in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-keep:]):
            return text[:-keep]
    return text
