"""What SafeLLM and ChatSafe share: construction (an Ensemble or lazily loaded specs), the generation
knobs (GenerationConfig's fields, with LangChain's names), per-call overrides and metadata."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, create_model, model_validator

from safe_engine import Ensemble, GenerationConfig, GenerationResult, ModelSpec
from safe_engine.engine.lazy import LOAD_OPTIONS, LazyEnsemble
from safe_engine.errors import ConfigError, InputTypeError, from_validation_error
from safe_engine.knobs import adapted, aliases

# GenerationConfig's fields, where LangChain has its own convention: its standard names `max_tokens` and
# `timeout`, `temperature=None` (or 0) for greedy, and stop strings as a list.
_KNOBS = adapted(
    {
        "max_new_tokens": {"alias": "max_tokens", "doc": "most tokens to generate (alias max_tokens)"},
        "temperature": {
            "type": float | None,
            "default": None,
            "doc": "sampling temperature; None or 0 means greedy decoding (the SAFE default)",
        },
        "do_sample": {
            "type": bool | None,
            "default": None,
            "doc": "sample instead of greedy decoding; None: sample exactly when temperature > 0",
        },
        "stop": {"type": list[str] | None, "default": None, "doc": "default stop strings (a call's own replace them)"},
        "timeout_s": {
            "alias": "timeout",
            "doc": "wall-clock limit of one generation in seconds (alias timeout): GenerationTimeout once passed",
        },
    }
)
#: GenerationConfig fields exposed as model fields and per-call keyword arguments.
KNOBS: tuple[str, ...] = tuple(k.name for k in _KNOBS)
_ALIASES = aliases(_KNOBS)  # max_tokens -> max_new_tokens, timeout -> timeout_s
_GenerationKnobs: type[BaseModel] = create_model(
    "GenerationKnobs", **{k.name: (k.type, Field(k.default, alias=k.alias, description=k.doc)) for k in _KNOBS}
)
# Keyword arguments LangChain itself may pass along with a call that carry no generation option.
_IGNORED_CALL_KWARGS = frozenset({"stream"})
# LangChain's standard `api_key` for hosted models: accepted (generic code passes it) and unused.
_TOLERATED = frozenset({"api_key"})


class SafeParams(_GenerationKnobs):
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
    max_retries: int | None = None
    """LangChain's standard parameter; only 0 / None: a generation in this process is not retried."""

    _holder: LazyEnsemble = PrivateAttr()

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
        if self.max_retries:
            raise ConfigError(
                f"{type(self).__name__} does not retry (max_retries={self.max_retries}): its members run in this "
                "process, so a failed generation would fail the same way again. Leave max_retries unset or 0; "
                "to retry anyway, wrap the model: model.with_retry(...)"
            )
        options = {k: getattr(self, k) for k in LOAD_OPTIONS}
        self._holder = LazyEnsemble(self.ensemble, self.models, owner=type(self).__name__, **options)
        self._engine_options(None, {})  # validates the knobs now, not at the first call
        return self

    # -- the ensemble ----------------------------------------------------------------------------------
    @property
    def is_loaded(self) -> bool:
        """Whether the members are in memory (always true with `ensemble=`)."""
        return self._holder.is_loaded

    def get_ensemble(self) -> Ensemble:
        """The Ensemble, loading `models` on first use (thread-safe, once)."""
        return self._holder.get()

    async def aget_ensemble(self) -> Ensemble:
        return await self._holder.aget()

    @property
    def member_names(self) -> list[str]:
        """Member names, known without loading (from the specs, as the engine names them)."""
        return self._holder.names

    @property
    def drafter_name(self) -> str:
        return self._holder.drafter_name

    @property
    def ensemble_name(self) -> str:
        """e.g. "safe:qwen2.5-coder-0.5b+smollm2-135m" (the drafter first)."""
        drafter = self.drafter_name
        return f"{self.method}:" + "+".join([drafter, *[n for n in self.member_names if n != drafter]])

    # -- options ---------------------------------------------------------------------------------------
    def _engine_options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """GenerationConfig keywords for one call: fields, overridden by the call's kwargs (consumed)."""
        values = {k: getattr(self, k) for k in KNOBS}
        for key in list(kwargs):
            name = _ALIASES.get(key, key)
            if name in values:
                values[name] = kwargs.pop(key)
            elif key in _IGNORED_CALL_KWARGS:
                kwargs.pop(key)
        if kwargs:
            valid = sorted((*KNOBS, *_ALIASES))
            raise ConfigError(f"unknown option(s) {sorted(kwargs)}; per-call options are {valid}")
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
        stops = stop if stop is not None else values["stop"]
        values["stop"] = tuple([stops] if isinstance(stops, str) else stops or ())
        try:
            GenerationConfig(**values)
        except TypeError as err:  # a wrong type the dataclass itself rejects
            raise InputTypeError(str(err)) from err
        return values

    def _generation_info(self, result: GenerationResult) -> dict[str, Any]:
        stats = result.stats
        return {
            "finish_reason": result.finish_reason,
            "model_name": self.ensemble_name,
            "ensemble_rate": stats.ensemble_rate,
            "stats": stats.to_dict(),
            **({"trace": [p.to_dict() for p in result.trace]} if result.trace is not None else {}),
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
        return params

    def _prompt_tokens(self, result: GenerationResult) -> int:
        """The drafter's prompt length: what LangChain's usage counts as input tokens."""
        counts = result.stats.prompt_tokens
        return int(counts.get(self.drafter_name, next(iter(counts.values()), 0)))
