"""The OpenAI-compatible HTTP server: completions and chat completions (streamed as server-sent events or not),
models, health and Prometheus metrics, over one engine loop.

Errors follow OpenAI: a body {"error": {"message", "type", "param", "code"}} with the HTTP status = code (400 for
bad parameters, validation errors included; 404 for an unknown model; 429 when the waiting queue is full; 500
otherwise). A client that disconnects aborts its request at the next step boundary."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from castspec.api import encode_text
from castspec.decode.constraints import Grammar, GrammarError
from castspec.decode.engine import RequestError, RequestOutput, RequestParams
from castspec.errors import CastspecError
from castspec.serve import protocol as P
from castspec.serve.loop import EngineLoop
from castspec.serve.tools import ToolMode, forced_calls, request_grammar, streamable_prefix, tagged_calls

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
               500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    body = P.ErrorResponse(error=P.ErrorInfo(message=message, type=ERROR_TYPES.get(status, "error"), param=param,
                                             code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class Server:
    """Everything one served model needs: the loop, the tokenizer, the name clients ask for."""

    def __init__(self, loop: EngineLoop, tokenizer, model_name: str, max_model_len: int | None,
                 max_waiting: int | None, poll_s: float = 0.25) -> None:
        self.loop, self.tokenizer, self.model_name = loop, tokenizer, model_name
        self.max_model_len, self.max_waiting, self.poll_s = max_model_len, max_waiting, poll_s

    # -- request -> engine ----------------------------------------------------------------------------------------
    def _check_common(self, body: P._SamplingRequest) -> None:
        if body.model != self.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           "model")
        problem = body.unsupported()
        if problem is not None:
            raise APIError(400, problem[1], problem[0])

    @staticmethod
    def _top_logprobs(body: P._SamplingRequest) -> int | None:
        """How many top tokens to report with each token's logprob (None: no logprobs): chat's logprobs +
        top_logprobs, completions' logprobs (an integer)."""
        if isinstance(body, P.ChatCompletionRequest):
            if body.logprobs not in (None, True, False):
                raise APIError(400, "logprobs must be true or false (top_logprobs says how many)", "logprobs")
            if body.top_logprobs is not None and not body.logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            return (body.top_logprobs or 0) if body.logprobs else None
        if body.logprobs is None:
            return None
        if isinstance(body.logprobs, bool) or not isinstance(body.logprobs, int):
            raise APIError(400, "logprobs must be an integer (how many top tokens to report)", "logprobs")
        return body.logprobs

    def logprobs_body(self, items: list, chat: bool, text_offset: int = 0) -> dict | None:
        """OpenAI's logprobs object for these tokens: chat's {"content": [...]}, completions' parallel lists."""
        if not items:
            return None
        piece = self.tokenizer.decode
        if chat:
            def entry(token: int, logprob: float) -> dict:
                text = piece([token])
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            return {"content": [{**entry(i.token, i.logprob), "top_logprobs": [entry(t, lp) for t, lp in i.top]}
                                for i in items]}
        tokens = [piece([i.token]) for i in items]
        offsets = [text_offset + sum(len(t) for t in tokens[:j]) for j in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [i.logprob for i in items],
                "top_logprobs": [{piece([t]): lp for t, lp in i.top} for i in items], "text_offset": offsets}

    def _params(self, body: P._SamplingRequest, max_tokens: int | None, prompt_ids: list[int],
                grammar: Grammar | None = None) -> RequestParams:
        if max_tokens is None:  # as vLLM: whatever the context leaves
            max_tokens = (self.max_model_len - len(prompt_ids)) if self.max_model_len else 256
        top_k = 0 if body.top_k == -1 else body.top_k
        try:
            return RequestParams(max_tokens=max_tokens, stop=body.stop_strings(), temperature=body.temperature,
                                 top_p=body.top_p, top_k=top_k, seed=body.seed, share_history=body.share_history,
                                 grammar=grammar, logprobs=self._top_logprobs(body))
        except RequestError as e:
            raise APIError(400, str(e), e.param) from None

    def _completion_prompt(self, body: P.CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request is supported", "prompt")
            prompt = prompt[0]
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        if isinstance(prompt, str):
            try:
                return encode_text(self.tokenizer, prompt=prompt)
            except CastspecError as e:
                raise APIError(400, str(e), "prompt") from None
        if not prompt:
            raise APIError(400, "the prompt is empty", "prompt")
        return list(prompt)

    def _chat_prompt(self, body: P.ChatCompletionRequest) -> list[int]:
        messages = [m.for_template() for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        try:
            return encode_text(self.tokenizer, messages=messages, tools=tools)
        except CastspecError as e:
            raise APIError(400, str(e), "messages") from None

    def _start(self, prompt_ids: list[int], params: RequestParams, request_id: str) -> asyncio.Queue:
        engine = self.loop.engine
        if not self.loop.alive:
            raise APIError(503, f"the engine loop has stopped: {self.loop.error!r}")
        try:
            engine.check_request(prompt_ids, params)
        except RequestError as e:
            raise APIError(400, str(e), e.param) from None
        if self.max_waiting is not None and self.loop.queued() >= self.max_waiting:
            raise APIError(429, f"the server is busy: {self.loop.queued()} requests are already waiting "
                                f"(--max-waiting {self.max_waiting}); try again later")
        inbox: asyncio.Queue = asyncio.Queue()
        event_loop = asyncio.get_running_loop()
        self.loop.submit(request_id, prompt_ids, params,
                         lambda item: event_loop.call_soon_threadsafe(inbox.put_nowait, item))
        return inbox

    # -- engine -> response ---------------------------------------------------------------------------------------
    @staticmethod
    def _raise_for(item: RequestOutput | BaseException) -> RequestOutput:
        if isinstance(item, RequestError):
            status = 429 if item.param == "queue" else 400
            raise APIError(status, str(item), item.param)
        if isinstance(item, BaseException):
            raise APIError(500, f"the engine failed: {item!r}")
        return item

    async def _outputs(self, inbox: asyncio.Queue, request_id: str, request: Request
                       ) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; aborts it if the client goes away or the handler is
        cancelled first."""
        finished = False
        try:
            while not finished:
                try:
                    item = await asyncio.wait_for(inbox.get(), self.poll_s)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                out = self._raise_for(item)
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.loop.abort(request_id)

    @staticmethod
    def usage(prompt_ids: list[int], out: RequestOutput) -> P.Usage:
        return P.Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(out.output_ids),
                       total_tokens=len(prompt_ids) + len(out.output_ids))

    @staticmethod
    def spec_metrics(out: RequestOutput) -> P.ResponseMetrics:
        steps = out.steps
        drafted = sum(s.tree_size for s in steps)
        accepted = sum(s.accepted - 1 for s in steps if s.tree_size > 0)
        mean = (len(out.output_ids) - 1) / len(steps) if steps else float(len(out.output_ids))
        return P.ResponseMetrics(speculative_decoding=P.SpeculativeMetrics(
            mean_accepted_length=round(mean, 4), acceptance_rate=round(accepted / drafted, 4) if drafted else None,
            steps=len(steps), draft_tokens=drafted, accepted_tokens=accepted))

    @staticmethod
    def _grammar(body: P._SamplingRequest) -> tuple[Grammar | None, ToolMode]:
        try:
            return request_grammar(body)
        except GrammarError as e:
            raise APIError(400, str(e), e.param) from None

    async def completion(self, body: P.CompletionRequest, request: Request):
        self._check_common(body)
        grammar, _ = self._grammar(body)
        prompt_ids = self._completion_prompt(body)
        return await self._respond(body, request, prompt_ids, body.max_tokens, chat=False, grammar=grammar)

    async def chat(self, body: P.ChatCompletionRequest, request: Request):
        self._check_common(body)
        grammar, mode = self._grammar(body)
        prompt_ids = self._chat_prompt(body)
        return await self._respond(body, request, prompt_ids, body.max_completion_tokens or body.max_tokens,
                                   chat=True, grammar=grammar, mode=mode,
                                   tool_names={t.function.name for t in body.tools or []})

    async def _respond(self, body: P._SamplingRequest, request: Request, prompt_ids: list[int],
                       max_tokens: int | None, chat: bool, grammar: Grammar | None = None,
                       mode: ToolMode | None = None, tool_names: set[str] | None = None):
        mode = mode or ToolMode()
        params = self._params(body, max_tokens, prompt_ids, grammar)
        request_id = P.new_id("chatcmpl" if chat else "cmpl")
        inbox = self._start(prompt_ids, params, request_id)
        outputs = self._outputs(inbox, request_id, request)
        head = {"id": request_id, "created": P.now(), "model": self.model_name}

        def totals(out: RequestOutput | None) -> dict:
            return {"usage": self.usage(prompt_ids, out) if out is not None else None,
                    "metrics": self.spec_metrics(out) if out is not None else None}

        def message(out: RequestOutput) -> tuple[P.AssistantMessage, str]:
            """The finished answer as a message: text, or tool calls (then finish_reason tool_calls)."""
            reason = P.FINISH_REASONS[out.finish_reason]
            content, calls = out.full_text, []
            if mode.forced and reason == "stop":
                calls = forced_calls(out.full_text, request_id) or []
                content = None if calls else content
            elif mode.auto:
                content, calls = tagged_calls(out.full_text, request_id, tool_names or set())
            return P.AssistantMessage(content=content, tool_calls=calls), "tool_calls" if calls else reason

        if not body.stream:
            every: list = []
            out = await self._final(outputs, every)
            reason = P.FINISH_REASONS[out.finish_reason]
            logprobs = self.logprobs_body(every, chat)
            if chat:
                answer, reason = message(out)
                choice = P.ChatChoice(message=answer, token_ids=out.output_ids, finish_reason=reason,
                                      logprobs=logprobs)
                return P.ChatCompletionResponse(**head, choices=[choice], **totals(out)).model_dump()
            choice = P.CompletionChoice(text=out.full_text, token_ids=out.output_ids, finish_reason=reason,
                                        logprobs=logprobs)
            return P.CompletionResponse(**head, choices=[choice], **totals(out)).model_dump()

        def chunk(text: str | None = "", ids: list[int] | None = None, reason: str | None = None,
                  role: str | None = None, usage_of: RequestOutput | None = None,
                  calls: list[P.ToolCall] | None = None, logprobs: list | None = None, offset: int = 0) -> str:
            if chat:
                delta = P.Delta(role=role, content=text, tool_calls=[
                    P.DeltaToolCall(index=i, **call.model_dump()) for i, call in enumerate(calls)] if calls else None)
                choices = [] if usage_of else [P.ChatChunkChoice(delta=delta, token_ids=ids, finish_reason=reason,
                                                                 logprobs=self.logprobs_body(logprobs or [], True))]
                return _sse(P.ChatCompletionChunk(**head, choices=choices, **totals(usage_of)).model_dump_json())
            choices = [] if usage_of else [P.CompletionChoice(text=text, token_ids=ids, finish_reason=reason,
                                                              logprobs=self.logprobs_body(logprobs or [], False,
                                                                                          offset))]
            return _sse(P.CompletionResponse(**head, choices=choices, **totals(usage_of)).model_dump_json())

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            # the role comes with the first token, as vLLM sends it: a role-only chunk before the prefill made
            # clients time the first token at a few milliseconds (issue 38)
            # tool calls: a forced answer is sent whole at the end (as tool_calls), an auto one as text until a
            # call's opening tag, then its calls at the end
            role = "assistant" if chat else None
            last, sent, held, held_logprobs = None, "", [], []
            async for out in self._guarded(outputs):
                if isinstance(out, str):  # an error event: the stream ends with it
                    yield out
                    return
                last = out
                reason = P.FINISH_REASONS[out.finish_reason] if out.finished else None
                if mode.forced or mode.auto:
                    held += out.new_token_ids
                    held_logprobs += out.new_logprobs
                    text = "" if mode.forced else streamable_prefix(out.full_text)[len(sent):]
                    if reason:
                        answer, reason = message(out)
                        rest = (answer.content or "")[len(sent):] if not answer.tool_calls else text
                        yield chunk(rest or None, held, reason, role, calls=answer.tool_calls, logprobs=held_logprobs)
                    elif text:
                        yield chunk(text, held, None, role, logprobs=held_logprobs)
                        sent, held, held_logprobs, role = sent + text, [], [], None
                elif out.new_token_ids or out.text or reason:
                    yield chunk(out.text, out.new_token_ids, reason, role, logprobs=out.new_logprobs,
                                offset=len(out.full_text) - len(out.text))
                    role = None
            if include_usage and last is not None:
                yield chunk(usage_of=last)
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    @staticmethod
    async def _final(outputs: AsyncIterator[RequestOutput], logprobs: list) -> RequestOutput:
        """The finished output; every token's logprobs (if asked for) gathered into `logprobs`."""
        last = None
        async for out in outputs:
            last = out
            logprobs += out.new_logprobs
        if last is None or not last.finished:
            raise APIError(500, "the request ended without a result")
        return last

    @staticmethod
    async def _guarded(outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput | str]:
        """A stream cannot change its status once started: an error becomes an error event, then [DONE]."""
        try:
            async for out in outputs:
                yield out
        except APIError as e:
            body = P.ErrorResponse(error=P.ErrorInfo(message=e.message, type=ERROR_TYPES.get(e.status, "error"),
                                                     param=e.param, code=e.status))
            yield _sse(body.model_dump_json()) + _sse("[DONE]")


def refreshed_registry(server: Server) -> CollectorRegistry:
    """This server's metrics, the gauges that describe the batch as it is now refreshed first."""
    m = server.loop.metrics
    m.observe_engine(server.loop.engine)
    m.waiting.set(server.loop.queued())
    return m.registry


def build_app(server: Server, metrics: Callable[[], Awaitable[bytes]] | None = None) -> FastAPI:
    """The HTTP app over `server`; `metrics` replaces what /metrics returns (a Ray replica returns every
    replica's)."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        try:
            yield
        finally:
            server.loop.stop()

    app = FastAPI(title="castspec", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        location = [x for x in first.get("loc", ()) if isinstance(x, str) and x != "body"]
        param = location[0] if location else None
        where = ".".join(location)
        return error_response(400, f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(500, f"internal error: {exc!r}")

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        return await server.completion(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        return await server.chat(body, request)

    @app.get("/v1/models")
    async def models():
        return P.ModelList(data=[P.ModelCard(id=server.model_name, created=P.now(),
                                             max_model_len=server.max_model_len)]).model_dump()

    @app.get("/health")
    async def health():
        if not server.loop.alive:
            return error_response(503, f"the engine loop has stopped: {server.loop.error!r}")
        return {"status": "ok"}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        # vLLM's endpoint of the same name: benchmarks start each run from a cold cache
        if server.loop.engine.prefix_cache is None:
            return error_response(400, "this server keeps no prefix cache (--prefix-cache-gb 0)")
        await asyncio.to_thread(server.loop.reset_prefix_cache)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        text = await metrics() if metrics is not None else generate_latest(refreshed_registry(server))
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app
