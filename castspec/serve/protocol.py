"""OpenAI-compatible request and response bodies (the subset castspec serves), as pydantic models.

A request field castspec does not serve is refused with a 400 naming it (n > 1, echo, logit_bias, a field it does
not know), never ignored: a client that asks for JSON, a tool call or a penalty would otherwise get text it
thinks is constrained. The one field accepted and not acted on is `user` (an end-user id; it changes nothing)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# the engine's stop reasons as OpenAI names them
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "abort": "abort"}
FinishReason = Literal["stop", "length", "abort", "tool_calls"]
# fields a request may carry that change nothing castspec returns
HARMLESS_FIELDS = frozenset({"user"})


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    include_usage: bool = False


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: ToolChoiceFunction


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept to be refused by name (`unsupported`), not ignored

    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extension: 0 (or -1) means no cut
    seed: int | None = None
    # castspec's extension: read earlier requests' outputs from the server's shared suffix tree and add this
    # one's (a server started with --drafter suffix --suffix-shared-tokens N)
    share_history: bool | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None  # chat: true / false; completions: how many top tokens (0 = the chosen token's only)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # structured output: OpenAI's response_format, or vLLM's structured_outputs (json, regex, choice, grammar,
    # json_object); the answer is what the target decodes under that grammar's mask
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    return_token_ids: bool | None = None  # vLLM's; castspec always returns them

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, reason) for the first feature asked for that castspec does not serve."""
        unknown = sorted(set(self.model_extra or {}) - HARMLESS_FIELDS)
        if unknown:
            return unknown[0], f"castspec does not serve the field {unknown[0]!r}"
        if self.n != 1:
            return "n", "only n = 1 is supported"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty", "presence and frequency penalties are not supported (they are not lossless " \
                                       "with respect to the target's distribution)"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options needs stream: true"
        return None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    max_tokens: int | None = 16  # OpenAI's default for completions


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCall):
    index: int


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer: which call it answers
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates read it: tool calls' arguments as objects, not JSON text."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpeculativeMetrics(BaseModel):
    """Per response: tokens per target forward (the prefill's counted as one step), and how much of what was
    drafted the target accepted."""

    mean_accepted_length: float
    acceptance_rate: float | None  # accepted drafted tokens / verified drafted tokens; None when nothing drafted
    steps: int
    draft_tokens: int
    accepted_tokens: int


class ResponseMetrics(BaseModel):
    speculative_decoding: SpeculativeMetrics


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReason | None
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] | None = None  # castspec / vLLM extension


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    metrics: ResponseMetrics | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    metrics: ResponseMetrics | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    metrics: ResponseMetrics | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "castspec"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
