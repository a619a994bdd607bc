"""What SafeLLM and ChatSafe share: construction (an Ensemble or lazily loaded specs), the generation
knobs (GenerationConfig's fields, with LangChain's names), per-call overrides and metadata."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, create_model, model_validator

from safe_engine import Ensemble, GenerationResult, ModelSpec, Request
from safe_engine.engine.lazy import LOAD_OPTIONS, LazyEnsemble
from safe_engine.errors import ConfigError, from_validation_error
from safe_engine.knobs import UNSET_SAMPLING, adapted
from safe_engine.shaping.request import check_known_fields, request_for_call, show_preset, standing_options
from safe_engine.stats import TokenLogprob, chat_logprobs, completion_logprobs

if TYPE_CHECKING:
    from langchain_core.language_models import LangSmithParams

# GenerationConfig's fields, where LangChain has its own convention: its standard names `max_tokens` and
# `timeout`, `temperature=None` (or 0) for greedy, and stop strings as a list.
_KNOBS = adapted(
    {
        **UNSET_SAMPLING,
        "max_new_tokens": {"alias": "max_tokens", "doc": "most tokens to generate (alias max_tokens)"},
        "stop": {"type": list[str] | None, "default": None, "doc": "default stop strings (a call's own replace them)"},
        "logprobs": {
            "type": bool | int | None,
            "doc": "report each token's log-probability (response_metadata['logprobs'] as ChatOpenAI's; "
            "generation_info['logprobs'] as OpenAI's completions): True (with top_logprobs) or a number of "
            "alternatives per token",
        },
        "timeout_s": {
            "alias": "timeout",
            "doc": "wall-clock limit of one generation in seconds (alias timeout): GenerationTimeout once passed",
        },
    }
)
#: GenerationConfig fields and `preset`, exposed as model fields and per-call keyword arguments.
KNOBS: tuple[str, ...] = tuple(k.name for k in _KNOBS)
_KNOB_FIELDS: dict[str, Any] = {k.name: (k.type, Field(k.default, alias=k.alias, description=k.doc)) for k in _KNOBS}
_GenerationKnobs: type[BaseModel] = create_model("GenerationKnobs", **_KNOB_FIELDS)
# Keyword arguments LangChain itself may pass along with a call that carry no generation option.
_IGNORED_CALL_KWARGS = frozenset({"stream", "ls_structured_output_format"})
# LangChain's standard `api_key` for hosted models: accepted (generic code passes it) and unused.
_TOLERATED = frozenset({"api_key"})


# mypy takes no variable as a base class, and this one is built by create_model() at import time
class SafeParams(_GenerationKnobs):  # type: ignore[misc,valid-type]
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
    quantization: str | None = None
    """"int8": members with int8 linear layers (CPU; bitsandbytes 8-bit on a GPU), see docs/quantization.md."""
    backend: str | list[str] = "auto"
    """"auto" (a GGUF source on the CPU runs in llama.cpp when installed), "torch", "llama.cpp" or "ray"; or one
    per model. See docs/llamacpp.md."""
    kv_positions: int | None = None
    """KV positions each llama.cpp member's requests share (default one window, 4,096); more lets more long
    requests decode at once, for more memory. See docs/llamacpp.md."""
    max_retries: int | None = None
    """LangChain's standard parameter; only 0 / None: a generation in this process is not retried."""
    top_logprobs: int | None = None
    """With logprobs=True: the most likely alternatives (0-20) reported at each token, as ChatOpenAI's."""

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
        check_known_fields(cls, data, _TOLERATED)
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
        self._request(None, {}, prompt=" ")  # validates the knobs now, not at the first call
        show_preset(self, KNOBS)
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
    def _request(self, stop: list[str] | None, kwargs: dict[str, Any], **inputs: Any) -> Request:
        """The engine's `Request` for one call: the fields, overridden by the call's options (any
        `build_request` keyword, under the engine's shared semantics: temperature 0 = greedy, max_tokens,
        timeout), for the prompt or messages in `inputs`."""
        call = {k: v for k, v in kwargs.items() if k not in _IGNORED_CALL_KWARGS}
        if stop is not None:
            call["stop"] = stop
        settings = standing_options(self, KNOBS) | {"top_logprobs": self.top_logprobs}
        return request_for_call(settings, call, **inputs)

    def _generation_info(
        self, result: GenerationResult, logprobs: list[TokenLogprob] | None = None, offset: int = 0
    ) -> dict[str, Any]:
        """finish_reason, model_name, E/T, stats (and the trace, and the logprobs: `logprobs` where a stream
        reported the others already, whose text then starts at character `offset`)."""
        stats = result.stats
        info = {
            "finish_reason": result.finish_reason,
            "model_name": self.ensemble_name,
            "ensemble_rate": stats.ensemble_rate,
            "stats": stats.to_dict(),
            **({"trace": [p.to_dict() for p in result.trace]} if result.trace is not None else {}),
        }
        entries = result.logprobs if logprobs is None else logprobs
        if entries is not None:
            info.update(self._logprobs_info(entries, offset))
        return info

    def _logprobs_info(self, entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
        """{"logprobs": ...} in the shape the OpenAI model of the same kind gives (chat: ChatOpenAI's;
        completions: OpenAI's legacy object); LangChain concatenates a stream's lists when merging chunks."""
        return {"logprobs": chat_logprobs(entries) if self._chat_logprobs else completion_logprobs(entries, offset)}

    _chat_logprobs: ClassVar[bool] = True  # the chat shape; SafeLLM: the completions shape

    def _ls_params(
        self, model_type: Literal["chat", "llm"], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> LangSmithParams:
        """LangSmith tracing parameters (`_get_ls_params` of both models; ls_provider "safe")."""
        model = kwargs.get("model")
        params: LangSmithParams = {
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
            params.update(
                weights=self.weights,
                device_map=self.device_map,
                dtype=self.dtype,
                quantization=self.quantization,
                backend=self.backend,
                kv_positions=self.kv_positions,
            )
        params.update({k: getattr(self, k) for k in KNOBS})
        return params

    def _prompt_tokens(self, result: GenerationResult) -> int:
        """The drafter's prompt length: what LangChain's usage counts as input tokens."""
        counts = result.stats.prompt_tokens
        return int(counts.get(self.drafter_name, next(iter(counts.values()), 0)))
