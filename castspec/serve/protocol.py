"""OpenAI-compatible request and response bodies (the subset castspec serves), as pydantic models.

Requests reject unknown sampling features instead of ignoring them (n > 1, logprobs, echo, ...): a client that
asks for them would otherwise get something it did not ask for."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# the engine's stop reasons as OpenAI names them
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "abort": "abort"}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields we ignore (user, metadata, ...)

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
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, reason) for the first feature asked for that castspec does not serve."""
        if self.n != 1:
            return "n", "only n = 1 is supported"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs are not supported"
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: keep the text ones
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


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
    finish_reason: Literal["stop", "length", "abort"] | None
    logprobs: None = None
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
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "abort"] | None
    logprobs: None = None
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


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length", "abort"] | None = None
    logprobs: None = None
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
