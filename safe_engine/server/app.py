"""The FastAPI app: OpenAI's /v1/chat/completions, /v1/completions, /v1/models, and /health.

`create_app(ensemble_or_loader, ...)` takes a loaded `Ensemble`, or a callable that loads one (run in a
thread at startup, so /health answers 503 while the members load). Request bodies are read and
validated here rather than by FastAPI, so that every refusal is OpenAI's error shape with the right
status (400 instead of FastAPI's 422, 413 for oversized bodies) and names the offending field.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import GenerationConfig
from ..engine.ensemble import AsyncTextStream, Ensemble
from ..errors import ConfigError, GenerationTimeout, InputError, InputTypeError, MemberError, SafeEngineError
from ..shaping.reply import StreamEvent
from ..shaping.request import Request as EngineRequest
from ..shaping.request import build_request
from ..stats import GenerationResult, chat_logprobs, completion_logprobs
from . import openai_shapes as shapes
from .schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    Message,
    NamedToolChoice,
    RequestError,
    parse_request,
)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
_IDLE_WAIT_S = 30.0  # at shutdown, how long the last round (already cancelled) may take to end


@dataclass
class ServerState:
    """What the routes share: the ensemble (None while loading), settings, shutdown deadline."""

    model_name: str | None
    api_key: str | None
    defaults: GenerationConfig
    max_batch_size: int | None
    max_body_bytes: int
    ensemble: Ensemble | None = None
    load_error: BaseException | None = None
    created: int = field(default_factory=shapes.now)
    # Set when the server is asked to stop: streams still running at this time.monotonic() are ended.
    shutdown_deadline: float | None = None

    @property
    def name(self) -> str:
        assert self.ensemble is not None
        return self.model_name or "+".join(self.ensemble.names)

    def stopping(self) -> bool:
        return self.shutdown_deadline is not None and time.monotonic() >= self.shutdown_deadline


def create_app(
    ensemble: Ensemble | Callable[[], Ensemble],
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    defaults: GenerationConfig | None = None,
    max_batch_size: int | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    on_ready: Callable[[ServerState], None] | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """An OpenAI-compatible app serving one ensemble under one model name.

    `defaults` are the generation settings a request does not override (max_tokens, method, ...);
    `max_batch_size`, when given, sets the ensemble's bound on the requests decoded at once (the others
    wait their turn; the ensemble's scheduler decodes every request, there is no pool here); `api_key`, when
    set, is required as `Authorization: Bearer <key>` on /v1 routes (/health stays open for probes).
    """
    if max_batch_size is not None and (
        isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1
    ):
        raise ConfigError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
    if api_key is not None and not api_key:
        raise ConfigError("api_key is empty; pass a non-empty key, or None to serve without one")
    state = ServerState(
        model_name=model_name,
        api_key=api_key,
        defaults=defaults or GenerationConfig(),
        max_batch_size=max_batch_size,
        max_body_bytes=max_body_bytes,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if isinstance(ensemble, Ensemble):
            _serve(state, ensemble, on_ready)
        else:
            threading.Thread(target=_load, args=(state, ensemble, on_ready, on_load_error), daemon=True).start()
        yield
        if state.ensemble is not None:  # a stopped server leaves nothing decoding, even if the process goes on
            await asyncio.to_thread(state.ensemble.wait_idle, _IDLE_WAIT_S)

    app = FastAPI(title="safe-engine", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.safe = state
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if state.ensemble is None:
            status = "failed" if state.load_error is not None else "loading"
            return JSONResponse({"status": status}, status_code=503)
        ens = state.ensemble
        body = {"status": "ok", "model": state.name, "running": ens.running_requests, "waiting": ens.waiting_requests}
        body["open_requests"] = ens.open_requests  # requests holding KV caches
        return JSONResponse(body)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        ens = _ready(state, request)
        return JSONResponse({"object": "list", "data": [_card(state, ens)]})

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> Response:
        ens = _ready(state, request)
        _check_model(state, name)
        return JSONResponse(_card(state, ens))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        ens = _ready(state, request)
        req = parse_request(ChatCompletionRequest, await _json_body(request, state.max_body_bytes))
        assert isinstance(req, ChatCompletionRequest)
        name = _check_model(state, req.model)
        engine_request = _engine_request(
            req,
            state,
            ens,
            messages=engine_messages(req.messages),
            tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            tool_choice=req.tool_choice.model_dump()
            if isinstance(req.tool_choice, NamedToolChoice)
            else req.tool_choice,
            parallel_tool_calls=req.parallel_tool_calls,
            response_format=req.response_format,
            max_completion_tokens=req.max_completion_tokens,
        )
        stream = ens.astream(engine_request)
        if req.stream:
            with _request_errors():
                await stream.start()  # a request the engine refuses is still a plain 4xx
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(_chat_events(stream, state, ens, name, include_usage))
        result = await _result(stream, _interruption(state, request))
        return JSONResponse(
            shapes.chat_completion(shapes.new_id("chatcmpl"), name, shapes.now(), result, _drafter(ens))
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        ens = _ready(state, request)
        req = parse_request(CompletionRequest, await _json_body(request, state.max_body_bytes))
        assert isinstance(req, CompletionRequest)
        name = _check_model(state, req.model)
        prompt = req.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise RequestError(
                    400,
                    f"prompt lists {len(prompt)} prompts; this server completes one prompt per request",
                    param="prompt",
                    code="unsupported_value",
                )
            prompt = prompt[0]
        stream = ens.astream(_engine_request(req, state, ens, prompt=prompt))
        if req.stream:
            with _request_errors():
                await stream.start()
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(_completion_events(stream, state, ens, name, include_usage))
        result = await _result(stream, _interruption(state, request))
        return JSONResponse(shapes.text_completion(shapes.new_id("cmpl"), name, shapes.now(), result, _drafter(ens)))

    return app


def _load(
    state: ServerState,
    loader: Callable[[], Ensemble],
    on_ready: Callable[[ServerState], None] | None,
    on_load_error: Callable[[BaseException], None] | None,
) -> None:
    try:
        ens = loader()
        if not isinstance(ens, Ensemble):
            raise ConfigError(f"the loader returned a {type(ens).__name__}, not an Ensemble")
    except BaseException as err:
        state.load_error = err
        if on_load_error is not None:
            on_load_error(err)
        return
    _serve(state, ens, on_ready)


def _serve(state: ServerState, ens: Ensemble, on_ready: Callable[[ServerState], None] | None) -> None:
    if state.max_batch_size is not None:
        ens.max_batch_size = state.max_batch_size
    state.ensemble = ens
    if on_ready is not None:
        on_ready(state)


# -- request checks --------------------------------------------------------------------------------------------
def _ready(state: ServerState, request: Request) -> Ensemble:
    """Authorise the request, then the loaded ensemble (503 while loading)."""
    if state.api_key is not None:
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise RequestError(
                401,
                "missing API key; send it as the header 'Authorization: Bearer <key>'",
                code="missing_api_key",
                type="authentication_error",
            )
        if not hmac.compare_digest(given.strip().encode(), state.api_key.encode()):
            raise RequestError(401, "invalid API key", code="invalid_api_key", type="authentication_error")
    if state.shutdown_deadline is not None:
        raise RequestError(503, "the server is shutting down", code="server_shutdown", type="server_error")
    if state.ensemble is None:
        if state.load_error is not None:
            message = f"the ensemble failed to load: {state.load_error}"
            raise RequestError(503, message, code="model_load_failed", type="server_error")
        raise RequestError(
            503, "the ensemble is still loading; retry shortly", code="model_loading", type="server_error"
        )
    return state.ensemble


async def _json_body(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object: 413 past `limit` bytes, 400 for bad UTF-8, bad JSON or a non-object."""
    declared = request.headers.get("content-length", "")
    too_large = RequestError(
        413, f"the request body is larger than {limit} bytes", code="request_too_large", type="invalid_request_error"
    )
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RequestError(
            400,
            f"the request body is not valid UTF-8 (byte {body[err.start]:#04x} at offset {err.start}); send UTF-8 JSON",
            code="invalid_json",
        ) from None
    if not text.strip():
        raise RequestError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as err:
        raise RequestError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
    except (RecursionError, ValueError) as err:
        raise RequestError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise RequestError(
            400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json"
        )
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _check_model(state: ServerState, model: str | None) -> str:
    """The served name; a request for another model is a 404 (no model field means the served one)."""
    name = state.name
    if model is not None and model != name:
        raise RequestError(
            404,
            f"model {model!r} is not served here; this server serves {name!r} (GET /v1/models lists it)",
            param="model",
            code="model_not_found",
        )
    return name


# OpenAI's (and vLLM's) fields that are engine options by the same name
LOGPROBS_AND_PENALTIES = (
    "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias"
)  # fmt: skip


def _engine_request(req: Any, state: ServerState, ens: Ensemble, **inputs: Any) -> EngineRequest:
    """The engine's Request (`build_request`, as at every door): OpenAI's fields by the engine's shared
    semantics, the SAFE knobs by their own names, the server's defaults underneath."""
    options = {k: v for k, v in inputs.items() if v is not None}
    for name in ("max_tokens", "temperature", "top_p", "seed", "stop", *LOGPROBS_AND_PENALTIES):
        if getattr(req, name, None) is not None:
            options[name] = getattr(req, name)
    options.update(req.model_extra or {})  # the SAFE knobs (parse_request refused any other extra field)
    try:
        request = build_request(config=state.defaults, **options)
    except SafeEngineError as err:
        raise RequestError(400, str(err), param=err.option, code="invalid_value") from None
    window = ens.context_window
    limit = request.config.max_new_tokens
    if window is not None and limit > window:
        param = "max_completion_tokens" if "max_completion_tokens" in options else "max_tokens"
        raise RequestError(
            400,
            f"{param}={limit} is more than the ensemble's context window of {window} tokens; lower it",
            param=param,
            code="context_length_exceeded",
        )
    return request


def engine_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """OpenAI messages as the engine's dicts: text content only, tool-call arguments as dicts."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        entry: dict[str, Any] = {"role": role, "content": _text(m, i)}
        if entry["content"] is None and not (role == "assistant" and m.tool_calls):
            raise RequestError(
                400, f"messages[{i}] ({m.role}) has no content", param=f"messages[{i}].content", code="invalid_value"
            )
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_calls:
            if role != "assistant":
                raise RequestError(
                    400,
                    f"messages[{i}] is a {m.role} message; only assistant messages carry tool_calls",
                    param=f"messages[{i}].tool_calls",
                    code="invalid_value",
                )
            entry["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in m.tool_calls
            ]
        if role == "tool":
            if not m.tool_call_id:
                raise RequestError(
                    400,
                    f"messages[{i}] is a tool message without tool_call_id; give the id of the call it answers",
                    param=f"messages[{i}].tool_call_id",
                    code="missing_required_parameter",
                )
            entry["tool_call_id"] = m.tool_call_id
        elif m.tool_call_id is not None:
            raise RequestError(
                400,
                f"messages[{i}] is a {m.role} message; only tool messages carry tool_call_id",
                param=f"messages[{i}].tool_call_id",
                code="invalid_value",
            )
        out.append(entry)
    return out


def _text(m: Message, i: int) -> str | None:
    if m.content is None or isinstance(m.content, str):
        return m.content
    parts = []
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            raise RequestError(
                400,
                f"messages[{i}].content[{j}] is a {part.type!r} part; the ensemble's members read text only",
                param=f"messages[{i}].content[{j}]",
                code="unsupported_value",
            )
        parts.append(part.text)
    return "".join(parts)


def _tool_choice(choice: Any) -> Any:
    """OpenAI's tool_choice as the engine reads it ({"type": "function", "function": {"name": ...}} or a word)."""
    return choice.model_dump() if isinstance(choice, NamedToolChoice) else choice


def _drafter(ens: Ensemble) -> str:
    return ens.names[ens.drafter_index]


def _card(state: ServerState, ens: Ensemble) -> dict[str, Any]:
    return shapes.model_card(state.name, state.created, list(ens.names), _drafter(ens), ens.context_window)


# -- running ---------------------------------------------------------------------------------------------------
def engine_error(err: BaseException) -> RequestError:
    """The engine's refusal (or failure) of a request as an OpenAI error."""
    if isinstance(err, RequestError):
        return err
    if isinstance(err, GenerationTimeout):
        return RequestError(504, str(err), param="timeout_s", code="timeout", type="timeout_error")
    if isinstance(err, InputError | ConfigError | InputTypeError):
        code = "context_length_exceeded" if "context window" in str(err) else "invalid_value"
        return RequestError(400, str(err), code=code)
    if isinstance(err, TemplateError):
        return RequestError(
            400, f"a member's chat template refused these messages: {err}", param="messages", code="invalid_value"
        )
    if isinstance(err, MemberError | SafeEngineError):
        return RequestError(500, str(err), code="member_error", type="server_error")
    return RequestError(500, f"internal error: {type(err).__name__}: {err}", code="internal_error", type="server_error")


class Interrupted(Exception):
    """A request stopped before its end: the client left or the server is shutting down (`reason`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


Check = Callable[[], Awaitable[str | None]]


def _interruption(state: ServerState, request: Request) -> Check:
    """Why a request should stop now: the server is shutting down or the client left (None: go on)."""

    async def check() -> str | None:
        if state.stopping():
            return "shutdown"
        return "disconnected" if await request.is_disconnected() else None

    return check


def _stream_check(state: ServerState) -> Check:
    async def check() -> str | None:  # a client that leaves is seen by Starlette, which cancels the body
        return "shutdown" if state.stopping() else None

    return check


@contextlib.contextmanager
def _request_errors() -> Iterator[None]:
    """The engine's refusals and failures, and interruptions, as the OpenAI errors they answer with."""
    try:
        yield
    except Interrupted as err:
        raise _interrupted(err) from None
    except RequestError:
        raise
    except Exception as err:
        raise engine_error(err) from None


async def _events(stream: AsyncTextStream, check: Check, tick: float = 0.25) -> AsyncIterator[StreamEvent]:
    """The engine stream's events; `check` runs every `tick` seconds whether events come or not, and a
    reason from it ends the request. However this ends, the request is cancelled and its caches freed."""
    events = stream.events()
    pending: asyncio.Future[StreamEvent] | None = None
    checked = time.monotonic()
    try:
        with _request_errors():
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(events))
                done, _ = await asyncio.wait({pending}, timeout=tick)
                if not done or time.monotonic() - checked >= tick:
                    checked = time.monotonic()
                    reason = await check()
                    if reason:
                        raise Interrupted(reason)
                if not done:
                    continue
                try:
                    event = pending.result()
                except StopAsyncIteration:
                    return
                pending = None
                yield event
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await events.aclose()
        await stream.aclose()


async def _result(stream: AsyncTextStream, check: Check) -> GenerationResult:
    """Run a non-streaming request to its result; a client that leaves cancels it."""
    async for event in _events(stream, check):
        if event.result is not None:
            return event.result
    raise RequestError(500, "the generation ended without a result", code="internal_error", type="server_error")


def _interrupted(err: Interrupted) -> RequestError:
    if err.reason == "shutdown":
        return RequestError(
            503, "the server is shutting down; retry later", code="server_shutdown", type="server_error"
        )
    return RequestError(499, "the client closed the request", code="client_closed", type="invalid_request_error")


async def _chat_events(
    stream: AsyncTextStream, state: ServerState, ens: Ensemble, name: str, include_usage: bool
) -> AsyncIterator[bytes]:
    rid, created = shapes.new_id("chatcmpl"), shapes.now()
    try:
        yield shapes.sse(shapes.chat_chunk(rid, name, created, {"role": "assistant", "content": ""}))
        async for event in _events(stream, _stream_check(state)):
            logprobs = chat_logprobs(event.logprobs) if event.logprobs else None  # the delta's tokens'
            if event.content or logprobs:
                delta = {"content": event.content} if event.content else {}
                yield shapes.sse(shapes.chat_chunk(rid, name, created, delta, logprobs=logprobs))
            result = event.result
            if result is None:
                continue
            for index, call in enumerate(shapes.tool_calls(result)):
                yield shapes.sse(shapes.chat_chunk(rid, name, created, {"tool_calls": [{"index": index, **call}]}))
            safe = shapes.safe_stats(result)
            yield shapes.sse(shapes.chat_chunk(rid, name, created, {}, shapes.finish_reason(result), safe=safe))
            if include_usage:
                usage = shapes.usage(result, _drafter(ens))
                yield shapes.sse(shapes.chat_chunk(rid, name, created, None, usage=usage, safe=safe))
    except RequestError as err:  # after the 200: the error travels as an event, as OpenAI's streams do
        yield shapes.sse(shapes.error_body(err.message, err.type, err.param, err.code))
    yield shapes.sse("[DONE]")


async def _completion_events(
    stream: AsyncTextStream, state: ServerState, ens: Ensemble, name: str, include_usage: bool
) -> AsyncIterator[bytes]:
    rid, created = shapes.new_id("cmpl"), shapes.now()
    offset = 0  # characters streamed so far (the logprobs' text_offset)
    try:
        async for event in _events(stream, _stream_check(state)):
            result = event.result
            if event.delta or result is None or event.logprobs:
                logprobs = completion_logprobs(event.logprobs, offset) if event.logprobs is not None else None
                yield shapes.sse(shapes.completion_chunk(rid, name, created, event.delta, logprobs=logprobs))
                offset += len(event.delta)
            if result is None:
                continue
            safe = shapes.safe_stats(result)
            yield shapes.sse(shapes.completion_chunk(rid, name, created, "", shapes.finish_reason(result), safe=safe))
            if include_usage:
                usage = shapes.usage(result, _drafter(ens))
                yield shapes.sse(shapes.completion_chunk(rid, name, created, None, usage=usage, safe=safe))
    except RequestError as err:
        yield shapes.sse(shapes.error_body(err.message, err.type, err.param, err.code))
    yield shapes.sse("[DONE]")


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator, even when the client vanished, so the
    generation behind it is cancelled and its caches freed right away."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _sse(body: AsyncIterator[bytes]) -> Response:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return _SSEResponse(body, media_type="text/event-stream", headers=headers)


# -- errors ----------------------------------------------------------------------------------------------------
def error_response(err: RequestError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    body = shapes.error_body(err.message, err.type, err.param, err.code)
    return _AsciiJSON(body, status_code=err.status, headers=headers)


class _AsciiJSON(JSONResponse):
    """JSON with non-ASCII escaped: an error may quote the request's own (possibly broken) text."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _request_error(request: Request, err: RequestError) -> Response:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError) -> Response:
        first = err.errors()[0] if err.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        return error_response(RequestError(400, f"invalid request: {first.get('msg', err)}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> Response:
        if err.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see GET /v1/models, POST /v1/chat/completions"
            return error_response(RequestError(404, message, code="unknown_url"))
        if err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
            return error_response(RequestError(405, message, code="method_not_allowed"))
        return error_response(RequestError(err.status_code, str(err.detail), code="http_error"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, err: Exception) -> Response:
        return error_response(engine_error(err))
