"""What every generating endpoint does around its own mapping, written once: the prelude (API key, a loaded
ensemble, the body, the model's name), the engine request from the fields all endpoints share, admission
of its choices, and running them to their results.

Why a `Call` object: the three endpoints differ only in how they read their request and shape their reply;
everything they hold in between (state, ensemble, served name, arrival time) travels together.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import Request
from pydantic import BaseModel

from ..engine.ensemble import Ensemble
from ..errors import SafeEngineError
from ..shaping.request import Request as EngineRequest
from ..shaping.request import build_request
from ..stats import GenerationResult
from .batch import Batch, interruption
from .http import authorize, json_body
from .schemas import RequestError
from .state import ServerState, of

# OpenAI's (and vLLM's) fields that are engine options by the same name
LOGPROBS_AND_PENALTIES = (
    "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias"
)  # fmt: skip


class _Parsed(Protocol):
    """Any endpoint's parsed request: each names the model it asks for (None: the served one)."""

    model: str | None


Parsed = TypeVar("Parsed", bound=_Parsed)


def ready(request: Request) -> tuple[ServerState, Ensemble]:
    """Authorise the request, then the loaded ensemble (503 while loading or stopping)."""
    state = of(request)
    authorize(request, state.api_key)
    return state, state.loaded()


@dataclass
class Call:
    """One request to a generating endpoint, past the checks every such endpoint makes first."""

    request: Request
    state: ServerState
    ens: Ensemble
    name: str  # the served model's name, which the reply carries
    arrived: float

    @classmethod
    async def open(cls, request: Request, parse: Callable[[dict[str, Any]], Parsed]) -> tuple[Call, Parsed]:
        """The prelude: API key, loaded ensemble, body (read and parsed by `parse`), model name, in that order."""
        arrived = time.monotonic()
        state, ens = ready(request)
        req = parse(await json_body(request, state.max_body_bytes))
        return cls(request, state, ens, state.served(req.model), arrived), req

    def engine_request(self, req: BaseModel, limit_name: str | None = None, **inputs: Any) -> EngineRequest:
        """The engine's Request (`build_request`, as at every door): OpenAI's fields by the engine's shared
        semantics, the SAFE knobs by their own names over the request's `preset`, over the server's defaults.
        `limit_name`: what the request calls its token limit, for the error when it is too large."""
        options = {k: v for k, v in inputs.items() if v is not None}
        for name in ("max_tokens", "temperature", "top_p", "seed", "stop", *LOGPROBS_AND_PENALTIES):
            if getattr(req, name, None) is not None:
                options[name] = getattr(req, name)
        options.update(req.model_extra or {})  # SAFE knobs, preset (parse_request refused any other extra field)
        try:
            request = build_request(config=self.state.defaults, **options)
        except SafeEngineError as err:
            if limit_name and err.option == "max_tokens":  # the request's own name for it
                message = str(err).replace("max_tokens", limit_name)
                raise RequestError(400, message, param=limit_name, code="invalid_value") from None
            raise RequestError(400, str(err), param=err.option, code="invalid_value") from None
        window = self.ens.context_window
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

    async def start(self, requests: list[EngineRequest], n: int) -> Batch:
        """Admit and start n choices per engine request (503 at once when the queue is full)."""
        return await Batch.start(self.state, self.ens, requests, n, self.arrived)

    async def results(self, batch: Batch) -> list[GenerationResult]:
        """Every choice's result; the choices are cancelled if the client leaves or the server stops."""
        return await batch.run(interruption(self.state, self.request))
