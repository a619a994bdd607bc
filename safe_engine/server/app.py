"""The FastAPI app: OpenAI's /v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /health and
Prometheus' /metrics.

`create_app(ensemble_or_loader, ...)` takes a loaded `Ensemble`, or a callable that loads one (run in a
thread at startup, so /health answers 503 while the members load). The endpoints are plain functions of
this module that find what they share on `request.app.state.safe` (a `ServerState`); each generating
endpoint reads its request with its own mapper (chat, completions, responses), and shares the rest (`Call`):
the checks, the body, admission of its choices (batch), streaming (streaming) and errors (http).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ..config import GenerationConfig
from ..engine.ensemble import Ensemble
from ..errors import ConfigError
from . import chat, completions, streaming
from . import openai_shapes as shapes
from . import responses as rsp
from .call import Call, ready
from .http import DEFAULT_MAX_BODY_BYTES, add_error_handlers
from .metrics import CONTENT_TYPE_LATEST, MetricsMiddleware
from .schemas import ChatCompletionRequest, CompletionRequest, RequestError
from .state import DEFAULT_STREAM_IDLE_TIMEOUT_S, ServerState, drafter_name, of

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DEFAULT_STREAM_IDLE_TIMEOUT_S", "ServerState", "create_app"]

_IDLE_WAIT_S = 30.0  # at shutdown, how long the last round (already cancelled) may take to end


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
    add_error_handlers(app)
    for method, path, endpoint in ROUTES:
        app.add_api_route(path, endpoint, methods=[method])
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


# -- the endpoints ---------------------------------------------------------------------------------------------
async def health(request: Request) -> Response:
    state = of(request)
    if state.ensemble is None:
        status = "failed" if state.load_error is not None else "loading"
        return JSONResponse({"status": status}, status_code=503)
    ens = state.ensemble
    body = {"status": "ok", "model": state.name, "running": ens.running_requests, "waiting": ens.waiting_requests}
    body["open_requests"] = ens.open_requests  # requests holding KV caches
    return JSONResponse(body)


async def models(request: Request) -> Response:
    state, ens = ready(request)
    return JSONResponse({"object": "list", "data": [_card(state, ens)]})


async def model(name: str, request: Request) -> Response:
    state, ens = ready(request)
    state.served(name)
    return JSONResponse(_card(state, ens))


async def metrics(request: Request) -> Response:
    return Response(of(request).metrics.text(), media_type=CONTENT_TYPE_LATEST)


async def placement(request: Request) -> Response:
    """How the engine uses the CPU (`Ensemble.placement`); POST times the members' forwards again first
    (`Ensemble.measure_placement`: the load the server was started under may have changed). Refused while a
    request is open, whose forwards the timing would measure too."""
    _, ens = ready(request)
    if request.method == "POST":
        if ens.open_requests:
            message = f"{ens.open_requests} request(s) open; measure the placement when /health shows none"
            raise RequestError(409, message, code="requests_open")
        await asyncio.to_thread(ens.measure_placement)
    where = ens.placement
    body = {"chosen_by": None, "describe": None} if where is None else {
        "chosen_by": where.chosen_by, "describe": where.describe(), "cpu": where.cpu, "cores": where.cores,
        "threads": {"alone": where.alone, "verifying": where.verifying, "batch": where.batch,
                    "drafter": where.drafter, "verifiers": where.verifiers},
    }  # fmt: skip
    return JSONResponse({"object": "placement", **body})


async def chat_completions(request: Request) -> Response:
    call, req = await Call.open(request, chat.parse)
    batch = await call.start([call.engine_request(req, **chat.engine_inputs(req))], req.n or 1)
    if req.stream:
        return streaming.chat(batch, call.state, call.name, _include_usage(req))
    results = await call.results(batch)
    body = shapes.chat_completion(shapes.new_id("chatcmpl"), call.name, shapes.now(), results, batch.usage(results))
    return JSONResponse(body)


async def text_completions(request: Request) -> Response:
    call, req = await Call.open(request, completions.parse)
    prompts = completions.prompts(req.prompt, call.ens)
    batch = await call.start([call.engine_request(req, prompt=prompt) for prompt in prompts], req.n or 1)
    echo = prompts if req.echo else None
    if req.stream:
        return streaming.completions(batch, call.state, call.name, _include_usage(req), echo)
    results = await call.results(batch)
    texts = [(echo[c.prompt_index] if echo else "") + r.text for c, r in zip(batch.choices, results)]
    body = shapes.text_completion(shapes.new_id("cmpl"), call.name, shapes.now(), results, texts, batch.usage(results))
    return JSONResponse(body)


async def responses(request: Request) -> Response:
    call, req = await Call.open(request, rsp.parse)
    batch = await call.start([call.engine_request(req, **rsp.engine_inputs(req))], 1)
    echo = rsp.echoed(req, call.name)
    if req.stream:
        return streaming.responses(batch, call.state, echo)
    (result,) = await call.results(batch)
    return JSONResponse(rsp.response(echo, result, batch.usage([result])))


#: (method, path, endpoint): every route of the app, in the order they are matched
ROUTES: tuple[tuple[str, str, Callable[..., Awaitable[Response]]], ...] = (
    ("GET", "/health", health),
    ("GET", "/v1/models", models),
    ("GET", "/v1/models/{name:path}", model),
    ("GET", "/metrics", metrics),
    ("GET", "/v1/placement", placement),
    ("POST", "/v1/placement", placement),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", text_completions),
    ("POST", "/v1/responses", responses),
)


def _include_usage(req: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether a chat or completions stream ends with a usage chunk (`stream_options.include_usage`)."""
    return bool(req.stream_options and req.stream_options.include_usage)


def _card(state: ServerState, ens: Ensemble) -> dict[str, Any]:
    return shapes.model_card(state.name, state.created, list(ens.names), drafter_name(ens), ens.context_window)
