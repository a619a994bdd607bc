"""The choices of one HTTP request, run together: admission, the event loop, their results and usage.

Every choice of a request (`n`, the prompts of a completions request) is one request to the engine,
submitted together so that they decode in one batch; `max_queue` bounds how many may wait for the batch
(beyond it: 503). Streaming and non-streaming endpoints read the same loop (`choice_events`): it checks
for a client that left or a server that stops, and however it ends, every choice is cancelled and its
place in the queue given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

from fastapi import Request

from ..engine.ensemble import AsyncTextStream, Ensemble
from ..errors import SafeEngineError
from ..shaping.reply import StreamEvent
from ..shaping.request import Request as EngineRequest
from ..stats import GenerationResult
from .http import RETRY_AFTER_S, engine_error
from .schemas import MAX_CHOICES, RequestError
from .state import ServerState, drafter_name


# -- interruptions ---------------------------------------------------------------------------------------------
class Interrupted(Exception):
    """A request stopped before its end: the client left or the server is shutting down (`reason`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


Check = Callable[[], Awaitable[str | None]]


def interruption(state: ServerState, request: Request) -> Check:
    """Why a request should stop now: the server is shutting down or the client left (None: go on)."""

    async def check() -> str | None:
        if state.stopping():
            return "shutdown"
        return "disconnected" if await request.is_disconnected() else None

    return check


def stream_check(state: ServerState) -> Check:
    async def check() -> str | None:  # a client that leaves is seen by Starlette, which cancels the body
        return "shutdown" if state.stopping() else None

    return check


def _interrupted(err: Interrupted) -> RequestError:
    if err.reason == "shutdown":
        return RequestError(
            503, "the server is shutting down; retry later", code="server_shutdown", type="server_error"
        )
    return RequestError(499, "the client closed the request", code="client_closed", type="invalid_request_error")


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


# -- the batch -------------------------------------------------------------------------------------------------
@dataclass
class Choice:
    """One choice of a request: its engine stream, which prompt it answers, when its first token came."""

    index: int
    prompt_index: int
    stream: AsyncTextStream
    first_token: float | None = None
    result: GenerationResult | None = None


@dataclass
class Batch:
    """The choices of one HTTP request, decoded together; `close` (idempotent) cancels what is still running
    and gives their places in the queue back."""

    state: ServerState
    choices: list[Choice]
    arrived: float
    drafter: str  # usage and metrics count in the drafter's tokenization
    held: int = 0  # places in `state.admitted` still held

    @classmethod
    async def start(
        cls, state: ServerState, ens: Ensemble, requests: list[EngineRequest], n: int, arrived: float
    ) -> Batch:
        """Admit and start every choice (n per request, prompt-major, as OpenAI numbers them): refused at once
        with a 503 when the queue is full, a plain 4xx when the engine refuses an input."""
        count = _admit(state, ens, len(requests), n)
        batch = cls(state, [], arrived, drafter_name(ens), held=count)
        try:
            for p, request in enumerate(requests):
                for copy in _copies(request, n):
                    batch.choices.append(Choice(len(batch.choices), p, ens.astream(copy)))
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

    async def run(self, check: Check) -> list[GenerationResult]:
        """Run every choice of a non-streaming request to its result; a client that leaves cancels them all."""
        async for _ in choice_events(self, check):
            pass
        finished = self.results()
        if len(finished) != len(self.choices):
            raise RequestError(500, "a generation ended without a result", code="internal_error", type="server_error")
        return finished

    async def close(self) -> None:
        for choice in self.choices:
            await choice.stream.aclose()
        self.release(self.held)

    def release(self, count: int) -> None:
        count = min(count, self.held)
        self.held -= count
        self.state.admitted -= count

    def finished(self, choice: Choice, result: GenerationResult) -> None:
        choice.result = result
        prompt_tokens = int(result.stats.prompt_tokens.get(self.drafter, 0))
        self.state.metrics.finished(result, prompt_tokens, choice.first_token, time.monotonic(), self.arrived)
        self.release(1)

    def results(self) -> list[GenerationResult]:
        """The results of the choices that have finished, in choice order."""
        return [c.result for c in self.choices if c.result is not None]

    def usage(self, results: list[GenerationResult]) -> dict[str, int]:
        """OpenAI's usage for several choices: each prompt's tokens once (the n choices of a prompt share it),
        every choice's completion tokens."""
        prompt = completion = 0
        counted: set[int] = set()
        for choice, result in zip(self.choices, results):
            if choice.prompt_index not in counted:
                counted.add(choice.prompt_index)
                prompt += int(result.stats.prompt_tokens.get(self.drafter, 0))
            completion += int(result.stats.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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


def _admit(state: ServerState, ens: Ensemble, prompts: int, n: int) -> int:
    """How many choices the request holds places for: a 400 past what one request may ask, a 503 (at once,
    nothing submitted) when the queue has no room for them."""
    count = prompts * n
    if count > MAX_CHOICES:
        raise RequestError(
            400,
            f"{prompts} prompts x n={n} is {count} choices; at most {MAX_CHOICES} per request",
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
    return count


# -- the event loop --------------------------------------------------------------------------------------------
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


async def choice_events(batch: Batch, check: Check) -> AsyncIterator[tuple[Choice, StreamEvent]]:
    """The events of every choice as they come, each with its choice; the batch is closed however this ends."""
    sources = {c.index: _events(c.stream, check) for c in batch.choices}
    pending: dict[asyncio.Future[StreamEvent], Choice] = {}
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
