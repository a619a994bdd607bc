"""The FastAPI app: OpenAI's /v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /health and
Prometheus' /metrics.

`create_app(ensemble_or_loader, ...)` takes a loaded `Ensemble`, or a callable that loads one (run in a
thread at startup, so /health answers 503 while the members load). Every choice of a request (`n`, the
prompts of a completions request) is one request to the engine, submitted together so that they decode in
one batch; `max_queue` bounds how many may wait for the batch (beyond it: 503). Request bodies are read and
validated here rather than by FastAPI, so that every refusal is OpenAI's error shape with the right
status (400 instead of FastAPI's 422, 413 for oversized bodies) and names the offending field.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..config import GenerationConfig
from ..engine.ensemble import AsyncTextStream, Ensemble
from ..errors import ConfigError, GenerationTimeout, InputError, InputTypeError, MemberError, SafeEngineError
from ..runtime.vocab import tokenizer_lock
from ..shaping.reply import StreamEvent
from ..shaping.request import Request as EngineRequest
from ..shaping.request import build_request
from ..stats import GenerationResult, chat_logprobs, completion_logprobs
from . import openai_shapes as shapes
from . import responses as rsp
from .metrics import CONTENT_TYPE_LATEST, Metrics, MetricsMiddleware
from .schemas import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    Message,
    NamedToolChoice,
    RequestError,
    parse_request,
)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
RETRY_AFTER_S = 1  # what a 503 tells clients to wait before retrying (the openai SDK honours it)
DEFAULT_STREAM_IDLE_TIMEOUT_S = 60.0
_IDLE_WAIT_S = 30.0  # at shutdown, how long the last round (already cancelled) may take to end
_log = logging.getLogger("safe_engine.server")


@dataclass
class ServerState:
    """What the routes share: the ensemble (None while loading), settings, shutdown deadline."""

    model_name: str | None
    api_key: str | None
    defaults: GenerationConfig
    max_batch_size: int | None
    max_body_bytes: int
    max_queue: int | None = None
    metrics: Metrics = field(default_factory=Metrics)
    # engine requests this server has submitted and not yet ended (running, waiting or being tokenized)
    admitted: int = 0
    # How long a stream's next chunk may wait for the client to read (None: no limit); see _SSEResponse.
    stream_idle_timeout: float | None = DEFAULT_STREAM_IDLE_TIMEOUT_S
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
    max_queue: int | None = None,
    stream_idle_timeout: float | None = DEFAULT_STREAM_IDLE_TIMEOUT_S,
    on_ready: Callable[[ServerState], None] | None = None,
    on_load_error: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """An OpenAI-compatible app serving one ensemble under one model name.

    `defaults` are the generation settings a request does not override (max_tokens, method, ...);
    `max_batch_size`, when given, sets the ensemble's bound on the requests decoded at once (the others
    wait their turn; the ensemble's scheduler decodes every request, there is no pool here); `api_key`, when
    set, is required as `Authorization: Bearer <key>` on /v1 routes (/health stays open for probes);
    `max_queue`, when given, is how many requests (choices) may wait for a slot in the batch: a request that
    would make more wait is refused at once with a 503 and `Retry-After` (None: no bound).
    `stream_idle_timeout` (seconds, None: none) ends a stream whose client stops reading without leaving:
    once its next chunk has waited that long to be sent, the connection is closed and the request cancelled.
    """
    if stream_idle_timeout is not None and (
        isinstance(stream_idle_timeout, bool)
        or not isinstance(stream_idle_timeout, int | float)
        or not stream_idle_timeout > 0
    ):
        raise ConfigError(f"stream_idle_timeout must be a number of seconds > 0 or None, got {stream_idle_timeout!r}")
    if max_batch_size is not None and (
        isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1
    ):
        raise ConfigError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
    if max_queue is not None and (isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0):
        raise ConfigError(f"max_queue must be an integer >= 0 (or None: unbounded), got {max_queue!r}")
    if api_key is not None and not api_key:
        raise ConfigError("api_key is empty; pass a non-empty key, or None to serve without one")
    state = ServerState(
        model_name=model_name,
        api_key=api_key,
        defaults=defaults or GenerationConfig(),
        max_batch_size=max_batch_size,
        max_body_bytes=max_body_bytes,
        max_queue=max_queue,
        stream_idle_timeout=stream_idle_timeout,
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
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
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

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrived = time.monotonic()
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
        batch = await _start(state, ens, [engine_request], req.n or 1, arrived)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(_chat_events(batch, state, ens, name, include_usage), batch, state)
        results = await _results(batch, _interruption(state, request))
        usage = _usage(batch, results, _drafter(ens))
        return JSONResponse(shapes.chat_completion(shapes.new_id("chatcmpl"), name, shapes.now(), results, usage))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrived = time.monotonic()
        ens = _ready(state, request)
        req = parse_request(CompletionRequest, await _json_body(request, state.max_body_bytes))
        assert isinstance(req, CompletionRequest)
        name = _check_model(state, req.model)
        prompts = _prompts(req.prompt, ens)
        engine_requests = [_engine_request(req, state, ens, prompt=prompt) for prompt in prompts]
        batch = await _start(state, ens, engine_requests, req.n or 1, arrived)
        echo = prompts if req.echo else None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _sse(_completion_events(batch, state, ens, name, include_usage, echo), batch, state)
        results = await _results(batch, _interruption(state, request))
        usage = _usage(batch, results, _drafter(ens))
        texts = [(echo[c.prompt_index] if echo else "") + r.text for c, r in zip(batch.choices, results)]
        return JSONResponse(shapes.text_completion(shapes.new_id("cmpl"), name, shapes.now(), results, texts, usage))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        arrived = time.monotonic()
        ens = _ready(state, request)
        req = rsp.parse(await _json_body(request, state.max_body_bytes))
        name = _check_model(state, req.model)
        inputs = rsp.engine_inputs(req)
        engine_request = _engine_request(req, state, ens, **inputs)
        batch = await _start(state, ens, [engine_request], 1, arrived)
        echo = rsp.echoed(req, name)
        if req.stream:
            return _sse(_response_events(batch, state, ens, echo), batch, state)
        (result,) = await _results(batch, _interruption(state, request))
        return JSONResponse(rsp.response(echo, result, _usage(batch, [result], _drafter(ens))))

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
    state.metrics.watch(lambda: ens.running_requests, lambda: ens.waiting_requests, lambda: ens.max_batch_size)
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
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:  # the client left while sending its body: nobody to answer, nothing to log
        raise RequestError(
            499, "the client closed the request", code="client_closed", type="invalid_request_error"
        ) from None
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


def _engine_request(
    req: Any, state: ServerState, ens: Ensemble, limit_name: str | None = None, **inputs: Any
) -> EngineRequest:
    """The engine's Request (`build_request`, as at every door): OpenAI's fields by the engine's shared
    semantics, the SAFE knobs by their own names, the server's defaults underneath. `limit_name`: what the
    request calls its token limit, for the error when it is too large."""
    options = {k: v for k, v in inputs.items() if v is not None}
    for name in ("max_tokens", "temperature", "top_p", "seed", "stop", *LOGPROBS_AND_PENALTIES):
        if getattr(req, name, None) is not None:
            options[name] = getattr(req, name)
    options.update(req.model_extra or {})  # the SAFE knobs (parse_request refused any other extra field)
    try:
        request = build_request(config=state.defaults, **options)
    except SafeEngineError as err:
        if limit_name and err.option == "max_tokens":  # the request's own name for it
            message = str(err).replace("max_tokens", limit_name)
            raise RequestError(400, message, param=limit_name, code="invalid_value") from None
        raise RequestError(400, str(err), param=err.option, code="invalid_value") from None
    window = ens.context_window
    limit = request.config.max_new_tokens
    if window is not None and limit > window:
        param = limit_name or ("max_completion_tokens" if "max_completion_tokens" in options else "max_tokens")
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


def _anext_result(done: asyncio.Future[StreamEvent]) -> StreamEvent | None:
    """A finished `anext` future's event, or None when the stream has ended.

    Why not `try: done.result() except StopAsyncIteration`: raised here, the exception's traceback takes in
    the caller's frame, which holds the future, which holds the exception. That cycle kept every finished
    request's objects (its stream, its connection) until the garbage collector's rare full pass.
    """
    if isinstance(done.exception(), StopAsyncIteration):
        return None
    return done.result()


async def _events(stream: AsyncTextStream, check: Check, tick: float = 0.25) -> AsyncGenerator[StreamEvent, None]:
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
                event, pending = _anext_result(pending), None
                if event is None:
                    return
                yield event
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await events.aclose()
        await stream.aclose()


@dataclass
class _Choice:
    """One choice of a request: its engine stream, which prompt it answers, when its first token came."""

    index: int
    prompt_index: int
    stream: AsyncTextStream
    first_token: float | None = None
    result: GenerationResult | None = None


@dataclass
class _Batch:
    """The choices of one HTTP request, decoded together; `close` (idempotent) cancels what is still running
    and gives their places in the queue back."""

    state: ServerState
    choices: list[_Choice]
    arrived: float
    drafter: str  # usage and metrics count in the drafter's tokenization
    held: int = 0  # places in `state.admitted` still held

    async def close(self) -> None:
        for choice in self.choices:
            await choice.stream.aclose()
        self.release(self.held)

    def release(self, count: int) -> None:
        count = min(count, self.held)
        self.held -= count
        self.state.admitted -= count

    def finished(self, choice: _Choice, result: GenerationResult) -> None:
        choice.result = result
        prompt_tokens = int(result.stats.prompt_tokens.get(self.drafter, 0))
        self.state.metrics.finished(result, prompt_tokens, choice.first_token, time.monotonic(), self.arrived)
        self.release(1)


def _copies(request: EngineRequest, n: int) -> list[EngineRequest]:
    """n requests for n choices: seeds seed, seed + 1, ... when sampling with a seed (so the choices differ
    and each is reproducible); the same request otherwise (greedy choices are identical, as in vLLM)."""
    config = request.config
    if n == 1 or not config.do_sample or config.seed is None:
        return [request] * n
    copies = []
    for i in range(n):
        try:
            copies.append(dataclasses.replace(request, config=config.updated(seed=config.seed + i)))
        except SafeEngineError as err:
            raise RequestError(400, f"seed + {i} for choice {i}: {err}", param="seed", code="invalid_value") from None
    return copies


async def _start(state: ServerState, ens: Ensemble, requests: list[EngineRequest], n: int, arrived: float) -> _Batch:
    """Admit and start every choice (n per request, prompt-major, as OpenAI numbers them): refused at once
    with a 503 when the queue is full, a plain 4xx when the engine refuses an input."""
    count = len(requests) * n
    if count > MAX_CHOICES:
        raise RequestError(
            400,
            f"{len(requests)} prompts x n={n} is {count} choices; at most {MAX_CHOICES} per request",
            param="n",
            code="invalid_value",
        )
    if state.max_queue is not None:
        room = ens.max_batch_size + state.max_queue
        if count > room:
            raise RequestError(
                400,
                f"this request asks for {count} choices, more than the server holds at once ({ens.max_batch_size} "
                f"decoding + {state.max_queue} waiting); lower n or send fewer prompts",
                param="n",
                code="invalid_value",
            )
        if state.admitted + count > room:
            state.metrics.rejected.inc()
            raise RequestError(
                503,
                f"the server is at capacity ({state.admitted} requests decoding or waiting, queue bound "
                f"{state.max_queue}); retry in {RETRY_AFTER_S} s",
                code="queue_full",
                type="server_error",
            )
    state.admitted += count
    batch = _Batch(state, [], arrived, _drafter(ens), held=count)
    try:
        for p, request in enumerate(requests):
            for copy in _copies(request, n):
                batch.choices.append(_Choice(len(batch.choices), p, ens.astream(copy)))
        # every start ends before any error is raised, so that closing the batch cancels each one submitted
        outcomes = await asyncio.gather(*(c.stream.start() for c in batch.choices), return_exceptions=True)
        with _request_errors():
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
    except BaseException:
        await batch.close()
        raise
    return batch


async def _choice_events(batch: _Batch, check: Check) -> AsyncIterator[tuple[_Choice, StreamEvent]]:
    """The events of every choice as they come, each with its choice; the batch is closed however this ends."""
    sources = {c.index: _events(c.stream, check) for c in batch.choices}
    pending: dict[asyncio.Future[StreamEvent], _Choice] = {}
    try:
        for choice in batch.choices:
            pending[asyncio.ensure_future(anext(sources[choice.index]))] = choice
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t].index):
                choice = pending.pop(task)
                event = _anext_result(task)
                if event is None:
                    continue
                if choice.first_token is None and (event.delta or event.result is not None):
                    choice.first_token = time.monotonic()
                if event.result is not None:
                    batch.finished(choice, event.result)
                yield choice, event
                pending[asyncio.ensure_future(anext(sources[choice.index]))] = choice
    finally:
        for task in pending:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for source in sources.values():
            await source.aclose()
        await batch.close()


async def _results(batch: _Batch, check: Check) -> list[GenerationResult]:
    """Run every choice of a non-streaming request to its result; a client that leaves cancels them all."""
    async for _ in _choice_events(batch, check):
        pass
    results = [c.result for c in batch.choices]
    if any(r is None for r in results):
        raise RequestError(500, "a generation ended without a result", code="internal_error", type="server_error")
    return [r for r in results if r is not None]


def _usage(batch: _Batch, results: list[GenerationResult], drafter: str) -> dict[str, int]:
    """OpenAI's usage for several choices: each prompt's tokens once (the n choices of a prompt share it),
    every choice's completion tokens."""
    prompt = completion = 0
    counted: set[int] = set()
    for choice, result in zip(batch.choices, results):
        if choice.prompt_index not in counted:
            counted.add(choice.prompt_index)
            prompt += int(result.stats.prompt_tokens.get(drafter, 0))
        completion += int(result.stats.tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _prompts(prompt: str | list[str] | list[int] | list[list[int]], ens: Ensemble) -> list[str]:
    """A completions request's prompts as text: token ids are the drafter's, decoded with its tokenizer."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError(400, "prompt is an empty list; send a string or a list of strings", param="prompt")
    if isinstance(prompt[0], int):
        return [_decode(prompt, ens, "prompt")]
    if isinstance(prompt[0], list):
        return [_decode(ids, ens, f"prompt[{i}]") for i, ids in enumerate(prompt)]
    return prompt


def _decode(ids: list[int], ens: Ensemble, param: str) -> str:
    tokenizer = ens.drafter.tokenizer
    size = len(tokenizer)
    bad = next((t for t in ids if not 0 <= t < size), None)
    if bad is not None:
        raise RequestError(
            400,
            f"{param} holds token id {bad}, outside the drafter's vocabulary (0..{size - 1}); token-id prompts are "
            f"in the drafter's ({_drafter(ens)}) tokenization",
            param=param,
            code="invalid_value",
        )
    with tokenizer_lock(tokenizer):
        text = tokenizer.decode(ids, skip_special_tokens=True)  # each member adds its own BOS when it encodes
    if not text:
        raise RequestError(400, f"{param} decodes to no text", param=param, code="invalid_value")
    return str(text)


def _interrupted(err: Interrupted) -> RequestError:
    if err.reason == "shutdown":
        return RequestError(
            503, "the server is shutting down; retry later", code="server_shutdown", type="server_error"
        )
    return RequestError(499, "the client closed the request", code="client_closed", type="invalid_request_error")


async def _chat_events(
    batch: _Batch, state: ServerState, ens: Ensemble, name: str, include_usage: bool
) -> AsyncIterator[bytes]:
    """A chat stream: each choice's chunks carry its `index`, interleaved as the choices decode."""
    rid, created = shapes.new_id("chatcmpl"), shapes.now()
    try:
        for choice in batch.choices:
            yield shapes.sse(
                shapes.chat_chunk(rid, name, created, {"role": "assistant", "content": ""}, i=choice.index)
            )
        async for choice, event in _choice_events(batch, _stream_check(state)):
            i = choice.index
            logprobs = chat_logprobs(event.logprobs) if event.logprobs else None  # the delta's tokens'
            if event.content or logprobs:
                delta = {"content": event.content} if event.content else {}
                yield shapes.sse(shapes.chat_chunk(rid, name, created, delta, i=i, logprobs=logprobs))
            result = event.result
            if result is None:
                continue
            for k, call in enumerate(shapes.tool_calls(result)):
                yield shapes.sse(shapes.chat_chunk(rid, name, created, {"tool_calls": [{"index": k, **call}]}, i=i))
            safe = shapes.safe_stats(result)
            yield shapes.sse(shapes.chat_chunk(rid, name, created, {}, shapes.finish_reason(result), i=i, safe=safe))
        if include_usage:
            usage = _usage(batch, _finished(batch), batch.drafter)
            safe = shapes.safe_stats(_finished(batch)[0])
            yield shapes.sse(shapes.chat_chunk(rid, name, created, None, usage=usage, safe=safe))
    except RequestError as err:  # after the 200: the error travels as an event, as OpenAI's streams do
        yield shapes.sse(shapes.error_body(err.message, err.type, err.param, err.code))
    finally:
        await batch.close()
    yield shapes.sse("[DONE]")


async def _completion_events(
    batch: _Batch, state: ServerState, ens: Ensemble, name: str, include_usage: bool, echo: list[str] | None
) -> AsyncIterator[bytes]:
    """A completions stream: the echoed prompt first (with `echo`), then each choice's deltas by `index`."""
    rid, created = shapes.new_id("cmpl"), shapes.now()
    try:
        if echo is not None:
            for choice in batch.choices:
                yield shapes.sse(shapes.completion_chunk(rid, name, created, echo[choice.prompt_index], i=choice.index))
        # characters of each choice's text so far (the logprobs' text_offset; an echoed prompt counts)
        offsets = {c.index: len(echo[c.prompt_index]) if echo else 0 for c in batch.choices}
        async for choice, event in _choice_events(batch, _stream_check(state)):
            i, result = choice.index, event.result
            if event.delta or result is None or event.logprobs:
                logprobs = completion_logprobs(event.logprobs, offsets[i]) if event.logprobs is not None else None
                yield shapes.sse(shapes.completion_chunk(rid, name, created, event.delta, i=i, logprobs=logprobs))
                offsets[i] += len(event.delta)
            if result is None:
                continue
            safe = shapes.safe_stats(result)
            yield shapes.sse(
                shapes.completion_chunk(rid, name, created, "", shapes.finish_reason(result), i=i, safe=safe)
            )
        if include_usage:
            usage = _usage(batch, _finished(batch), batch.drafter)
            safe = shapes.safe_stats(_finished(batch)[0])
            yield shapes.sse(shapes.completion_chunk(rid, name, created, None, usage=usage, safe=safe))
    except RequestError as err:
        yield shapes.sse(shapes.error_body(err.message, err.type, err.param, err.code))
    finally:
        await batch.close()
    yield shapes.sse("[DONE]")


async def _response_events(
    batch: _Batch, state: ServerState, ens: Ensemble, echo: dict[str, Any]
) -> AsyncIterator[bytes]:
    """A Responses API stream: OpenAI's typed events, numbered by `sequence_number`."""
    events = rsp.EventWriter(echo)
    try:
        for body in events.begin():
            yield shapes.sse_event(body)
        async for _, event in _choice_events(batch, _stream_check(state)):
            if event.content:
                for body in events.text(event.content):
                    yield shapes.sse_event(body)
            if event.result is not None:
                usage = _usage(batch, [event.result], batch.drafter)
                for body in events.end(event.result, usage):
                    yield shapes.sse_event(body)
    except RequestError as err:
        yield shapes.sse_event(events.error(err.message, err.code))
    finally:
        await batch.close()


def _finished(batch: _Batch) -> list[GenerationResult]:
    return [c.result for c in batch.choices if c.result is not None]


class StreamStalled(Exception):
    """A stream's client stopped reading (without leaving) for longer than the server's idle timeout."""


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator and its batch, even when the client vanished
    before the body started, so the generations behind it are cancelled and their caches freed right away.

    A client that stops reading but keeps its connection open fills the socket's buffers, and then each
    `send` waits for it. Past `idle_timeout` seconds of such a wait the stream ends: the request is
    cancelled (caches freed, its batch slot given to others) and the connection closed (nothing more can
    be said to a client that does not read). Until then the request decodes on as usual."""

    def __init__(self, body: AsyncIterator[bytes], batch: _Batch, idle_timeout: float | None, **kwargs: Any) -> None:
        super().__init__(body, **kwargs)
        self.batch = batch
        self.idle_timeout = idle_timeout

    async def __call__(self, scope, receive, send) -> None:
        timeout = self.idle_timeout

        async def send_within(message: Any) -> None:
            try:
                async with asyncio.timeout(timeout):  # no task per chunk, unlike wait_for
                    await send(message)
            except TimeoutError:
                raise StreamStalled(f"the client read nothing for {timeout} s") from None

        try:
            await super().__call__(scope, receive, send if timeout is None else send_within)
        except StreamStalled as stalled:
            _log.warning("ending a stream: %s (--stream-idle-timeout)", stalled)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.batch.close()


def _sse(body: AsyncIterator[bytes], batch: _Batch, state: ServerState) -> Response:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return _SSEResponse(body, batch, state.stream_idle_timeout, media_type="text/event-stream", headers=headers)


# -- errors ----------------------------------------------------------------------------------------------------
def error_response(err: RequestError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    if err.status == 503:  # loading, shutting down or at capacity: all pass
        headers = {"Retry-After": str(RETRY_AFTER_S)}
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
