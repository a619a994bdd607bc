"""Streamed replies: the server-sent events of the three generating endpoints, and the response that sends them.

Why one frame for all three streams (`_framed`): once the 200 is sent, an error can only travel as an
event, and however a stream ends its batch must be closed at once, so that the generations behind it are
cancelled and their caches freed. Each endpoint supplies only its chunks and the shape of its error event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastapi.responses import Response, StreamingResponse

from ..stats import chat_logprobs, completion_logprobs
from . import openai_shapes as shapes
from . import responses as rsp
from .batch import Batch, Check, choice_events, stream_check
from .schemas import RequestError
from .state import ServerState

_log = logging.getLogger("safe_engine.server")
Chunks = AsyncGenerator[bytes, None]


# -- the three streams -----------------------------------------------------------------------------------------
def chat(batch: Batch, state: ServerState, name: str, include_usage: bool) -> Response:
    """A chat completion's stream (`data:` chunks, then `data: [DONE]`)."""
    return _openai_stream(batch, state, _chat_chunks(batch, stream_check(state), name, include_usage))


def completions(batch: Batch, state: ServerState, name: str, include_usage: bool, echo: list[str] | None) -> Response:
    """A text completion's stream (`data:` chunks, then `data: [DONE]`)."""
    chunks = _completion_chunks(batch, stream_check(state), name, include_usage, echo)
    return _openai_stream(batch, state, chunks)


def responses(batch: Batch, state: ServerState, echo: dict[str, Any]) -> Response:
    """A Responses API stream: OpenAI's typed events, numbered by `sequence_number`, with no `[DONE]`."""
    events = rsp.EventWriter(echo)
    chunks = _response_chunks(batch, stream_check(state), events)
    body = _framed(batch, chunks, lambda err: shapes.sse_event(events.error(err.message, err.code)), end=None)
    return _sse(body, batch, state)


def _openai_stream(batch: Batch, state: ServerState, chunks: Chunks) -> Response:
    """Chat and completions streams: an error is one `data:` chunk with OpenAI's error body; `[DONE]` ends all."""

    def error(err: RequestError) -> bytes:
        return shapes.sse(shapes.error_body(err.message, err.type, err.param, err.code))

    return _sse(_framed(batch, chunks, error, end=shapes.sse("[DONE]")), batch, state)


async def _framed(batch: Batch, chunks: Chunks, error: Callable[[RequestError], bytes], end: bytes | None) -> Chunks:
    """`chunks`, then `end`; a refusal or failure after the 200 travels as the `error` event, as OpenAI's
    streams do. However the stream ends, its batch is closed."""
    try:
        async for chunk in chunks:
            yield chunk
    except RequestError as err:
        yield error(err)
    finally:
        await chunks.aclose()
        await batch.close()
    if end is not None:
        yield end


async def _chat_chunks(batch: Batch, check: Check, name: str, include_usage: bool) -> Chunks:
    """Each choice's chunks carry its `index`, interleaved as the choices decode."""
    rid, created = shapes.new_id("chatcmpl"), shapes.now()
    for choice in batch.choices:
        yield shapes.sse(shapes.chat_chunk(rid, name, created, {"role": "assistant", "content": ""}, i=choice.index))
    async for choice, event in choice_events(batch, check):
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
        usage, safe = batch.usage(batch.results()), shapes.safe_stats(batch.results()[0])
        yield shapes.sse(shapes.chat_chunk(rid, name, created, None, usage=usage, safe=safe))


async def _completion_chunks(
    batch: Batch, check: Check, name: str, include_usage: bool, echo: list[str] | None
) -> Chunks:
    """The echoed prompt first (with `echo`), then each choice's deltas by `index`."""
    rid, created = shapes.new_id("cmpl"), shapes.now()
    if echo is not None:
        for choice in batch.choices:
            yield shapes.sse(shapes.completion_chunk(rid, name, created, echo[choice.prompt_index], i=choice.index))
    # characters of each choice's text so far (the logprobs' text_offset; an echoed prompt counts)
    offsets = {c.index: len(echo[c.prompt_index]) if echo else 0 for c in batch.choices}
    async for choice, event in choice_events(batch, check):
        i, result = choice.index, event.result
        if event.delta or result is None or event.logprobs:
            logprobs = completion_logprobs(event.logprobs, offsets[i]) if event.logprobs is not None else None
            yield shapes.sse(shapes.completion_chunk(rid, name, created, event.delta, i=i, logprobs=logprobs))
            offsets[i] += len(event.delta)
        if result is None:
            continue
        safe = shapes.safe_stats(result)
        yield shapes.sse(shapes.completion_chunk(rid, name, created, "", shapes.finish_reason(result), i=i, safe=safe))
    if include_usage:
        usage, safe = batch.usage(batch.results()), shapes.safe_stats(batch.results()[0])
        yield shapes.sse(shapes.completion_chunk(rid, name, created, None, usage=usage, safe=safe))


async def _response_chunks(batch: Batch, check: Check, events: rsp.EventWriter) -> Chunks:
    for body in events.begin():
        yield shapes.sse_event(body)
    async for _, event in choice_events(batch, check):
        if event.content:
            for body in events.text(event.content):
                yield shapes.sse_event(body)
        if event.result is not None:
            for body in events.end(event.result, batch.usage([event.result])):
                yield shapes.sse_event(body)


# -- the response ----------------------------------------------------------------------------------------------
class StreamStalled(Exception):
    """A stream's client stopped reading (without leaving) for longer than the server's idle timeout."""


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator and its batch, even when the client vanished
    before the body started, so the generations behind it are cancelled and their caches freed right away.

    A client that stops reading but keeps its connection open fills the socket's buffers, and then each
    `send` waits for it. Past `idle_timeout` seconds of such a wait the stream ends: the request is
    cancelled (caches freed, its batch slot given to others) and the connection closed (nothing more can
    be said to a client that does not read). Until then the request decodes on as usual."""

    def __init__(self, body: Chunks, batch: Batch, idle_timeout: float | None, **kwargs: Any) -> None:
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


def _sse(body: Chunks, batch: Batch, state: ServerState) -> Response:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return _SSEResponse(body, batch, state.stream_idle_timeout, media_type="text/event-stream", headers=headers)
