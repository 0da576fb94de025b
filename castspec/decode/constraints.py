"""Structured output: a request's grammar as a mask over the target's vocabulary at every position (llguidance).

Constrained decoding emits, at each position, the target's token under its distribution restricted to what the
grammar allows there (greedy: the argmax of the masked logits; sampling: the warped masked logits, as
`transformers` orders a constraint before its warpers). Speculation keeps that exactly: verification judges each
node under the grammar state of its own path, and the walk down the tree advances one matcher as it accepts
(`decode/verify.py`); drafting checks every proposed child against its parent's state, so no node is spent on a
forbidden token, and a token the grammar forces is drafted with probability 1 (`decode/drafting.py`).

llguidance over xgrammar (measured on Qwen2.5's 151,936-token vocabulary, bench/structured/README.md): xgrammar is
faster per mask (6-8 against 19-20 us median, two runs), but both are small beside a ~200 ms step even at 64 masks
a step, and llguidance is a 7.5 MiB install with no dependencies where xgrammar 0.2.9 pulls triton (~1 GiB)."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from castspec.errors import CastspecError

GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "choice", "lark")
# JSON is written on one line as `json.dumps` writes it: free whitespace lets a model spend tokens on blank lines
# (SmolLM2 ran out of tokens mid-object on them) and forces nothing; a schema's "x-guidance" options override it
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class GrammarError(CastspecError):
    """A grammar castspec cannot serve; `param` names the request field it came from (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Grammar:
    """A constraint as a request states it. `kind`: json_object (any JSON object), json_schema (`source`: the
    schema, a dict or its JSON text), regex (`source`: the pattern), choice (`source`: a list of strings, the
    output is exactly one of them) or lark (`source`: a Lark grammar, llguidance's dialect). `param`: the
    request field it came from, named in errors."""

    kind: str
    source: Any = None
    param: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown constraint kind {self.kind!r}; one of {', '.join(GRAMMAR_KINDS)}", self.param)

    def checked_text(self, tokenizer: llguidance.LLTokenizer | None = None) -> str:
        """`text()`, validated by llguidance (against the tokenizer when given); GrammarError if it cannot be
        served. Without a tokenizer, what can be checked before a model is loaded."""
        text = self.text()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if is_error:
            raise GrammarError(f"the {self.kind} constraint cannot be served: {one_line(messages[0])}", self.param)
        return text

    def text(self) -> str:
        """The grammar in llguidance's format; GrammarError when the source is not of the right shape."""
        kind, source = self.kind, self.source
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if kind == "json_schema":
            if isinstance(source, str):
                try:
                    source = json.loads(source)
                except json.JSONDecodeError as e:
                    raise GrammarError(f"the JSON schema is not valid JSON: {e}", self.param) from None
            if not isinstance(source, dict):
                raise GrammarError("a JSON schema must be a JSON object", self.param)
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_LAYOUT)
            except ValueError as e:
                raise GrammarError(f"invalid JSON schema: {e}", self.param) from None
        if kind == "regex":
            if not isinstance(source, str) or not source:
                raise GrammarError("a regex constraint needs a non-empty pattern string", self.param)
            return llguidance.LLMatcher.grammar_from_regex(source)
        if kind == "choice":
            if not isinstance(source, list) or not source or not all(isinstance(s, str) and s for s in source):
                raise GrammarError("a choice constraint needs a non-empty list of non-empty strings", self.param)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in source))
        if not isinstance(source, str) or not source.strip():
            raise GrammarError("a lark constraint needs the grammar's text", self.param)
        return llguidance.LLMatcher.grammar_from_lark(source)


def one_line(message: str) -> str:
    """llguidance's multi-line diagnostics as one line: without the caret and source-excerpt lines."""
    lines = [line.strip() for line in message.splitlines()]
    kept = [line for line in lines if line and set(line) - {"^", " "} and not re.match(r"^\d+ \|", line)]
    return " ".join(kept)


def tool_call_schema(tools: list[dict], name: str | None = None) -> dict:
    """The JSON schema of a list of one or more calls to `tools` (OpenAI function tools): each call an object
    {"name": <a tool's name>, "arguments": <that tool's parameters>}; with `name`, calls to that tool only."""
    calls = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        calls.append({"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                      "required": ["name", "arguments"], "additionalProperties": False})
    if not calls:
        raise GrammarError(f"tool_choice names the function {name!r}, which is not in tools", "tool_choice")
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": items, "minItems": 1}


class GrammarCompiler:
    """Grammars of one tokenizer: llguidance's view of the vocabulary (built once, ~2 s for 151k tokens) and a
    matcher per constrained request. Thread-safe: the server checks grammars on its request threads."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                      eos_token=sorted(eos_ids) or None)
        self._texts: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def _checked(self, grammar: Grammar) -> str:
        key = (grammar.kind, json.dumps(grammar.source, sort_keys=True))
        with self._lock:
            text = self._texts.get(key)
        if text is None:
            text = grammar.checked_text(self.tokenizer)
            with self._lock:
                self._texts[key] = text
        return text

    def check(self, grammar: Grammar) -> None:
        """Raise GrammarError unless the grammar compiles (before any token is generated)."""
        self._checked(grammar)

    def constraint(self, grammar: Grammar) -> Constraint:
        matcher = llguidance.LLMatcher(self.tokenizer, self._checked(grammar), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {grammar.kind} constraint cannot be served: {one_line(matcher.get_error())}",
                               grammar.param)
        return Constraint(matcher, self.vocab_size)


class Constraint:
    """One request's grammar state: the tokens it has emitted so far, consumed by a matcher. `allowed()` is the
    mask at that state; `at(path)` visits a state further down a draft tree and comes back."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self._words = (vocab_size + 31) // 32
        self._bits = np.zeros(self._words, dtype=np.int32)
        self._allowed: torch.Tensor | None = None  # the mask at the current state, once computed

    def _fill(self) -> np.ndarray:
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return self._bits

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next."""
        if self._allowed is None:
            bits = np.unpackbits(self._fill().view(np.uint8), bitorder="little")[: self.vocab_size]
            self._allowed = torch.from_numpy(bits.astype(bool))
        return self._allowed

    def check_children(self, tokens: list[int]) -> tuple[list[bool], int | None]:
        """At the current state: which of `tokens` the grammar allows, and the one token it forces (the only
        one allowed), if it forces one."""
        bits = self._fill()
        ok = [bool((int(bits[t >> 5]) >> (t & 31)) & 1) if 0 <= t < self.vocab_size else False for t in tokens]
        counts = np.bitwise_count(bits.view(np.uint32))
        forced = None
        if int(counts.sum()) == 1:
            word = int(np.flatnonzero(counts)[0])
            forced = word * 32 + int(bits.view(np.uint32)[word]).bit_length() - 1
        return ok, forced

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [V] with every token the grammar forbids set to -inf."""
        allowed = self.allowed().to(logits.device)
        return logits.masked_fill(~allowed[: logits.shape[-1]], float("-inf"))

    def advance(self, token: int) -> None:
        """Consume an emitted token (one the mask allowed)."""
        if not self.matcher.consume_token(int(token)):
            raise CastspecError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        self._allowed = None

    def enter(self, tokens: list[int]) -> int:
        """Move down a draft path as far as the grammar allows it (a path past the end of the sequence stops
        there); returns how many tokens were taken, which `leave` takes back. Never puts the matcher in its
        error state, which it could not leave."""
        taken = self.matcher.try_consume_tokens(tokens) if tokens else 0
        if taken:
            self._allowed = None
        return taken

    def leave(self, count: int) -> None:
        if count:
            self.matcher.rollback(count)
            self._allowed = None

    @property
    def finished(self) -> bool:
        """Whether the grammar allows nothing more but the end of the sequence."""
        return self.matcher.is_stopped()


def grammar_from_response_format(response_format: Any, param: str = "response_format") -> Grammar | None:
    """OpenAI's `response_format` as a Grammar: {"type": "text"} (None: no constraint), {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}; a Grammar passes
    through."""
    if response_format is None or isinstance(response_format, Grammar):
        return response_format
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise GrammarError("response_format must be an object with a type (text, json_object or json_schema)",
                           param)
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object", None, param)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise GrammarError("response_format json_schema needs {'name': ..., 'schema': {...}}", param)
        # without a schema OpenAI's models may answer any JSON object; so does the grammar then
        schema = spec.get("schema")
        return Grammar("json_schema", schema, param) if schema is not None else Grammar("json_object", None, param)
    raise GrammarError(f"response_format type {kind!r} is not one of text, json_object, json_schema", param)
