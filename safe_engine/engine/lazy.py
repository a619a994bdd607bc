"""`LazyEnsemble`: an Ensemble given up front, or built from specs on first use.

Why: framework adapters are constructed long before they generate (LangChain chains, LlamaIndex
`Settings`), often in processes that never call them, so loading gigabytes of weights in a constructor
is wrong; and two threads asking at once must not load the members twice. Both adapters hold one of
these instead of each locking its own way, and stream through it (`events` / `aevents`: the engine's
`StreamEvent`s, the stream closed however the consumer leaves).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from ..errors import ConfigError, InputTypeError
from ..runtime.members import ModelSpec, spec_name, unique_names
from ..runtime.quantization import check_quantization
from ..shaping.request import Request
from .ensemble import AsyncTextStream, Ensemble, StreamEvent, TextStream

#: Ensemble.from_pretrained options a holder forwards, with the values that mean "not given".
LOAD_OPTIONS: dict[str, Any] = {
    "drafter": 0,
    "weights": None,
    "device_map": None,
    "dtype": None,
    "trust_remote_code": False,
    "quantization": None,
    "backend": "auto",
    "kv_positions": None,
}


class LazyEnsemble:
    """Holds `ensemble`, or loads `specs` with `Ensemble.from_pretrained(specs, **load_options)` once.

    Lock discipline: the first `get()` loads under this holder's lock; callers arriving meanwhile wait
    for that load and share its result; once loaded, `get()` takes no lock. A failed load is not
    remembered: the next call tries again. Copies (deep ones too) share the holder, since the members
    are read-only and serve concurrent requests; a pickle carries the specs, not the weights, which
    load again on first use. `owner` names the adapter in error messages.
    """

    def __init__(
        self,
        ensemble: Ensemble | None = None,
        specs: Sequence[str | os.PathLike | ModelSpec] | None = None,
        *,
        owner: str = "Ensemble holder",
        **load_options: Any,
    ) -> None:
        unknown = sorted(set(load_options) - set(LOAD_OPTIONS))
        if unknown:
            raise ConfigError(f"unknown loading option(s) {unknown}; valid: {sorted(LOAD_OPTIONS)}")
        options = {**LOAD_OPTIONS, **load_options}
        if (ensemble is None) == (specs is None):
            raise ConfigError(
                f"{owner} needs exactly one of ensemble=Ensemble(...) or models=[spec, ...] "
                "(hub ids, directories, .gguf files or demo names such as 'smollm2-135m')"
            )
        if ensemble is not None:
            if not isinstance(ensemble, Ensemble):
                raise InputTypeError(f"ensemble must be a safe_engine.Ensemble, got {type(ensemble).__name__}")
            given = sorted(k for k, v in options.items() if v != LOAD_OPTIONS[k] and v != _unset(k, ensemble))
            if given:
                raise ConfigError(
                    f"{given} only apply when loading from models=[...]; an Ensemble passed as ensemble= is "
                    "already loaded: choose them in Ensemble(...) / Ensemble.from_pretrained(...)"
                )
            options["drafter"] = ensemble.drafter_index
            self.specs: list[str | ModelSpec] | None = None
        else:
            self.specs = _check_specs(specs, options)
        self.load_options = options
        self._ensemble = ensemble
        self._lock = threading.Lock()

    @property
    def is_loaded(self) -> bool:
        """Whether the members are in memory (always, for a holder given an Ensemble)."""
        return self._ensemble is not None

    def get(self) -> Ensemble:
        """The Ensemble, loading the specs on the first call."""
        ensemble = self._ensemble
        if ensemble is not None:
            return ensemble
        with self._lock:
            if self._ensemble is None:
                assert self.specs is not None, "a holder without specs was given its Ensemble"
                self._ensemble = Ensemble.from_pretrained(self.specs, **self.load_options)
            return self._ensemble

    async def aget(self) -> Ensemble:
        """`get()` without blocking the event loop: a load runs in a worker thread."""
        if self._ensemble is not None:
            return self._ensemble
        return await asyncio.to_thread(self.get)

    def events(self, prompt: str | Request | None = None, **request: Any) -> Iterator[StreamEvent]:
        """One request's `StreamEvent`s (the last carries the result), for adapters that stream.

        The request starts now (loading, bad input and tokenizing raise here, not at the first event);
        however the caller leaves the loop, the stream is closed and its caches are freed.
        """
        return _closing(self.get().stream(prompt, **request))

    async def aevents(self, prompt: str | Request | None = None, **request: Any) -> AsyncIterator[StreamEvent]:
        """`events` for asyncio (`Ensemble.astream`): loading and tokenizing run in worker threads, and the
        request starts at the first event. Leaving the loop early cancels it and frees its caches."""
        ensemble = await self.aget()
        return _aclosing(ensemble.astream(prompt, **request))

    @property
    def names(self) -> list[str]:
        """Member names, known without loading (from the specs, as the engine names them)."""
        if self._ensemble is not None:
            return list(self._ensemble.names)
        return unique_names([spec_name(s) for s in self.specs or ()])

    @property
    def drafter_index(self) -> int:
        return self.load_options["drafter"]

    @property
    def drafter_name(self) -> str:
        return self.names[self.drafter_index]

    def __deepcopy__(self, memo: dict[int, Any]) -> LazyEnsemble:
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k != "_lock"}
        if self.specs is not None:
            state["_ensemble"] = None  # weights do not travel; they load again from the specs
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "loaded" if self.is_loaded else "not loaded"
        return f"LazyEnsemble({self.names}, drafter={self.drafter_name!r}, {state})"


def _closing(stream: TextStream) -> Iterator[StreamEvent]:
    try:
        yield from stream.events()
    finally:
        stream.close()


async def _aclosing(stream: AsyncTextStream) -> AsyncIterator[StreamEvent]:
    try:
        async for event in stream.events():
            yield event
    finally:
        await stream.aclose()


def _unset(option: str, ensemble: Ensemble) -> Any:
    """What an option may say with ensemble= without asking for anything: the ensemble's own drafter."""
    return ensemble.drafter_index if option == "drafter" else LOAD_OPTIONS[option]


def _check_specs(specs: Any, options: dict[str, Any]) -> list[str | ModelSpec]:
    if isinstance(specs, str | os.PathLike | ModelSpec) or not isinstance(specs, Sequence) or not specs:
        raise ConfigError("models must be a non-empty list of model specs, e.g. ['smollm2-135m', 'gemma3-270m']")
    specs = [os.fspath(s) if isinstance(s, os.PathLike) else s for s in specs]
    n, drafter, weights = len(specs), options["drafter"], options["weights"]
    if isinstance(drafter, bool) or not isinstance(drafter, int) or not 0 <= drafter < n:
        raise ConfigError(f"drafter must be an index in [0, {n - 1}], got {drafter!r}")
    if weights is not None and (not isinstance(weights, Sequence) or len(weights) != n):
        raise ConfigError(f"weights must list one number per model ({n}), got {weights!r}")
    device = options["device_map"] if isinstance(options["device_map"], str) else None
    check_quantization(options["quantization"], options["dtype"], device)  # at construction, not first use
    return specs
