"""What SafeLLM and ChatSafe share: construction (an Ensemble or lazily loaded specs), the generation
knobs, per-call overrides, metadata, and driving the engine's verified-text stream sync or async."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from safe_engine import Ensemble, GenerationConfig, GenerationResult, ModelSpec
from safe_engine.errors import ConfigError, InputTypeError, from_validation_error
from safe_engine.members import spec_name, unique_names

#: GenerationConfig fields exposed as model fields and per-call keyword arguments.
KNOBS = (
    "method",
    "aggregation",
    "draft_length",
    "top_k",
    "sharpening",
    "sharpen_threshold",
    "max_new_tokens",
    "temperature",
    "top_p",
    "do_sample",
    "seed",
)
# Keyword arguments LangChain itself may pass along with a call that carry no generation option.
_IGNORED_CALL_KWARGS = frozenset({"stream"})
_LOAD_FIELDS = ("drafter", "weights", "device_map", "dtype", "trust_remote_code")
# LangChain's standard constructor parameters for hosted models: accepted so generic code (and the
# standard test suites) can pass them, and ignored, since the members run in this process.
_TOLERATED = frozenset({"api_key", "timeout", "max_retries"})


class SafeParams(BaseModel):
    """Fields and helpers common to `SafeLLM` and `ChatSafe`."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    ensemble: Ensemble | None = Field(default=None, exclude=True)
    """An Ensemble built beforehand (shared, not copied). Pass this or `models`."""
    models: list[str | ModelSpec] | None = None
    """Model specs (hub ids, directories, .gguf files, demo names, ModelSpecs), loaded on first use."""
    drafter: int = 0
    """Index of the drafter in `models` (with `ensemble=`, set it on the Ensemble instead)."""
    weights: list[float] | None = None
    device_map: str | list[str | None] | None = None
    dtype: str | None = None
    trust_remote_code: bool = False

    method: str = "safe"
    """"safe" | "every_token" | "single" (the drafter alone)."""
    aggregation: str = "unite"
    """"unite" | "gac"."""
    draft_length: int = 5
    top_k: int = 10
    sharpening: str | None = "heuristic"
    sharpen_threshold: float = 0.1
    max_new_tokens: int = Field(default=256, alias="max_tokens")
    """Most tokens to generate (alias `max_tokens`, LangChain's standard name)."""
    temperature: float | None = None
    """Sampling temperature; None or 0 means greedy decoding (the SAFE default)."""
    top_p: float = 1.0
    do_sample: bool | None = None
    """Sample instead of greedy decoding; None: sample exactly when `temperature` > 0."""
    seed: int | None = None
    stop: list[str] | None = None
    """Default stop strings (a call's own `stop` replaces them)."""

    _loaded: Ensemble | None = PrivateAttr(default=None)
    _load_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    def __init__(self, **data: Any) -> None:
        """Bad options raise the engine's ConfigError / InputTypeError, as everywhere in this library."""
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise from_validation_error(type(self).__name__, err) from err

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown(cls, data: Any) -> Any:
        """A misspelt option is an error, not silently ignored (pydantic would drop it)."""
        if isinstance(data, dict):
            known = set(_TOLERATED)
            for name, info in cls.model_fields.items():
                known.add(name)
                if info.alias:
                    known.add(info.alias)
            unknown = sorted(set(data) - known)
            if unknown:
                raise ConfigError(f"unknown parameter(s) {unknown} for {cls.__name__}; valid: {sorted(known)}")
        return data

    @model_validator(mode="after")
    def _check(self) -> SafeParams:
        if (self.ensemble is None) == (self.models is None):
            raise ConfigError(
                "pass exactly one of ensemble=Ensemble(...) or models=[spec, ...] "
                "(e.g. models=['qwen2.5-coder-0.5b', 'smollm2-135m'])"
            )
        if self.models is not None:
            if not self.models:
                raise ConfigError("models is empty; list at least one model spec")
            if not 0 <= self.drafter < len(self.models):
                raise ConfigError(f"drafter must be an index in [0, {len(self.models) - 1}], got {self.drafter}")
        else:
            given = sorted(set(_LOAD_FIELDS) & self.model_fields_set)
            if given:
                raise ConfigError(
                    f"{given} only apply when loading from models=[...]; with ensemble=, pass them to "
                    "Ensemble(...) / Ensemble.from_pretrained(...)"
                )
        self._engine_options(None, {})  # validates the knobs now, not at the first call
        return self

    # -- the ensemble ----------------------------------------------------------------------------------
    @property
    def is_loaded(self) -> bool:
        """Whether the members are in memory (always true with `ensemble=`)."""
        return self.ensemble is not None or self._loaded is not None

    def get_ensemble(self) -> Ensemble:
        """The Ensemble, loading `models` on first use (thread-safe, once)."""
        if self.ensemble is not None:
            return self.ensemble
        with self._load_lock:
            if self._loaded is None:
                self._loaded = Ensemble.from_pretrained(
                    self.models,
                    drafter=self.drafter,
                    weights=self.weights,
                    device_map=self.device_map,
                    dtype=self.dtype,
                    trust_remote_code=self.trust_remote_code,
                )
            return self._loaded

    async def aget_ensemble(self) -> Ensemble:
        if self.is_loaded:
            return self.get_ensemble()
        return await asyncio.to_thread(self.get_ensemble)

    @property
    def member_names(self) -> list[str]:
        """Member names, known without loading (from the specs, as the engine names them)."""
        if self.ensemble is not None:
            return list(self.ensemble.names)
        if self._loaded is not None:
            return list(self._loaded.names)
        return unique_names([spec_name(s) for s in self.models or []])

    @property
    def drafter_name(self) -> str:
        index = self.ensemble.drafter_index if self.ensemble is not None else self.drafter
        return self.member_names[index]

    @property
    def ensemble_name(self) -> str:
        """e.g. "safe:qwen2.5-coder-0.5b+smollm2-135m" (the drafter first)."""
        names = self.member_names
        drafter = self.drafter_name
        return f"{self.method}:" + "+".join([drafter, *[n for n in names if n != drafter]])

    # -- options ---------------------------------------------------------------------------------------
    def _engine_options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """GenerationConfig keywords for one call: fields, overridden by the call's kwargs (consumed)."""
        values = {k: getattr(self, k) for k in KNOBS}
        if "max_tokens" in kwargs:
            values["max_new_tokens"] = kwargs.pop("max_tokens")
        for key in list(kwargs):
            if key in KNOBS:
                values[key] = kwargs.pop(key)
            elif key in _IGNORED_CALL_KWARGS:
                kwargs.pop(key)
        if kwargs:
            raise ConfigError(
                f"unknown option(s) {sorted(kwargs)}; per-call options are {sorted((*KNOBS, 'max_tokens', 'stop'))}"
            )
        temperature, do_sample = values.pop("temperature"), values.pop("do_sample")
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, int | float)):
            raise ConfigError(f"temperature must be a number, got {temperature!r}")
        if do_sample is None:
            do_sample = temperature is not None and temperature > 0
        if temperature is None or temperature == 0:
            do_sample = False  # temperature 0 is LangChain's way of asking for greedy decoding
        else:
            values["temperature"] = temperature
        values["do_sample"] = bool(do_sample)
        if values["max_new_tokens"] is None:
            values.pop("max_new_tokens")
        stops = stop if stop is not None else self.stop
        if isinstance(stops, str):
            stops = [stops]
        values["stop"] = tuple(stops or ())
        try:
            GenerationConfig(**values)
        except TypeError as err:  # a wrong type the dataclass itself rejects
            raise InputTypeError(str(err)) from err
        return values

    def _generation_info(self, result: GenerationResult, ensemble: Ensemble) -> dict[str, Any]:
        stats = result.stats
        return {
            "finish_reason": result.finish_reason,
            "model_name": self.ensemble_name,
            "ensemble_rate": stats.ensemble_rate,
            "stats": stats.to_dict(),
        }

    def _ls_params(self, model_type: str, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """LangSmith tracing parameters (`_get_ls_params` of both models; ls_provider "safe")."""
        model = kwargs.get("model")
        params: dict[str, Any] = {
            "ls_provider": "safe",
            "ls_model_name": model if isinstance(model, str) else self.ensemble_name,
            "ls_model_type": model_type,
            "ls_max_tokens": kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_new_tokens)),
        }
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is not None:
            params["ls_temperature"] = temperature
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    def _safe_identifying_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"models": self.member_names, "drafter": self.drafter_name}
        if self.ensemble is None:
            params.update(weights=self.weights, device_map=self.device_map, dtype=self.dtype)
        params.update({k: getattr(self, k) for k in KNOBS})
        params["stop"] = self.stop
        return params


def drafter_prompt_tokens(result: GenerationResult, ensemble: Ensemble) -> int:
    counts = result.stats.prompt_tokens
    name = ensemble.names[ensemble.drafter_index]
    return int(counts.get(name, next(iter(counts.values()), 0)))


# -- driving the engine's stream -------------------------------------------------------------------------
def with_result(start: Callable[[], Any]) -> Iterator[tuple[str, GenerationResult | None]]:
    """(delta, result) pairs from `ens.stream(...)`: result is set on the last pair only.

    When the final round adds no text, the last pair is ("", result). The stream is closed (its caches
    freed) however the caller leaves the loop.
    """
    stream = start()
    try:
        for delta in stream:
            yield delta, stream.result
            if stream.result is not None:
                return
        yield "", stream.result
    finally:
        stream.close()


async def awith_result(open_stream: Callable[[], Any]) -> AsyncIterator[tuple[str, GenerationResult | None]]:
    """Async `with_result` over `ens.astream(...)` (tokenizing and every round run in a worker thread)."""
    stream = open_stream()
    try:
        async for delta in stream:
            yield delta, stream.result
            if stream.result is not None:
                return
        yield "", stream.result
    finally:
        await stream.aclose()
