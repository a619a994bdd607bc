"""Engine streams run in worker threads, read on the event loop.

Why threads: a round of decoding is seconds of torch work that would block every other request on the
loop. Each request's `Ensemble.stream(...)` runs in one thread of a bounded pool (as many threads as the
batch the engine may form), and its `StreamEvent`s cross to the loop through an asyncio queue. When the
engine batches concurrent calls, the same calls from several threads join one batch; nothing here changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..engine.ensemble import StreamEvent, TextStream

_STARTED = object()
_END = object()
_TICK = object()


class Workers:
    """The bounded pool and counts of what it holds (for /health and for tests)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.pool = ThreadPoolExecutor(size, thread_name_prefix="safe-serve")
        self._lock = threading.Lock()
        self.waiting = 0  # submitted, no worker yet
        self.running = 0  # a worker is decoding it

    def _count(self, waiting: int, running: int) -> None:
        with self._lock:
            self.waiting += waiting
            self.running += running

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Interrupted(Exception):
    """A job stopped before its end: the client left or the server is shutting down (`reason`)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EngineJob:
    """One request's engine stream, run by a worker thread; read its events with `start` + `events`.

    `open_stream` is called in the worker (chat templates and tokenization are CPU work too). Whatever
    ends the job — its end, an error, `cancel()` — closes the stream, which frees the request's caches.
    """

    def __init__(self, workers: Workers, open_stream: Callable[[], TextStream]) -> None:
        self._workers = workers
        self._open = open_stream
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._cancelled = threading.Event()
        self._stream: TextStream | None = None
        self._getter: asyncio.Future | None = None
        self._submitted = False
        self._checked = time.monotonic()

    # -- worker side ------------------------------------------------------------------------------------
    def _post(self, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for this request any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _work(self) -> None:
        self._workers._count(-1, +1)
        try:
            if self._cancelled.is_set():
                return
            self._stream = self._open()
            if self._cancelled.is_set():  # cancelled while the stream was being opened
                return
            self._post(_STARTED)
            for event in self._stream.events():
                self._post(event)
                if self._cancelled.is_set():
                    return
        except BaseException as err:
            self._post(err)
        finally:
            if self._stream is not None:
                self._stream.close()
            self._workers._count(0, -1)
            self._post(_END)

    # -- loop side --------------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the job: the worker stops after the round in progress; the caches are freed now or then."""
        self._cancelled.set()
        if self._stream is not None:
            self._stream.close()
        if self._getter is not None:
            self._getter.cancel()
            self._getter = None

    async def _next(self, tick: float) -> Any:
        """The next item from the worker, or _TICK after `tick` seconds without one."""
        if self._getter is None:
            self._getter = asyncio.ensure_future(self._queue.get())
        done, _ = await asyncio.wait({self._getter}, timeout=tick)
        if not done:
            return _TICK
        item = self._getter.result()
        self._getter = None
        return item

    async def _item(self, check: Callable[[], Any], tick: float) -> Any:
        """The next item; `check` runs every `tick` seconds, whether items keep coming or not."""
        while True:
            if time.monotonic() - self._checked >= tick:
                self._checked = time.monotonic()
                reason = await check()
                if reason:
                    self.cancel()
                    raise Interrupted(reason)
            item = await self._next(tick)
            if item is not _TICK:
                if isinstance(item, BaseException):
                    raise item
                return item

    async def start(self, check: Callable[[], Any], tick: float = 0.25) -> None:
        """Submit the job and wait until its stream is open (errors in the request are raised here).

        `check` is awaited every `tick` seconds of waiting; a truthy answer (a reason) cancels the job.
        """
        if not self._submitted:
            self._submitted = True
            self._workers._count(+1, 0)
            self._loop.run_in_executor(self._workers.pool, self._work)
        item = await self._item(check, tick)
        if item is not _STARTED:  # the worker ended without opening a stream (cancelled)
            raise Interrupted("cancelled")

    async def events(self, check: Callable[[], Any], tick: float = 0.25) -> AsyncIterator[StreamEvent]:
        """The stream's events after `start`; the last one carries the result."""
        while True:
            item = await self._item(check, tick)
            if item is _END:
                raise Interrupted("cancelled")  # ended without a result: cancelled under us
            yield item
            if item.result is not None:
                return
