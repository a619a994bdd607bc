"""The `Ensemble` facade: members + settings in, text and stats out, sync, streaming or async."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, cast

import torch

from ..algorithm.aggregation import UnionVocab
from ..algorithm.decoding import Generation
from ..algorithm.lineup import Lineup
from ..errors import ConfigError, InputError, InputTypeError
from ..runtime.llamacpp import load_llamacpp_member, local_runtime
from ..runtime.members import Member, ModelSpec, check_device, load_member, resolve_spec, unique_names
from ..runtime.placement import (
    Placement,
    default_threads,
    engine_thread,
    measure_forwards,
    plan_placement,
    thread_counts,
    threads_chosen_by_user,
)
from ..runtime.quantization import check_quantization
from ..shaping.reply import StreamEvent
from ..shaping.request import Request, build_request
from ..stats import EnsembleStats, GenerationResult
from .gauge import ScheduleGauge
from .memory import release_free_memory
from .scheduler import Scheduler, Ticket, collect


class Ensemble:
    """Several causal LMs, possibly with different tokenizers, decoding as one.

    Thread-safe for concurrent requests: members are read-only; every request has its own caches, and
    requests running at the same time share each forward pass (continuous batching, up to `max_batch_size`
    live requests; more wait for a free slot).
    """

    def __init__(
        self,
        members: Sequence[Member],
        drafter: int = 0,
        weights: Sequence[float] | None = None,
        max_batch_size: int = 8,
    ) -> None:
        members = list(members)
        if not members:
            raise ConfigError("an Ensemble needs at least one Member")
        for i, m in enumerate(members):
            if not isinstance(m, Member):
                raise InputTypeError(f"members[{i}] is a {type(m).__name__}; wrap models as Member(model, tokenizer)")
        if isinstance(drafter, bool) or not isinstance(drafter, int) or not 0 <= drafter < len(members):
            raise ConfigError(f"drafter must be an index in [0, {len(members) - 1}], got {drafter!r}")
        self.members = members
        self.drafter_index = drafter
        self.weights = _weights(weights, len(members))
        self.names = unique_names([m.name for m in members])
        self._union: UnionVocab | None = None
        self._lock = threading.Lock()
        # Forwards of different members run at once (each releases the GIL): verifiers on different devices,
        # and the verifiers behind the drafter in the overlap schedule.
        self._executor = ThreadPoolExecutor(
            max(2, len(members)), thread_name_prefix="safe-forward", initializer=engine_thread
        )
        self._parallel_members = len({str(m.device) for m in members}) > 1
        self.placement = _placement(members, drafter)
        self._schedule_gauge = ScheduleGauge()  # which schedule is faster here: timed on the requests' rounds
        self._scheduler = Scheduler(max_batch_size)

    @property
    def max_batch_size(self) -> int:
        return self._scheduler.max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, size: int) -> None:
        self._scheduler.max_batch_size = Scheduler(size).max_batch_size  # validated as at construction

    @property
    def running_requests(self) -> int:
        """Requests being decoded now."""
        return self._scheduler.running

    @property
    def waiting_requests(self) -> int:
        """Requests waiting for a free slot in the batch."""
        return self._scheduler.waiting

    @property
    def open_requests(self) -> int:
        """Requests started and not over yet: each holds KV caches (0 once everything finished, failed or was
        closed)."""
        return self._scheduler.open_requests

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no request is being decoded (call it before the process exits, after cancelling
        what should not finish); False if decoding still runs after `timeout` seconds."""
        return self._scheduler.wait_idle(timeout)

    def measure_placement(self) -> Placement | None:
        """Time the members' forwards again and place the work from the new times; requests started afterwards
        use it. Why: the placement is measured once, when the ensemble is built, and the right thread counts
        move with the machine's load. Beside two busy processes, Qwen's 2-thread llama.cpp step on the 2-core
        Xeon took 3,140 ms against 63 ms at one thread. Call it between requests: timing beside running requests
        measures them too. A no-op (and the same answer) where the user chose torch's threads or the members
        are not all on the CPU."""
        self.placement = _placement(self.members, self.drafter_index, again=True, threads=default_threads())
        return self.placement

    @classmethod
    def from_pretrained(
        cls,
        specs: Sequence[str | ModelSpec],
        drafter: int = 0,
        weights: Sequence[float] | None = None,
        device_map: str | Sequence[str | None] | None = None,
        dtype: str | torch.dtype | None = None,
        trust_remote_code: bool = False,
        backend: str | Sequence[str] = "auto",
        ray_address: str | None = None,
        member_resources: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
        member_timeout_s: float | None = None,
        max_batch_size: int = 8,
        quantization: Any = None,
        kv_positions: int | None = None,
    ) -> Ensemble:
        """Load members from hub ids, directories, .gguf files, demo names or ModelSpecs.

        `quantization="int8"` loads every member whose ModelSpec does not say otherwise with int8 linear
        layers on the CPU (bitsandbytes 8-bit on a GPU, untested here); see docs/quantization.md.

        `backend` (for all members, or a list with one per member; a ModelSpec's own wins): "auto" runs a GGUF
        source (a .gguf file, a demo name) on the CPU in llama.cpp when llama-cpp-python is installed
        (docs/llamacpp.md) and anything else in torch; "torch" and "llama.cpp" choose.
        backend="ray" loads members in Ray actors on the
        cluster at `ray_address` ("auto", "ray://host:10001"; None: the current or a new local one), with
        `member_resources` per actor (a dict for all, or a list per member, e.g. {"num_gpus": 1}) and
        `member_timeout_s` per actor call (default 120 s). See docs/ray.md.

        `kv_positions`: the most KV positions each llama.cpp member's context holds for all its requests together
        (default: one request's window, 4,096; the context starts at 256 and doubles as its requests hold more);
        more lets more long requests decode at once, for more KV memory (docs/llamacpp.md). Refused where no
        member runs in llama.cpp.
        """
        if isinstance(specs, str | ModelSpec) or not isinstance(specs, Sequence) or not specs:
            raise InputTypeError("specs must be a non-empty list of model specs, e.g. ['smollm2-135m', 'gemma3-270m']")
        from ..runtime.ray import resolve_backends, start_ray_members

        devices = _devices(device_map, len(specs))
        resolved = [_quantized(resolve_spec(s), quantization) for s in specs]
        chosen = resolve_backends(backend, len(specs))
        backends = resolve_backends([s.backend or b for s, b in zip(resolved, chosen)], len(specs))  # a spec's wins
        for spec, dev, where in zip(resolved, devices, backends):  # all of them before loading any member
            check_quantization(spec.quantization, spec.dtype or dtype, spec.device or dev)
            if where != "ray":  # a Ray member's device is checked on its own node
                check_device(dev)
        runtimes = [
            where if where == "ray" else local_runtime(spec, where, dev, dtype)
            for spec, dev, where in zip(resolved, devices, backends)
        ]
        _check_kv_positions(kv_positions, runtimes)
        remote = [i for i, where in enumerate(runtimes) if where == "ray"]
        pending = None
        if remote:  # the actors load while the local members load here
            resources = member_resources
            if isinstance(member_resources, Sequence) and not isinstance(member_resources, str | dict):
                if len(member_resources) != len(specs):
                    raise ConfigError(f"member_resources lists {len(member_resources)} dicts for {len(specs)} members")
                resources = [member_resources[i] for i in remote]
            pending = start_ray_members(
                [resolved[i] for i in remote],
                devices=[None if device_map == "auto" else devices[i] for i in remote],
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                member_resources=resources,
                ray_address=ray_address,
                member_timeout_s=member_timeout_s,
            )
        try:
            members: list[Member | None] = [None] * len(specs)
            for i, (spec, dev, where) in enumerate(zip(resolved, devices, runtimes)):
                if where == "ray":
                    continue
                if where == "llama.cpp":
                    members[i] = load_llamacpp_member(spec, device=dev, dtype=dtype, positions=kv_positions)
                else:
                    members[i] = load_member(spec, device=dev, dtype=dtype, trust_remote_code=trust_remote_code)
            if pending is not None:
                for i, member in zip(remote, pending.wait(trust_remote_code)):
                    members[i] = member
        except BaseException:
            if pending is not None:
                pending.cancel()
            raise
        loaded = cast("list[Member]", members)  # every slot filled: local ones above, one Ray member per remote
        release_free_memory()  # what loading freed: conversions, float weights an int8 member replaced
        return cls(loaded, drafter=drafter, weights=weights, max_batch_size=max_batch_size)

    @property
    def drafter(self) -> Member:
        return self.members[self.drafter_index]

    @property
    def context_window(self) -> int | None:
        """The smallest context window of the members (None when no member declares one)."""
        windows = [m.context_window for m in self.members if m.context_window]
        return min(windows) if windows else None

    def __repr__(self) -> str:
        return f"Ensemble({self.names}, drafter={self.names[self.drafter_index]!r})"

    # -- public generation API --------------------------------------------------------------------------
    # Each method takes a `Request` (from `request`, or `safe_engine.shaping.request.build_request`), or
    # the same arguments as `request`: a prompt or messages=, tools=, tool_choice=, parallel_tool_calls=,
    # json_schema= / response_format=, config= and GenerationConfig fields (and their aliases) as keywords.
    def request(self, prompt: str | Request | None = None, **kwargs: Any) -> Request:
        """The checked `Request` for these arguments (see `build_request`); a Request passes through."""
        if isinstance(prompt, Request):
            if kwargs:
                raise InputError(f"pass a Request alone or the request's arguments, not both (got {sorted(kwargs)})")
            return prompt
        return build_request(prompt, **kwargs)

    def generate(self, prompt: str | Request | None = None, **kwargs: Any) -> GenerationResult:
        """Generate a completion of `prompt`, or the assistant's reply to `messages`.

        `tools` (OpenAI-style JSON schemas) with `tool_choice` ("auto": text or valid calls, "required",
        "none" or a tool name; `parallel_tool_calls=False`: one call at most) or `json_schema` /
        `response_format` constrain the output with a grammar (`shaping.constrained`), whichever member
        proposed the text; the result's `tool_calls` are the calls read back."""
        ticket = self._scheduler.submit(self._start(self.request(prompt, **kwargs)), lead=True)
        try:
            self._scheduler.lead([ticket])  # decode on this thread while no other runs the rounds
            return collect(ticket)
        finally:
            ticket.cancel()  # a no-op once it is over; after an interrupt (Ctrl-C) the request stops too

    def generate_batch(
        self, requests: Sequence[str | Sequence[dict[str, Any]] | Request], **kwargs: Any
    ) -> list[GenerationResult]:
        """Generate for many requests at once (each a prompt string, a messages list or a Request), decoded
        together; `kwargs` apply to every string and messages list.

        Every request is checked before any starts; if one fails while decoding, the others are cancelled
        and its error is raised."""
        if isinstance(requests, str | bytes) or not isinstance(requests, Sequence):
            raise InputTypeError("requests must be a list of prompt strings or message lists")
        started = []
        for item in requests:
            if isinstance(item, Request):
                started.append(self._start(self.request(item)))
            elif isinstance(item, str):
                started.append(self._start(self.request(item, **kwargs)))
            else:
                started.append(self._start(self.request(messages=item, **kwargs)))
        tickets = [self._scheduler.submit(gen, lead=True) for gen in started]
        try:
            self._scheduler.lead(tickets)
            return [collect(t) for t in tickets]
        finally:
            for t in tickets:
                t.cancel()  # a no-op for finished requests

    def stream(self, prompt: str | Request | None = None, **kwargs: Any) -> TextStream:
        """Iterator of verified text deltas; `.events()` gives the `StreamEvent`s (content with tool calls held
        back, the result last); `.result` holds the GenerationResult once exhausted."""
        return TextStream(self._scheduler.submit(self._start(self.request(prompt, **kwargs))))

    async def agenerate(self, prompt: str | Request | None = None, **kwargs: Any) -> GenerationResult:
        """`generate` off the event loop; cancelling the awaiting task stops decoding after the round."""
        stream = self.astream(prompt, **kwargs)
        async for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def astream(self, prompt: str | Request | None = None, **kwargs: Any) -> AsyncTextStream:
        """Async iterator of verified deltas; the request is checked now, tokenized in a worker thread and
        decoded in the scheduler's."""
        request = self.request(prompt, **kwargs)
        return AsyncTextStream(lambda: self._start(request), self._scheduler)

    # -- internals --------------------------------------------------------------------------------------
    def _start(self, request: Request) -> Generation:
        return Generation(self._lineup(), request)

    def _lineup(self) -> Lineup:
        return Lineup(
            self.members,
            self.names,
            self.drafter_index,
            self.weights,
            self._executor,
            self._parallel_members,
            self._schedule_gauge if self._spare_capacity() else None,
            self._union_vocab,
            self.placement,
        )

    def _spare_capacity(self) -> bool:
        """Whether verifiers can run beside the drafter: they sit on other devices, or the CPU placement left
        them cores of their own (schedule="auto" then times both schedules on a lone request)."""
        drafter = str(self.drafter.device)
        if any(str(m.device) != drafter for m in self.members):
            return True
        return self.placement is not None and self.placement.spare

    def _union_vocab(self) -> UnionVocab:
        with self._lock:
            if self._union is None:
                self._union = UnionVocab(self.members)
            return self._union


class TextStream:
    """Deltas of verified text of one request; closing it (or dropping it) cancels the request and frees its
    caches."""

    def __init__(self, ticket: Ticket) -> None:
        self._ticket = ticket
        self._events = ticket.events()
        self._closed = False
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        for event in self.events():
            if event.delta:
                return event.delta
        raise StopIteration

    @property
    def stats(self) -> EnsembleStats:
        """The request's statistics so far (final once the stream is exhausted)."""
        return self._ticket.generation.stats

    def events(self) -> Iterator[StreamEvent]:
        """The `StreamEvent`s, as soon as each is verified; the last one carries the result (its delta may be
        empty). Shares its position with the text iterator."""
        if self._closed and self.result is None:
            raise InputError("this stream was closed and its generation cancelled; start a new one")
        for event in self._events:
            self.result = event.result
            yield event

    def close(self) -> None:
        """Abandon the request (also called when the stream is garbage collected)."""
        if self.result is None:
            self._closed = True
            self._ticket.cancel()

    def __del__(self) -> None:
        self.close()


class AsyncTextStream:
    """`TextStream` for asyncio: events arrive on the event loop; `.result` once exhausted."""

    def __init__(self, start: Callable[[], Generation], scheduler: Scheduler) -> None:
        self._start = start
        self._scheduler = scheduler
        self._ticket: Ticket | None = None
        self._events: AsyncIterator[StreamEvent] | None = None
        self.result: GenerationResult | None = None

    def __aiter__(self) -> AsyncTextStream:
        return self

    async def __anext__(self) -> str:
        if self._events is None:
            self._events = self.events()
        async for event in self._events:
            if event.delta:
                return event.delta
        raise StopAsyncIteration

    @property
    def stats(self) -> EnsembleStats | None:
        """The request's statistics so far (None before the first delta was asked for)."""
        return self._ticket.generation.stats if self._ticket is not None else None

    async def start(self) -> None:
        """Tokenize and submit the request now (a worker thread tokenizes), so that an input the members
        refuse (too long for a context window, ...) raises here; `events` starts it otherwise."""
        if self._ticket is None:
            generation = await asyncio.to_thread(self._start)
            self._ticket = self._scheduler.submit(generation, asyncio.get_running_loop())

    async def events(self) -> AsyncGenerator[StreamEvent, None]:
        """The `StreamEvent`s, as soon as each is verified; the last one carries the result."""
        try:
            await self.start()
            assert self._ticket is not None
            async for event in self._ticket.aevents():
                self.result = event.result
                yield event
        finally:  # finished, failed, cancelled or left early: nothing keeps running
            await self.aclose()

    async def aclose(self) -> None:
        if self._ticket is not None and self.result is None:
            self._ticket.cancel()

    def __del__(self) -> None:
        if self._ticket is not None and self.result is None:
            self._ticket.cancel()


def _weights(weights: Sequence[float] | None, n: int) -> torch.Tensor:
    if weights is None:
        return torch.full((n,), 1.0 / n)
    try:
        values = [float(w) for w in weights]
    except (TypeError, ValueError) as err:
        raise ConfigError(f"weights must be a list of {n} numbers, got {weights!r}") from err
    if len(values) != n:
        raise ConfigError(f"weights has {len(values)} entries but the ensemble has {n} members")
    if any(not math.isfinite(w) or w < 0 for w in values) or sum(values) <= 0:
        raise ConfigError(f"weights must be finite, non-negative and not all zero, got {values}")
    total = sum(values)
    return torch.tensor([w / total for w in values])


def _quantized(spec: ModelSpec, quantization: Any) -> ModelSpec:
    """The spec with the ensemble-wide quantization, unless it names its own."""
    return spec if quantization is None or spec.quantization is not None else replace(spec, quantization=quantization)


def _check_kv_positions(kv_positions: Any, runtimes: Sequence[str]) -> None:
    """`kv_positions` sizes llama.cpp contexts: a positive int, and only where a member runs in llama.cpp."""
    if kv_positions is None:
        return
    if isinstance(kv_positions, bool) or not isinstance(kv_positions, int) or kv_positions < 1:
        raise ConfigError(f"kv_positions must be a positive int (KV positions per llama.cpp member): {kv_positions!r}")
    if "llama.cpp" not in runtimes:
        raise ConfigError(
            f"kv_positions sizes the KV cache that a llama.cpp member's requests share; none of these members runs "
            f"in llama.cpp (they run in {', '.join(sorted(set(runtimes)))}): drop kv_positions, or load a GGUF "
            "source with backend='llama.cpp'"
        )


def _devices(device_map: str | Sequence[str | None] | None, n: int) -> list[str | None]:
    """One device per member: explicit list, one device for all, or "auto" (one GPU each, round robin)."""
    if device_map is None:
        return [None] * n
    if device_map == "auto":
        count = torch.cuda.device_count()
        return [f"cuda:{i % count}" for i in range(n)] if count else ["cpu"] * n
    if isinstance(device_map, str):
        return [device_map] * n
    devices = list(device_map)
    if len(devices) != n:
        raise ConfigError(f"device_map lists {len(devices)} devices for {n} members")
    return devices


def _placement(
    members: Sequence[Member], drafter: int, again: bool = False, threads: int | None = None
) -> Placement | None:
    """The CPU placement of the members' forwards (None unless every member is a local one on the CPU), from
    their forwards timed at each thread count worth trying (unless the user chose torch's threads); `again`:
    timed now, not taken from an earlier ensemble over the same member objects; `threads`: torch's count
    (None: the calling thread's)."""
    devices = [m.device for m in members]
    if any(not isinstance(d, torch.device) or d.type != "cpu" for d in devices):
        return None
    weights = [m.weight_bytes for m in members]
    counts = thread_counts(weights, drafter)
    threads = torch.get_num_threads() if threads is None else threads
    measure = len(counts) > 1 and not threads_chosen_by_user(threads)
    return plan_placement(weights, drafter, measure_forwards(members, counts, again) if measure else None, threads)
