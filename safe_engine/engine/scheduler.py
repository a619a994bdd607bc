"""Continuous batching: one thread at a time runs the rounds of every live request together.

Requests come from any thread (`generate`, `stream`) or asyncio task (`agenerate`, `astream`). Each one
joins at the next round and leaves when it finishes, fails or is cancelled; a round batches its phases over
all live requests (`rounds.run_round`), so eight requests cost about as many forward passes as one, each
a little wider. The rounds run on a worker thread that exists only while there is work, or, for a blocking
`generate`, on the caller's own thread while no other thread runs them (`Scheduler.lead`); the
interpreter's exit cancels what is left.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import cast

from ..algorithm.decoding import Generation
from ..errors import ConfigError, InputError
from ..runtime.placement import engine_thread, lent_thread
from ..shaping.reply import Reply, StreamEvent
from ..stats import GenerationResult, TokenLogprob
from .memory import release_free_memory
from .rounds import run_round

_EXIT_WAIT_S = 30.0  # at interpreter exit, how long the last (cancelled) round may take to end


class Ticket:
    """One submitted request: its Generation, and the `StreamEvent`s published for it after every round.

    `events` / `aevents` are the one reader of a request's events (every door reads through them): they
    yield each event until the one with the result, and raise the request's error instead of yielding it.
    """

    def __init__(self, generation: Generation, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.generation = generation
        self.reservation = generation.reserved_positions()  # what it may hold in members' shared pools
        self.reply = Reply(generation.request)
        self._emitted = 0
        self._emitted_bytes = 0  # UTF-8 bytes of the emitted text, and the logprob entries emitted with it
        self._emitted_logprobs = 0
        self._loop = loop
        # read by `events` (a SimpleQueue, without a loop) or by `aevents` (an asyncio.Queue, with one)
        self._events: queue.SimpleQueue[StreamEvent] | asyncio.Queue[StreamEvent] = (
            asyncio.Queue() if loop is not None else queue.SimpleQueue()
        )
        self.done = False

    def publish(self) -> bool:
        """Hand the reader what this round produced; True once the request is over."""
        gen = self.generation
        if gen.error is None and not gen.finished and gen.cancelled:
            gen.fail(InputError("this generation was cancelled; start a new one"))
        visible = gen.visible_text()
        delta, self._emitted = visible[self._emitted :], len(visible)
        self.done = gen.error is not None or gen.finished  # before the reader can hear of it
        if gen.error is not None:
            self._put(StreamEvent("", error=gen.error))
        elif gen.finished:
            result = gen.result()
            rest = None if result.logprobs is None else result.logprobs[self._emitted_logprobs :]
            self._put(self.reply.final(delta, result, rest))
        elif delta:
            self._put(self.reply.event(delta, self._logprobs(delta)))
        return self.done

    def _logprobs(self, delta: str) -> list[TokenLogprob] | None:
        """The logprob entries of the tokens that end within the text emitted so far (a token cut inside a
        character waits for the delta that completes the character)."""
        logprobs = self.generation.logprobs
        if logprobs is None:
            return None
        self._emitted_bytes += len(delta.encode("utf-8"))
        entries = logprobs.upto(self._emitted_logprobs, self._emitted_bytes)
        self._emitted_logprobs += len(entries)
        return entries

    def _put(self, event: StreamEvent) -> None:
        if self._loop is None:
            cast("queue.SimpleQueue[StreamEvent]", self._events).put(event)  # no loop: the sync queue
            return
        with contextlib.suppress(RuntimeError):  # the reader's event loop is closed: nobody is listening
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def events(self) -> Iterator[StreamEvent]:
        """The request's events as they come (blocking), the last one with the result."""
        events = cast("queue.SimpleQueue[StreamEvent]", self._events)  # a ticket submitted without a loop
        while True:
            event = events.get()
            if event.error is not None:
                raise event.error
            yield event
            if event.result is not None:
                return

    async def aevents(self) -> AsyncIterator[StreamEvent]:
        """`events` for a ticket submitted with an event loop."""
        events = cast("asyncio.Queue[StreamEvent]", self._events)  # a ticket submitted with a loop
        while True:
            event = await events.get()
            if event.error is not None:
                raise event.error
            yield event
            if event.result is not None:
                return

    def cancel(self) -> None:
        self.generation.cancel()


class Scheduler:
    """Admits up to `max_batch_size` live requests (as many as members' shared KV pools hold: `Ticket.reservation`)
    and steps them round by round in one worker thread."""

    def __init__(self, max_batch_size: int) -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        self.max_batch_size = max_batch_size
        self._cond = threading.Condition()
        self._waiting: deque[Ticket] = deque()
        self._live: list[Ticket] = []
        self._worker: threading.Thread | None = None  # the thread running rounds: a worker, or a caller leading
        self._ending: threading.Thread | None = None  # the last worker, which may still be returning
        self._leader: threading.Thread | None = None  # a caller's thread running the rounds (`lead`), not ours
        _schedulers.add(self)

    def submit(
        self, generation: Generation, loop: asyncio.AbstractEventLoop | None = None, lead: bool = False
    ) -> Ticket:
        """Queue a request for the next round. `lead`: the caller blocks on it next and will run the rounds on
        its own thread (`lead`) unless a thread runs them already; otherwise a worker thread starts if none runs."""
        ticket = Ticket(generation, loop)
        with self._cond:
            self._waiting.append(ticket)
            if self._worker is None and not lead:
                self._start_worker()
        return ticket

    def _start_worker(self) -> None:
        """A worker thread for the rounds (called with the lock held, when no thread runs them)."""
        self._worker = threading.Thread(target=self._run, name="safe-scheduler", daemon=True)
        self._worker.start()

    def lead(self, tickets: Sequence[Ticket]) -> None:
        """Run the rounds on the calling thread until `tickets` are over, unless another thread runs them
        already; hand what is left then to a worker thread. The caller's requests share these rounds with any
        that join meanwhile, as they would on a worker.

        Why the caller's thread: torch runs a forward's operators on an OpenMP thread team that belongs to the
        thread calling it and stays docked there afterwards. With a docked team on one thread (a caller that
        ran `generate` of transformers, an embedding model...) libgomp counts more threads than cores and
        throttles every other thread's team, whose workers then sleep and wake at each operator: on the 2-core
        Xeon the engine's worker thread decoded at about half the speed of the caller's own thread. Decoding
        where the caller's team already is uses it instead of adding a second one."""
        me = threading.current_thread()
        with self._cond:
            if self._worker is not None:
                return
            self._worker = self._leader = me
        try:
            with lent_thread():  # the placement may set this thread's count, put back when it returns
                while not all(t.done for t in tickets) and self._round(leader=True):
                    pass
        finally:
            with self._cond:
                if self._worker is me:
                    self._worker = None
                    if self._live or self._waiting:
                        self._start_worker()
                idle = self._worker is None
                if self._leader is me:  # (another caller may lead already, once `_round` found nothing left)
                    self._leader = None
                self._cond.notify_all()
            if idle:  # what the requests freed goes back to the OS, as a worker does when it ends
                release_free_memory()

    @property
    def running(self) -> int:
        """Requests being decoded now (at most `max_batch_size`)."""
        with self._cond:
            return sum(not t.done for t in self._live)

    @property
    def waiting(self) -> int:
        """Requests submitted and waiting for a free slot in the batch."""
        with self._cond:
            return len(self._waiting)

    @property
    def open_requests(self) -> int:
        """Requests submitted and not over yet (each holds its KV caches)."""
        with self._cond:
            return sum(not t.done for t in (*self._waiting, *self._live))

    def cancel_all(self) -> None:
        """Cancel every live and waiting request: each ends, with its caches freed, at the next round."""
        with self._cond:
            for ticket in (*self._waiting, *self._live):
                ticket.cancel()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the worker thread has ended (nothing live or waiting); False if it still runs.

        Why: the worker is a daemon thread, and a process that exits while it is inside a round of torch
        work can abort in the interpreter's teardown (SIGABRT instead of a clean exit status).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:  # a caller leading the rounds returns on its own: wait for it to hand them over
            if not self._cond.wait_for(lambda: self._leader is None, timeout):
                return False
        return _join_within(self._workers(), None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _workers(self) -> list[threading.Thread]:
        """The worker threads that run or ran rounds and may still be returning (not a caller leading)."""
        with self._cond:
            running = None if self._worker is self._leader else self._worker
            return [w for w in (running, self._ending) if w is not None]

    def _run(self) -> None:
        engine_thread()  # the placement may set this thread's torch thread count
        while self._round():
            pass
        # Idle: what the requests freed goes back to the OS (glibc keeps it in its arenas otherwise, and a
        # server grows wave after wave). Nothing of theirs is referenced any more: `_round`'s frame is gone.
        release_free_memory()

    def _fits(self, ticket: Ticket) -> bool:
        """Whether a request's reserved positions fit beside the live requests' in every member whose requests
        share one pool (a llama.cpp context); a request alone always does (it fits its members' windows). In
        submission order: a later, smaller request does not overtake one that waits for room."""
        if not self._live:
            return True
        for member, need in ticket.reservation:
            held = sum(n for live in self._live for m, n in live.reservation if m is member)
            if member.positions is not None and held + need > member.positions:
                return False
        return True

    def _round(self, leader: bool = False) -> bool:
        """Admit waiting requests and run one round of the live ones; False (the worker, or the `leader`,
        stops) when none is left."""
        with self._cond:
            while self._waiting and len(self._live) < self.max_batch_size and self._fits(self._waiting[0]):
                self._live.append(self._waiting.popleft())
            if not self._live:
                self._worker, self._ending = None, self._ending if leader else self._worker
                return False
            live = list(self._live)
        ready = [t for t in live if not t.generation.cancelled]
        try:
            if ready:
                run_round([t.generation for t in ready])
        except BaseException as err:  # not a request's own failure (those stay in generation.error)
            for t in live:
                t.generation.fail(err)
        over = [t for t in live if t.publish()]
        with self._cond:
            self._live = [t for t in self._live if t not in over]
        return True


_schedulers: weakref.WeakSet[Scheduler] = weakref.WeakSet()  # a running worker keeps its scheduler alive


@atexit.register
def end_decoding_at_exit(timeout: float = _EXIT_WAIT_S) -> None:
    """Cancel whatever is still decoding and wait (bounded) for its round to end.

    Why: the worker is a daemon thread, and an interpreter that tears down while it is inside torch work can
    abort (SIGABRT) instead of exiting cleanly, e.g. a script that ends or is interrupted mid-stream.
    Non-daemon threads are joined before atexit runs, so their own requests are not cut short.
    """
    schedulers = list(_schedulers)
    for scheduler in schedulers:
        scheduler.cancel_all()
    _join_within([w for scheduler in schedulers for w in scheduler._workers()], timeout)


def _join_within(threads: list[threading.Thread], timeout: float | None) -> bool:
    """Join `threads` under one deadline for them all; True if none is alive after it."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


def collect(ticket: Ticket) -> GenerationResult:
    """Block until the request is over (the rounds run elsewhere, or ran here: `Scheduler.lead`); its result,
    or its error raised here."""
    for event in ticket.events():
        if event.result is not None:
            return event.result
    raise AssertionError("a request's events end with its result")
