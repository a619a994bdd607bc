"""`SafeLLM`: a LlamaIndex `CustomLLM` over a SAFE `Ensemble` (thin: every algorithmic step is the engine's).

Construction follows `llama-index-llms-huggingface`'s `HuggingFaceLLM` (model spec + `device_map` + knobs
as fields, `completion_to_prompt` / `messages_to_prompt` / `system_prompt`) and improves on it:

* nothing is loaded until the first call (`models=[...]`), and `metadata` can be read before that:
  context windows and chat templates are peeked from the members' config files where that is cheap;
* `chat` renders the conversation with *each member's own* chat template (the engine's `messages=`),
  not with a generic "role: content" transcript;
* `stream_complete` applies `completion_to_prompt` exactly like `complete` does;
* the async methods run loading, tokenisation and every decoding round in worker threads, so the event
  loop keeps running (`HuggingFaceLLM` iterates a sync generator inside `astream_complete`);
* every response carries the ensemble statistics (E/T, rounds, forward passes) in `additional_kwargs` and
  `raw`, with `raw["usage"]` in the shape LlamaIndex's token counter reads.
"""

from __future__ import annotations

import asyncio
import os
import threading
import warnings
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import fields as dataclass_fields
from typing import Any

from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator
from llama_index.core.callbacks import CallbackManager
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from safe_engine import Ensemble, GenerationConfig, GenerationResult, ModelSpec, TextStream
from safe_engine.errors import ConfigError, InputTypeError, from_validation_error
from safe_engine.members import peek_spec, spec_name, unique_names

_DEFAULTS = GenerationConfig()
#: Names of the engine's generation options; per-call keyword arguments with these names override fields.
GENERATION_OPTIONS: tuple[str, ...] = tuple(f.name for f in dataclass_fields(GenerationConfig))
_ROLE_ALIASES = {MessageRole.CHATBOT.value: "assistant", MessageRole.MODEL.value: "assistant"}
_MESSAGE_EXTRAS = ("tool_calls", "tool_call_id", "name")
_LOADING_OPTIONS = ("drafter", "weights", "device_map", "dtype", "trust_remote_code")
_LOAD_LOCK = threading.Lock()  # one load at a time (process-wide: loads compete for memory anyway)


class SafeLLM(CustomLLM):
    """SAFE ensemble of causal LMs with different tokenizers, as a LlamaIndex LLM.

    Examples:
        ```python
        from llama_index.core import Settings
        from llamaindex_safe import SafeLLM  # or: from llama_index.llms.safe import SafeLLM

        Settings.llm = SafeLLM(models=["qwen2.5-coder-0.5b", "smollm2-135m"], max_new_tokens=128)
        print(Settings.llm.complete("def fibonacci(n):"))
        ```

    Pass either `ensemble=` (an already built `safe_engine.Ensemble`) or `models=[spec, ...]` (hub ids,
    directories, `.gguf` files, demo model names or `ModelSpec`s, loaded on first use with `drafter`,
    `weights`, `device_map`, `dtype` and `trust_remote_code`). Generation options are fields and can be
    overridden per call: `llm.complete(prompt, max_new_tokens=32, method="every_token")`.
    """

    models: list[str | ModelSpec] | None = Field(
        default=None, description="Member specs, loaded lazily on first use (unused when ensemble= is given)."
    )
    drafter: int = Field(default=0, ge=0, description="Index (in `models`) of the drafter.")
    weights: list[float] | None = Field(default=None, description="Optional per-member ensemble weights.")
    device_map: str | list[str | None] | None = Field(
        default=None, description='One device for all members, one per member, or "auto" (one GPU each).'
    )
    dtype: str | None = Field(default=None, description='e.g. "bfloat16"; default float32 on CPU, bf16 on GPU.')
    trust_remote_code: bool = Field(default=False, description="Allow models that ship their own code.")

    method: str = Field(default=_DEFAULTS.method, description='"safe" | "every_token" | "single" (drafter alone).')
    aggregation: str = Field(default=_DEFAULTS.aggregation, description='"unite" (top-k union) | "gac".')
    draft_length: int = Field(default=_DEFAULTS.draft_length, description="Tokens drafted per round (n).")
    top_k: int = Field(default=_DEFAULTS.top_k, description="Top-k of each member in the UniTE union (k).")
    sharpening: str | None = Field(default=_DEFAULTS.sharpening, description='"heuristic" | "geometric" | None.')
    sharpen_threshold: float = Field(default=_DEFAULTS.sharpen_threshold, description="Sharpening threshold λ.")
    max_new_tokens: int = Field(default=_DEFAULTS.max_new_tokens, description="The maximum number of new tokens.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (excluded from the output).")
    do_sample: bool = Field(default=_DEFAULTS.do_sample, description="Sample instead of greedy decoding.")
    temperature: float = Field(default=_DEFAULTS.temperature, description="Sampling temperature.")
    top_p: float = Field(default=_DEFAULTS.top_p, description="Nucleus sampling threshold.")
    seed: int | None = Field(default=_DEFAULTS.seed, description="Seed for sampling.")

    context_window: int | None = Field(
        default=None,
        gt=0,
        description="Cap on the context window reported in metadata; default: the smallest of the members'.",
    )
    model_name: str | None = Field(default=None, description="Name reported in metadata; default: the members'.")
    is_chat_model: bool | None = Field(
        default=None,
        description="Whether LlamaIndex should prefer chat(); default: True when every member has a chat template.",
    )

    _ensemble: Ensemble | None = PrivateAttr(default=None)
    _peeked: tuple[int | None, bool] | None = PrivateAttr(default=None)
    _peek_done: bool = PrivateAttr(default=False)

    def __init__(
        self,
        ensemble: Ensemble | None = None,
        models: Sequence[str | os.PathLike | ModelSpec] | None = None,
        callback_manager: CallbackManager | None = None,
        **kwargs: Any,
    ) -> None:
        if (ensemble is None) == (models is None):
            raise ConfigError(
                "SafeLLM needs exactly one of ensemble=Ensemble(...) or models=[spec, ...] "
                "(hub ids, directories, .gguf files or demo names such as 'smollm2-135m')"
            )
        if ensemble is not None:
            if not isinstance(ensemble, Ensemble):
                raise InputTypeError(f"ensemble must be a safe_engine.Ensemble, got {type(ensemble).__name__}")
            unset = {"drafter": ensemble.drafter_index, "trust_remote_code": False}
            loading = sorted(k for k in _LOADING_OPTIONS if kwargs.get(k, unset.get(k)) != unset.get(k))
            if loading:
                raise ConfigError(
                    f"{loading} apply to models=[...]; an Ensemble passed as ensemble= is already loaded "
                    "(choose them in Ensemble(...) / Ensemble.from_pretrained(...))"
                )
            kwargs["drafter"] = ensemble.drafter_index
        dtype = kwargs.get("dtype")
        if dtype is not None and not isinstance(dtype, str):  # a torch.dtype: keep the field serialisable
            kwargs["dtype"] = str(dtype).removeprefix("torch.")
        try:
            super().__init__(models=models, callback_manager=callback_manager, **kwargs)
        except ValidationError as err:  # this library's errors, not pydantic's
            raise from_validation_error(type(self).__name__, err) from err
        self._ensemble = ensemble

    # -- validation -----------------------------------------------------------------------------------
    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown(cls, data: Any) -> Any:
        """A misspelt option is an error, not silently dropped."""
        if isinstance(data, dict):
            known = {"class_name"} | set(cls.model_fields)  # class_name: LlamaIndex's to_dict round trip
            known |= {f.alias for f in cls.model_fields.values() if f.alias}
            unknown = sorted(set(data) - known)
            if unknown:
                raise ConfigError(f"unknown parameter(s) {unknown} for {cls.__name__}; valid: {sorted(known)}")
        return data

    @field_validator("models", mode="before")
    @classmethod
    def _check_models(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str | os.PathLike | ModelSpec) or not isinstance(value, Sequence) or not value:
            raise ConfigError("models must be a non-empty list of model specs, e.g. ['smollm2-135m', 'gemma3-270m']")
        return [os.fspath(v) if isinstance(v, os.PathLike) else v for v in value]

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_options(self) -> SafeLLM:
        GenerationConfig(**self._field_options())  # the engine's own checks, at construction time
        if self.models is not None:
            n = len(self.models)
            if self.drafter >= n:
                raise ConfigError(f"drafter must be an index in [0, {n - 1}], got {self.drafter}")
            if self.weights is not None and len(self.weights) != n:
                raise ConfigError(f"weights has {len(self.weights)} entries but models lists {n} specs")
        return self

    @classmethod
    def class_name(cls) -> str:
        return "SafeLLM"

    # -- the ensemble, loaded lazily --------------------------------------------------------------------
    @property
    def is_loaded(self) -> bool:
        """Whether the members are in memory (always true for `ensemble=`)."""
        return self._ensemble is not None

    @property
    def ensemble(self) -> Ensemble:
        """The engine's `Ensemble`, loading the members on first access."""
        if self._ensemble is None:
            with _LOAD_LOCK:
                if self._ensemble is None:
                    self._ensemble = Ensemble.from_pretrained(
                        self.models,
                        drafter=self.drafter,
                        weights=self.weights,
                        device_map=self.device_map,
                        dtype=self.dtype,
                        trust_remote_code=self.trust_remote_code,
                    )
        return self._ensemble

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> SafeLLM:
        """Copies share the loaded members (read-only, safe for concurrent requests) instead of duplicating them."""
        memo = {} if memo is None else memo
        if self._ensemble is not None:
            memo[id(self._ensemble)] = self._ensemble
        return super().__deepcopy__(memo)

    def __getstate__(self) -> dict[str, Any]:
        """A `models=[...]` SafeLLM pickles as its specs and reloads lazily; weights travel only for `ensemble=`."""
        if self.models is None or self._ensemble is None:
            return super().__getstate__()
        unloaded = self.model_copy()  # shallow: leaves this instance's members in place
        unloaded._ensemble = None
        return unloaded.__getstate__()

    async def _aensemble(self) -> Ensemble:
        if self._ensemble is not None:
            return self._ensemble
        return await asyncio.to_thread(lambda: self.ensemble)

    # -- metadata -----------------------------------------------------------------------------------------
    @property
    def metadata(self) -> LLMMetadata:
        """Context window = the smallest of the members' (capped by `context_window`); no load if avoidable."""
        return self._metadata(load=True)

    def to_payload(self) -> dict[str, Any]:
        """What instrumentation events carry; never loads models (it runs on the event loop in async calls)."""
        payload = {"class_name": self.class_name(), **self._metadata(load=False).model_dump()}
        payload.update(members=self._member_names(), drafter=self.drafter_name, method=self.method)
        return payload

    @property
    def drafter_name(self) -> str:
        if self._ensemble is not None:
            return self._ensemble.names[self._ensemble.drafter_index]
        return self._member_names()[self.drafter]

    def _member_names(self) -> list[str]:
        if self._ensemble is not None:
            return list(self._ensemble.names)
        return unique_names([spec_name(spec) for spec in self.models or ()])

    def _metadata(self, load: bool) -> LLMMetadata:
        if self._ensemble is not None:
            window = self._ensemble.context_window
            chat = all(m.chat_template for m in self._ensemble.members)
        else:
            peeked = self._peek()
            if peeked is None and load:
                self.ensemble  # noqa: B018 - not cheaply known: load the members
                return self._metadata(load=True)
            window, chat = peeked or (None, False)
        if self.context_window is not None:
            window = min(window, self.context_window) if window else self.context_window
        return LLMMetadata(
            context_window=window or DEFAULT_CONTEXT_WINDOW,
            num_output=self.max_new_tokens,
            is_chat_model=chat if self.is_chat_model is None else self.is_chat_model,
            model_name=self.model_name or "safe:" + "+".join(self._member_names()),
        )

    def _peek(self) -> tuple[int | None, bool] | None:
        """(smallest context window, every member has a chat template) from config files, or None."""
        if not self._peek_done:
            found = [peek_spec(spec, self.trust_remote_code) for spec in self.models or ()]
            if found and all(f is not None for f in found):
                windows = [w for w, _ in found if w]
                self._peeked = (min(windows) if windows else None, all(chat for _, chat in found))
            self._peek_done = True
        return self._peeked

    # -- options and prompts --------------------------------------------------------------------------------
    def _field_options(self) -> dict[str, Any]:
        options = {name: getattr(self, name) for name in GENERATION_OPTIONS}
        options["stop"] = tuple(self.stop)
        return options

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        options = self._field_options()
        unknown = sorted(k for k in kwargs if k not in GENERATION_OPTIONS)
        if unknown:
            warnings.warn(
                f"SafeLLM ignores unknown option(s) {unknown}; generation options are {list(GENERATION_OPTIONS)}",
                stacklevel=4,
            )
        options.update({k: v for k, v in kwargs.items() if k in GENERATION_OPTIONS})
        return options

    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        return prompt if formatted else self.completion_to_prompt(prompt)

    def _uses_custom_messages_to_prompt(self) -> bool:
        return self.messages_to_prompt is not generic_messages_to_prompt

    def _chat_request(self, messages: Sequence[ChatMessage]) -> dict[str, Any]:
        """Engine arguments for a conversation: `messages=` for the members' own templates, or the
        user's `messages_to_prompt` rendering as a raw prompt."""
        if self._uses_custom_messages_to_prompt():
            return {"prompt": self.messages_to_prompt(messages)}
        converted = [_engine_message(m) for m in messages]
        if self.system_prompt and not (converted and converted[0]["role"] == "system"):
            converted.insert(0, {"role": "system", "content": self.system_prompt})
        return {"messages": converted}

    # -- responses ---------------------------------------------------------------------------------------------
    def _extras(self, result: GenerationResult | None) -> dict[str, Any]:
        """`additional_kwargs` and `raw` for a response: the E/T statistics and token usage."""
        if result is None:
            return {}
        stats = result.stats.to_dict()
        prompt_tokens = stats["prompt_tokens"].get(self.drafter_name, 0)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": stats["tokens"],
            "total_tokens": prompt_tokens + stats["tokens"],
        }
        raw = {"finish_reason": result.finish_reason, "stats": stats, "usage": usage}
        return {"additional_kwargs": {"finish_reason": result.finish_reason, **stats}, "raw": raw}

    def _completion(self, result: GenerationResult) -> CompletionResponse:
        return CompletionResponse(text=result.text, **self._extras(result))

    def _chat(self, result: GenerationResult) -> ChatResponse:
        extras = self._extras(result)
        message = ChatMessage(role=MessageRole.ASSISTANT, content=result.text)
        return ChatResponse(message=message, **extras)

    def _stream_completions(self, deltas: Iterator[str], stream: TextStream) -> CompletionResponseGen:
        text = ""
        for delta, result in _with_results(deltas, stream):
            text += delta
            yield CompletionResponse(text=text, delta=delta, **self._extras(result))

    async def _astream_completions(self, deltas: AsyncIterator[str], stream: TextStream) -> CompletionResponseAsyncGen:
        text = ""
        async for delta, result in _awith_results(deltas, stream):
            text += delta
            yield CompletionResponse(text=text, delta=delta, **self._extras(result))

    def _stream_chats(self, deltas: Iterator[str], stream: TextStream) -> ChatResponseGen:
        text = ""
        for delta, result in _with_results(deltas, stream):
            text += delta
            message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
            yield ChatResponse(message=message, delta=delta, **self._extras(result))

    async def _astream_chats(self, deltas: AsyncIterator[str], stream: TextStream) -> ChatResponseAsyncGen:
        text = ""
        async for delta, result in _awith_results(deltas, stream):
            text += delta
            message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
            yield ChatResponse(message=message, delta=delta, **self._extras(result))

    # -- sync API ------------------------------------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Raw completion of `prompt` (after `completion_to_prompt` unless `formatted`)."""
        prompt = self._completion_prompt(prompt, formatted)
        return self._completion(self.ensemble.generate(prompt, **self._options(kwargs)))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """Stream of `CompletionResponse(text=<verified text so far>, delta=<new verified text>)`."""
        prompt = self._completion_prompt(prompt, formatted)
        stream = self.ensemble.stream(prompt, **self._options(kwargs))  # loads and validates now, not lazily
        return self._stream_completions(stream, stream)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """The assistant's reply, each member reading the conversation through its own chat template."""
        return self._chat(self.ensemble.generate(**self._chat_request(messages), **self._options(kwargs)))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        stream = self.ensemble.stream(**self._chat_request(messages), **self._options(kwargs))
        return self._stream_chats(stream, stream)

    # -- async API: loading, tokenisation and every decoding round run in worker threads --------------------------
    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        prompt = self._completion_prompt(prompt, formatted)
        ensemble = await self._aensemble()
        return self._completion(await ensemble.agenerate(prompt, **self._options(kwargs)))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        prompt = self._completion_prompt(prompt, formatted)
        stream = await self._astart({"prompt": prompt}, kwargs)
        return self._astream_completions(_adeltas(stream), stream)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        request = self._chat_request(messages)
        ensemble = await self._aensemble()
        return self._chat(await ensemble.agenerate(**request, **self._options(kwargs)))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        stream = await self._astart(self._chat_request(messages), kwargs)
        return self._astream_chats(_adeltas(stream), stream)

    async def _astart(self, request: dict[str, Any], kwargs: dict[str, Any]) -> TextStream:
        ensemble = await self._aensemble()
        options = self._options(kwargs)
        return await asyncio.to_thread(lambda: ensemble.stream(**request, **options))


# -- helpers ---------------------------------------------------------------------------------------------------
def _with_results(deltas: Iterator[str], stream: TextStream) -> Iterator[tuple[str, GenerationResult | None]]:
    """(delta, result-if-this-is-the-last-delta); a final ("", result) when the last round added no text,
    so the statistics always arrive. Closing early frees the request's caches."""
    carried = False
    try:
        for delta in deltas:
            carried = stream.result is not None
            yield delta, stream.result
        if not carried:
            yield "", stream.result
    finally:
        stream.close()


async def _awith_results(
    deltas: AsyncIterator[str], stream: TextStream
) -> AsyncIterator[tuple[str, GenerationResult | None]]:
    carried = False
    try:
        async for delta in deltas:
            carried = stream.result is not None
            yield delta, stream.result
        if not carried:
            yield "", stream.result
    finally:
        await deltas.aclose()


async def _adeltas(stream: TextStream) -> AsyncIterator[str]:
    """Drive a TextStream from asyncio, one decoding round per worker-thread hop.

    (The engine's `Ensemble.astream` does the same but hides the stream, whose `.result` carries the stats.)
    """
    sentinel = object()
    try:
        while True:
            delta = await asyncio.to_thread(next, stream, sentinel)
            if delta is sentinel:
                return
            yield delta
    finally:
        stream.close()


def _engine_message(message: ChatMessage) -> dict[str, Any]:
    role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
    converted: dict[str, Any] = {"role": _ROLE_ALIASES.get(role, role), "content": message.content or ""}
    for key in _MESSAGE_EXTRAS:
        if message.additional_kwargs.get(key) is not None:
            converted[key] = message.additional_kwargs[key]
    return converted
