"""The server's Prometheus metrics (`GET /metrics`), in a registry of the app's own.

Why a registry per app: prometheus-client's default registry is process-wide, so two apps in one process
(tests, notebooks) would clash over the metric names or mix their counts. Counters and histograms are
updated as requests end; the queue and batch gauges are read from the ensemble when scraped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..stats import GenerationResult

__all__ = ["CONTENT_TYPE_LATEST", "Metrics", "MetricsMiddleware"]

# Seconds: the first token comes after the prompt's prefill (fast on a GPU, seconds on a busy CPU).
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health", "/metrics")


class Metrics:
    """The counters, gauges and histograms of one app; `text()` is what /metrics serves."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "safe_requests", "HTTP requests by endpoint and response status", ["endpoint", "status"], registry=r
        )
        self.rejected = Counter(
            "safe_queue_rejected_requests", "requests refused with 503 because the queue was full", registry=r
        )
        self.prompt_tokens = Counter("safe_prompt_tokens", "prompt tokens (drafter's tokenization)", registry=r)
        self.generated_tokens = Counter("safe_generated_tokens", "generated tokens (drafter's)", registry=r)
        self.ensembled_tokens = Counter(
            "safe_ensembled_tokens", "generated tokens decided by the ensemble (at an ensemble point)", registry=r
        )
        self.choices = Counter(
            "safe_generations", "generations run (one per choice) by outcome", ["outcome"], registry=r
        )
        self.ttft = Histogram(
            "safe_time_to_first_token_seconds",
            "from the request's arrival to its first verified token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "safe_time_per_output_token_seconds",
            "after the first token, seconds per further generated token",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.waiting = Gauge("safe_queue_depth", "requests waiting for a slot in the batch", registry=r)
        self.running = Gauge("safe_running_requests", "requests in the running batch", registry=r)
        self.batch_size = Gauge("safe_max_batch_size", "the batch's size (requests decoded at once)", registry=r)
        self.occupancy = Gauge("safe_batch_occupancy", "running requests / max batch size (0..1)", registry=r)

    def watch(self, running: Callable[[], float], waiting: Callable[[], float], size: Callable[[], float]) -> None:
        """Read the gauges from the ensemble when scraped."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.batch_size.set_function(size)
        self.occupancy.set_function(lambda: running() / max(size(), 1))

    def finished(
        self, result: GenerationResult, prompt_tokens: int, first: float | None, end: float, start: float
    ) -> None:
        """One generation's counts and timings (`first`: when its first token came, None if none did)."""
        tokens = int(result.stats.tokens)
        self.choices.labels("finished").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(tokens)
        self.ensembled_tokens.inc(int(result.stats.ensembled_tokens))
        if first is not None:
            self.ttft.observe(max(first - start, 0.0))
            if tokens > 1:
                self.tpot.observe(max(end - first, 0.0) / (tokens - 1))

    def text(self) -> bytes:
        return generate_latest(self.registry)


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


class MetricsMiddleware:
    """Counts every HTTP response by endpoint and status (a pure ASGI middleware: it sees the status line and
    nothing else, so streaming and disconnect detection work as without it)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(
        self, scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else ("/v1/models/{name}" if path.startswith("/v1/models/") else "other")
        status = {"code": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(endpoint, str(status["code"])).inc()
