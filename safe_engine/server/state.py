"""What the endpoints of one app share: the ensemble (None while it loads), the settings, the count of
admitted requests and the shutdown deadline.

Why one object on `app.state.safe` rather than closure variables: the endpoints are plain module-level
functions that reach it through their request (`of(request)`), and the runner sets the shutdown deadline
on the same object from outside the app.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import Request

from ..config import GenerationConfig
from ..engine.ensemble import Ensemble
from . import openai_shapes as shapes
from .metrics import Metrics
from .schemas import RequestError

DEFAULT_STREAM_IDLE_TIMEOUT_S = 60.0


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
    # How long a stream's next chunk may wait for the client to read (None: no limit); see streaming.py.
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

    def loaded(self) -> Ensemble:
        """The ensemble, or a 503: the server is shutting down, or the ensemble is loading or failed to."""
        if self.shutdown_deadline is not None:
            raise RequestError(503, "the server is shutting down", code="server_shutdown", type="server_error")
        if self.ensemble is None:
            if self.load_error is not None:
                message = f"the ensemble failed to load: {self.load_error}"
                raise RequestError(503, message, code="model_load_failed", type="server_error")
            raise RequestError(
                503, "the ensemble is still loading; retry shortly", code="model_loading", type="server_error"
            )
        return self.ensemble

    def served(self, model: str | None) -> str:
        """The served name; a request for another model is a 404 (no model field means the served one)."""
        name = self.name
        if model is not None and model != name:
            raise RequestError(
                404,
                f"model {model!r} is not served here; this server serves {name!r} (GET /v1/models lists it)",
                param="model",
                code="model_not_found",
            )
        return name


def of(request: Request) -> ServerState:
    """The state of the app serving `request` (set by `create_app`)."""
    state: ServerState = request.app.state.safe
    return state


def drafter_name(ens: Ensemble) -> str:
    """The drafter's name: usage and metrics count tokens in the drafter's tokenization."""
    return ens.names[ens.drafter_index]
