"""The `Ensemble` facade: members + settings in, text and stats out, sync, streaming or async."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .aggregation import UnionVocab
from .chat import chat_prompt_ids, check_text, validate_messages
from .config import GenerationConfig
from .decoding import Generation
from .errors import ConfigError, InputError, InputTypeError
from .members import Member, ModelSpec, check_device, load_member, unique_names
from .stats import GenerationResult


class Ensemble:
    """Several causal LMs, possibly with different tokenizers, decoding as one.

    Thread-safe for concurrent requests: members are read-only; every request has its own caches.
    """

    def __init__(self, members: Sequence[Member], drafter: int = 0, weights: Sequence[float] | None = None) -> None:
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
        devices = {str(m.device) for m in members}
        # Verifiers on different devices verify concurrently (each forward releases the GIL).
        self._executor = (
            ThreadPoolExecutor(len(members), thread_name_prefix="safe-verify") if len(devices) > 1 else None
        )

    @classmethod
    def from_pretrained(
        cls,
        specs: Sequence[str | ModelSpec],
        drafter: int = 0,
        weights: Sequence[float] | None = None,
        device_map: str | Sequence[str | None] | None = None,
        dtype: str | torch.dtype | None = None,
        trust_remote_code: bool = False,
        backend: str | Sequence[str] = "local",
        ray_address: str | None = None,
        member_resources: dict[str, Any] | Sequence[dict[str, Any] | None] | None = None,
        member_timeout_s: float | None = None,
    ) -> Ensemble:
        """Load members from hub ids, directories, .gguf files, demo names or ModelSpecs.

        backend="ray" (or a list with one "local"/"ray" per member) loads members in Ray actors on the
        cluster at `ray_address` ("auto", "ray://host:10001"; None: the current or a new local one), with
        `member_resources` per actor (a dict for all, or a list per member, e.g. {"num_gpus": 1}) and
        `member_timeout_s` per actor call (default 120 s). See docs/ray.md.
        """
        if isinstance(specs, str | ModelSpec) or not isinstance(specs, Sequence) or not specs:
            raise InputTypeError("specs must be a non-empty list of model specs, e.g. ['smollm2-135m', 'gemma3-270m']")
        from .ray_backend import resolve_backends, start_ray_members

        backends = resolve_backends(backend, len(specs))
        devices = _devices(device_map, len(specs))
        for dev, where in zip(devices, backends):  # all of them before loading any member
            if where == "local":  # a Ray member's device is checked on its own node
                check_device(dev)
        remote = [i for i, where in enumerate(backends) if where == "ray"]
        pending = None
        if remote:  # the actors load while the local members load here
            resources = member_resources
            if isinstance(member_resources, Sequence) and not isinstance(member_resources, str | dict):
                if len(member_resources) != len(specs):
                    raise ConfigError(f"member_resources lists {len(member_resources)} dicts for {len(specs)} members")
                resources = [member_resources[i] for i in remote]
            pending = start_ray_members(
                [specs[i] for i in remote],
                devices=[None if device_map == "auto" else devices[i] for i in remote],
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                member_resources=resources,
                ray_address=ray_address,
                member_timeout_s=member_timeout_s,
            )
        try:
            members: list[Member | None] = [None] * len(specs)
            for i, (spec, dev, where) in enumerate(zip(specs, devices, backends)):
                if where == "local":
                    members[i] = load_member(spec, device=dev, dtype=dtype, trust_remote_code=trust_remote_code)
            if pending is not None:
                for i, member in zip(remote, pending.wait(trust_remote_code)):
                    members[i] = member
        except BaseException:
            if pending is not None:
                pending.cancel()
            raise
        return cls(members, drafter=drafter, weights=weights)

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
    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        config: GenerationConfig | None = None,
        **options: Any,
    ) -> GenerationResult:
        """Generate a completion of `prompt`, or the assistant's reply to `messages`."""
        stream = self.stream(prompt, messages=messages, tools=tools, config=config, **options)
        for _ in stream:
            pass
        return stream.result

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        config: GenerationConfig | None = None,
        **options: Any,
    ) -> TextStream:
        """Iterator of verified text deltas; `.result` holds the GenerationResult once exhausted."""
        return TextStream(self._start(prompt, messages, tools, config, options))

    async def agenerate(self, prompt: str | None = None, **kwargs: Any) -> GenerationResult:
        """`generate` off the event loop; cancelling the awaiting task stops decoding after the round."""
        stream = self.astream(prompt, **kwargs)
        async for _ in stream:
            pass
        return stream.result

    def astream(self, prompt: str | None = None, **kwargs: Any) -> AsyncTextStream:
        """Async iterator of verified deltas; tokenizing and every round run in a worker thread."""
        return AsyncTextStream(lambda: self.stream(prompt, **kwargs))

    # -- internals --------------------------------------------------------------------------------------
    def _start(self, prompt, messages, tools, config, options) -> Generation:
        if config is not None and not isinstance(config, GenerationConfig):
            raise InputTypeError(f"config must be a GenerationConfig, got {type(config).__name__}")
        config = (config or GenerationConfig()).updated(**options) if options else (config or GenerationConfig())
        gac = config.aggregation == "gac" and config.method != "single" and len(self.members) > 1
        if gac and any(getattr(m, "is_remote", False) for m in self.members):
            raise ConfigError(
                "aggregation='gac' needs every member's full next-token distribution, which never leaves a Ray "
                "actor (GaC is local-only); use aggregation='unite' with Ray members"
            )
        prompts = self._prompt_ids(prompt, messages, tools, config)
        union = self._union_vocab() if config.aggregation == "gac" and config.method != "single" else None
        return Generation(
            self.members, self.names, prompts, self.drafter_index, self.weights, config, union, self._executor
        )

    def _prompt_ids(self, prompt, messages, tools, config: GenerationConfig) -> list[list[int]]:
        if (prompt is None) == (messages is None):
            raise InputError("pass exactly one of a prompt string or messages=[...]")
        members = [self.drafter] if config.method == "single" else self.members
        if messages is not None:
            checked = validate_messages(messages)
            ids = {id(m): chat_prompt_ids(m, checked, list(tools) if tools else None) for m in members}
        else:
            if not isinstance(prompt, str):
                raise InputTypeError(f"prompt must be a str, got {type(prompt).__name__}; for chat use messages=")
            if not prompt:
                raise InputError("prompt is empty; pass some text to continue")
            check_text(prompt, "the prompt")
            ids = {id(m): m.prompt_ids(prompt) for m in members}
        for m in members:
            if not ids[id(m)]:
                raise InputError(f"the prompt encodes to no tokens for member {m.name!r}; pass a non-empty prompt")
        return [ids.get(id(m), []) for m in self.members]

    def _union_vocab(self) -> UnionVocab:
        with self._lock:
            if self._union is None:
                self._union = UnionVocab(self.members)
            return self._union


class TextStream:
    """Deltas of verified text from one Generation; closing it frees the request's caches."""

    def __init__(self, generation: Generation) -> None:
        self._generation = generation
        self._emitted = 0
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        gen = self._generation
        while True:
            if self.result is not None:
                raise StopIteration
            try:
                done = gen.step()
            except BaseException:
                gen.cancel()
                raise
            visible = gen.visible_text()
            delta = visible[self._emitted :]
            self._emitted = len(visible)
            if done:
                self.result = GenerationResult(gen.text, gen.finish_reason, gen.stats)
            if delta:
                return delta

    def close(self) -> None:
        """Abandon the request (also called when the stream is garbage collected)."""
        if self.result is None:
            self._generation.cancel()

    def __del__(self) -> None:
        self.close()


class AsyncTextStream:
    """`TextStream` for asyncio: one worker-thread hop per round; `.result` once exhausted."""

    def __init__(self, open_stream: Callable[[], TextStream]) -> None:
        self._open = open_stream
        self._stream: TextStream | None = None

    @property
    def result(self) -> GenerationResult | None:
        return self._stream.result if self._stream is not None else None

    def __aiter__(self) -> AsyncTextStream:
        return self

    async def __anext__(self) -> str:
        try:
            if self._stream is None:
                self._stream = await asyncio.to_thread(self._open)
            delta = await asyncio.to_thread(next, self._stream, None)
        except BaseException:  # cancelled or failed: free the request's caches
            await self.aclose()
            raise
        if delta is None:
            raise StopAsyncIteration
        return delta

    async def aclose(self) -> None:
        if self._stream is not None:
            self._stream.close()


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
