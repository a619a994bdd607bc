"""`SafeLLM`: a LlamaIndex `FunctionCallingLLM` (and `CustomLLM`) over a SAFE `Ensemble`.

Thin: every algorithmic step is the engine's. Construction follows `llama-index-llms-huggingface`'s
`HuggingFaceLLM` (model spec + `device_map` + knobs as fields, `completion_to_prompt` /
`messages_to_prompt` / `system_prompt`) and improves on it:

* nothing is loaded until the first call (`models=[...]`), and `metadata` can be read before that:
  context windows and chat templates are peeked from the members' config files where that is cheap;
* `chat` renders the conversation with *each member's own* chat template (the engine's `messages=`),
  not with a generic "role: content" transcript;
* tool calling (`chat_with_tools`, `FunctionAgent`, `structured_predict`): the engine shows the tools to
  each member's template and reads the calls back from the verified text (`safe_engine.shaping.tools`, the
  same reader as the LangChain adapter's);
* `stream_complete` applies `completion_to_prompt` exactly like `complete` does;
* the async methods run loading and tokenisation in worker threads, so the event loop keeps running
  (`HuggingFaceLLM` iterates a sync generator inside `astream_complete`);
* every response carries the ensemble statistics (E/T, rounds, forward passes) in `additional_kwargs` and
  `raw`, with `raw["usage"]` in the shape LlamaIndex's token counter reads.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator, Sequence
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
    LogProb,
    MessageRole,
)
from llama_index.core.bridge.pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from llama_index.core.callbacks import CallbackManager
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.prompts import PromptTemplate

from safe_engine import Ensemble, GenerationResult, ModelSpec, Request, StreamEvent
from safe_engine.engine.lazy import LOAD_OPTIONS, LazyEnsemble
from safe_engine.errors import ConfigError, ToolCallError, from_validation_error
from safe_engine.knobs import OPTION_NAMES, UNSET_SAMPLING, adapted
from safe_engine.runtime.llamacpp import peek_window
from safe_engine.runtime.members import peek_spec
from safe_engine.shaping.request import check_known_fields, request_for_call, show_preset, standing_options
from safe_engine.stats import TokenLogprob

from ._messages import engine_message, reply_message, tool_schema, tool_selections

#: Names of the engine's generation options (GenerationConfig's fields and `preset`); per-call keyword
#: arguments with these names override fields.
GENERATION_OPTIONS: tuple[str, ...] = OPTION_NAMES
# GenerationConfig's fields, with LlamaIndex's conventions: stop strings as a list, `timeout` in seconds.
_KNOBS = adapted(
    {
        **UNSET_SAMPLING,
        "stop": {"type": list[str], "default": [], "doc": "stop strings (excluded from the output)"},
        "timeout_s": {"alias": "timeout", "doc": "wall-clock limit of one generation in seconds (alias timeout)"},
        "logprobs": {
            "type": bool | int | None,
            "doc": "report each token's log-probability in the responses' `logprobs`: True (with top_logprobs, as "
            "LlamaIndex's OpenAI) or a number of alternatives per token",
        },
    }
)
_KNOB_FIELDS: dict[str, Any] = {k.name: (k.type, Field(k.default, alias=k.alias, description=k.doc)) for k in _KNOBS}
_GenerationKnobs: type[BaseModel] = create_model("GenerationKnobs", **_KNOB_FIELDS)


# mypy takes no variable as a base class, and this one is built by create_model() at import time
class SafeLLM(FunctionCallingLLM, CustomLLM, _GenerationKnobs):  # type: ignore[misc,valid-type]
    """SAFE ensemble of causal LMs with different tokenizers, as a LlamaIndex LLM that calls tools.

    Examples:
        ```python
        from llama_index.core import Settings
        from llamaindex_safe import SafeLLM  # or: from llama_index.llms.safe import SafeLLM

        Settings.llm = SafeLLM(models=["qwen2.5-coder-0.5b", "smollm2-135m"], max_new_tokens=128)
        print(Settings.llm.complete("def fibonacci(n):"))
        ```

    Pass either `ensemble=` (an already built `safe_engine.Ensemble`) or `models=[spec, ...]` (hub ids,
    directories, `.gguf` files, demo model names or `ModelSpec`s, loaded on first use with `drafter`,
    `weights`, `device_map`, `dtype`, `quantization`, `backend`, `kv_positions` and `trust_remote_code`).
    Generation options (every `GenerationConfig` field) are fields and can be overridden per call:
    `llm.complete(prompt, max_new_tokens=32, method="every_token")`; `timeout` is enforced per generation.
    `preset="paper-unite"` / `"paper-gac"` (a field or per call) is the paper's configuration under the
    options set explicitly (`safe_engine.presets`).

    Tools: `chat_with_tools` / `FunctionAgent` / `structured_predict` work through the members' chat
    templates; a reply's calls are `ToolCallBlock`s of its message (`get_tool_calls_from_response`), calls
    that could not be read are in `raw["invalid_tool_calls"]`. Decoding follows a grammar across the
    ensemble: with tools, text or valid calls; `tool_required` / `tool_choice` "required" only calls, a
    tool name exactly one call to it; `structured_predict` output follows the output class's JSON schema.
    """

    model_config = ConfigDict(populate_by_name=True)

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
    quantization: str | None = Field(
        default=None, description='"int8": int8 linear layers (CPU; bitsandbytes 8-bit on a GPU).'
    )
    backend: str | list[str] = Field(
        default="auto",
        description='"auto" (a GGUF source on the CPU runs in llama.cpp when installed), "torch", "llama.cpp", "ray".',
    )
    kv_positions: int | None = Field(
        default=None,
        gt=0,
        description="KV positions each llama.cpp member's requests share (default one window, 4,096).",
    )
    top_logprobs: int | None = Field(
        default=None, description="With logprobs=True: the most likely alternatives (0-20) reported per token."
    )

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

    _holder: LazyEnsemble = PrivateAttr()
    _peeked: tuple[int | None, bool] | None = PrivateAttr(default=None)
    _peek_done: bool = PrivateAttr(default=False)

    def __init__(
        self,
        ensemble: Ensemble | None = None,
        models: Sequence[str | os.PathLike | ModelSpec] | None = None,
        callback_manager: CallbackManager | None = None,
        **kwargs: Any,
    ) -> None:
        dtype = kwargs.get("dtype")
        if dtype is not None and not isinstance(dtype, str):  # a torch.dtype: keep the field serialisable
            kwargs["dtype"] = str(dtype).removeprefix("torch.")
        loading = {k: kwargs.get(k, default) for k, default in LOAD_OPTIONS.items()}
        holder = LazyEnsemble(ensemble, models, owner=type(self).__name__, **loading)
        kwargs["drafter"] = holder.drafter_index
        try:
            super().__init__(models=holder.specs, callback_manager=callback_manager, **kwargs)
        except ValidationError as err:  # this library's errors, not pydantic's
            raise from_validation_error(type(self).__name__, err) from err
        self._holder = holder

    # -- validation -----------------------------------------------------------------------------------
    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown(cls, data: Any) -> Any:
        """A misspelt option is an error, not silently dropped."""
        check_known_fields(cls, data, frozenset({"class_name"}))  # class_name: LlamaIndex's to_dict round trip
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check_options(self) -> SafeLLM:
        self._request({}, prompt=" ")  # the engine's own checks, at construction time
        show_preset(self, GENERATION_OPTIONS)
        return self

    @classmethod
    def class_name(cls) -> str:
        return "SafeLLM"

    # -- the ensemble, loaded lazily --------------------------------------------------------------------
    @property
    def is_loaded(self) -> bool:
        """Whether the members are in memory (always true for `ensemble=`)."""
        return self._holder.is_loaded

    @property
    def ensemble(self) -> Ensemble:
        """The engine's `Ensemble`, loading the members on first access."""
        return self._holder.get()

    # -- metadata -----------------------------------------------------------------------------------------
    @property
    def metadata(self) -> LLMMetadata:
        """Context window = the smallest of the members' (capped by `context_window`); no load if avoidable."""
        return self._metadata(load=True)

    def to_payload(self) -> dict[str, Any]:
        """What instrumentation events carry; never loads models (it runs on the event loop in async calls)."""
        payload = {"class_name": self.class_name(), **self._metadata(load=False).model_dump()}
        payload.update(members=self._holder.names, drafter=self.drafter_name, method=self.method)
        return payload

    @property
    def drafter_name(self) -> str:
        return self._holder.drafter_name

    def _metadata(self, load: bool) -> LLMMetadata:
        if self._holder.is_loaded:
            ensemble = self._holder.get()
            window = ensemble.context_window
            chat = all(m.chat_template for m in ensemble.members)
        else:
            peeked = self._peek()
            if peeked is None and load:
                self._holder.get()  # not cheaply known: load the members
                return self._metadata(load=True)
            window, chat = peeked or (None, False)
        if self.context_window is not None:
            window = min(window, self.context_window) if window else self.context_window
        return LLMMetadata(
            context_window=window or DEFAULT_CONTEXT_WINDOW,
            num_output=self.max_new_tokens,
            is_chat_model=chat if self.is_chat_model is None else self.is_chat_model,
            # tools need every member's own template (not a custom messages_to_prompt rendering)
            is_function_calling_model=chat and not self._uses_custom_messages_to_prompt(),
            model_name=self.model_name or "safe:" + "+".join(self._holder.names),
        )

    def _peek(self) -> tuple[int | None, bool] | None:
        """(smallest context window, every member has a chat template) from config files, or None."""
        if not self._peek_done:
            specs = self.models or []
            backends = self.backend if isinstance(self.backend, list) else [self.backend] * len(specs)
            found = [peek_spec(spec, self.trust_remote_code) for spec in specs]
            found = [f and (peek_window(spec, b, f[0]), f[1]) for spec, b, f in zip(specs, backends, found)]
            known = [f for f in found if f is not None]
            if found and len(known) == len(found):  # every spec was peeked
                windows = [w for w, _ in known if w]
                self._peeked = (min(windows) if windows else None, all(chat for _, chat in known))
            self._peek_done = True
        return self._peeked

    # -- options and prompts --------------------------------------------------------------------------------
    def _request(self, kwargs: dict[str, Any], **inputs: Any) -> Request:
        """The engine's `Request` for one call: the fields, overridden by the call's options (any
        `build_request` keyword, under the engine's shared semantics: temperature 0 = greedy, max_tokens,
        timeout), for the prompt or messages in `inputs`."""
        settings = standing_options(self, GENERATION_OPTIONS) | {"top_logprobs": self.top_logprobs}
        if "stop" in settings:
            settings["stop"] = tuple(self.stop)
        return request_for_call(settings, kwargs, **inputs)

    def _completion_prompt(self, prompt: str, formatted: bool) -> str:
        if formatted:
            return prompt
        completion_to_prompt = self.completion_to_prompt
        assert completion_to_prompt is not None, "LLM's validators default it (to default_completion_to_prompt)"
        return completion_to_prompt(prompt)

    def _uses_custom_messages_to_prompt(self) -> bool:
        return self.messages_to_prompt is not generic_messages_to_prompt

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> Request:
        """The engine's Request for a conversation: `messages=` for the members' own templates, or the user's
        `messages_to_prompt` rendering as a raw prompt."""
        kwargs = dict(kwargs)
        if kwargs.get("tools"):
            kwargs["tools"] = [tool_schema(t) for t in kwargs["tools"]]
        if self._uses_custom_messages_to_prompt():
            if kwargs.get("tools"):
                raise ConfigError(
                    "tools are shown to each member through its own chat template, which a custom "
                    "messages_to_prompt replaces; drop messages_to_prompt to call tools"
                )
            messages_to_prompt = self.messages_to_prompt
            assert messages_to_prompt is not None, "LLM's validators default it (to generic_messages_to_prompt)"
            return self._request(kwargs, prompt=messages_to_prompt(messages))
        converted = [engine_message(m) for m in messages]
        if self.system_prompt and not (converted and converted[0]["role"] == "system"):
            converted.insert(0, {"role": "system", "content": self.system_prompt})
        return self._request(kwargs, messages=converted)

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
        if result.trace is not None:
            raw["trace"] = [p.to_dict() for p in result.trace]
        return {"additional_kwargs": {"finish_reason": result.finish_reason, **stats}, "raw": raw}

    def _completion(self, result: GenerationResult) -> CompletionResponse:
        return CompletionResponse(text=result.text, logprobs=_logprobs(result.logprobs), **self._extras(result))

    def _chat(self, result: GenerationResult) -> ChatResponse:
        return self._chat_response(result.content or "", "", result)

    def _chat_response(
        self, text: str, delta: str, result: GenerationResult | None, logprobs: list[TokenLogprob] | None = None
    ) -> ChatResponse:
        """A reply so far (the last one with its tool calls, and the invalid ones in raw); `logprobs`: a
        streamed response's own tokens' (default: the result's, all of them)."""
        if result is None:
            message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
            return ChatResponse(message=message, delta=delta, logprobs=_logprobs(logprobs))
        extras = self._extras(result)
        if result.invalid_tool_calls:
            extras["raw"]["invalid_tool_calls"] = result.invalid_tool_calls
        entries = result.logprobs if logprobs is None else logprobs
        return ChatResponse(message=reply_message(result), delta=delta, logprobs=_logprobs(entries), **extras)

    def _completions(self, events: Iterator[StreamEvent]) -> CompletionResponseGen:
        text = ""
        for event in events:
            text += event.delta
            logprobs = _logprobs(event.logprobs)  # the delta's tokens
            yield CompletionResponse(text=text, delta=event.delta, logprobs=logprobs, **self._extras(event.result))

    async def _acompletions(self, events: AsyncIterator[StreamEvent]) -> CompletionResponseAsyncGen:
        text = ""
        async for event in events:
            text += event.delta
            logprobs = _logprobs(event.logprobs)  # the delta's tokens
            yield CompletionResponse(text=text, delta=event.delta, logprobs=logprobs, **self._extras(event.result))

    def _chats(self, events: Iterator[StreamEvent]) -> ChatResponseGen:
        text = ""
        for event in events:
            if response := self._chat_chunk(event, text):
                text = response.message.content or ""
                yield response

    async def _achats(self, events: AsyncIterator[StreamEvent]) -> ChatResponseAsyncGen:
        text = ""
        async for event in events:
            if response := self._chat_chunk(event, text):
                text = response.message.content or ""
                yield response

    def _chat_chunk(self, event: StreamEvent, text: str) -> ChatResponse | None:
        """The streamed reply after one event: only text that cannot turn into a tool call is shown."""
        if event.result is None and not event.content and not event.logprobs:
            return None
        # a stream's event carries its own tokens' logprobs (None when off)
        return self._chat_response(text + event.content, event.content, event.result, event.logprobs)

    # -- sync API ------------------------------------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Raw completion of `prompt` (after `completion_to_prompt` unless `formatted`)."""
        request = self._request(kwargs, prompt=self._completion_prompt(prompt, formatted))
        return self._completion(self.ensemble.generate(request))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """Stream of `CompletionResponse(text=<verified text so far>, delta=<new verified text>)`."""
        request = self._request(kwargs, prompt=self._completion_prompt(prompt, formatted))
        return self._completions(self._holder.events(request))  # starts (and checks) now

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """The assistant's reply, each member reading the conversation through its own chat template."""
        return self._chat(self.ensemble.generate(self._chat_request(messages, kwargs)))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._chats(self._holder.events(self._chat_request(messages, kwargs)))

    # -- async API: loading and tokenisation run in worker threads ----------------------------------------------
    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        request = self._request(kwargs, prompt=self._completion_prompt(prompt, formatted))
        ensemble = await self._holder.aget()
        return self._completion(await ensemble.agenerate(request))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        request = self._request(kwargs, prompt=self._completion_prompt(prompt, formatted))
        return self._acompletions(await self._holder.aevents(request))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        request = self._chat_request(messages, kwargs)
        ensemble = await self._holder.aget()
        return self._chat(await ensemble.agenerate(request))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return self._achats(await self._holder.aevents(self._chat_request(messages, kwargs)))

    # -- structured output ---------------------------------------------------------------------------------------
    def structured_predict(
        self,
        output_cls: type[BaseModel],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> BaseModel:
        """`output_cls` filled in by the ensemble, decoding under the class's JSON schema (always valid JSON of
        it, unless cut by `max_new_tokens`)."""
        messages = prompt.format_messages(llm=self, **prompt_args)
        response = self.chat(messages, json_schema=output_cls.model_json_schema(), **(llm_kwargs or {}))
        return output_cls.model_validate_json(response.message.content or "")

    async def astructured_predict(
        self,
        output_cls: type[BaseModel],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> BaseModel:
        messages = prompt.format_messages(llm=self, **prompt_args)
        response = await self.achat(messages, json_schema=output_cls.model_json_schema(), **(llm_kwargs or {}))
        return output_cls.model_validate_json(response.message.content or "")

    # -- FunctionCallingLLM ----------------------------------------------------------------------------------------
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[Any],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """chat() arguments: the conversation, the tools' schemas, and "required" when a call must come."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(
                ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str) else user_msg
            )
        if tool_choice is None and tool_required:
            tool_choice = "required"
        return {
            "messages": messages,
            "tools": [tool_schema(t) for t in tools],
            "tool_choice": tool_choice,
            "parallel_tool_calls": allow_parallel_tool_calls,
            **kwargs,
        }

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The reply's tool calls; with `error_on_no_tool_call`, a ToolCallError (a ValueError) when none."""
        calls = tool_selections(response.message)
        if not calls and error_on_no_tool_call:
            invalid = (response.raw or {}).get("invalid_tool_calls") if isinstance(response.raw, dict) else None
            why = f"; calls that could not be read: {invalid}" if invalid else ""
            raise ToolCallError(
                f"the ensemble replied without a tool call: {response.message.content!r:.200}{why}. Ask for one "
                "(tool_required=True, or a clearer prompt), or pass error_on_no_tool_call=False"
            )
        return calls


def _logprobs(entries: list[TokenLogprob] | None) -> list[list[LogProb]] | None:
    """LlamaIndex's logprobs: per token, its alternatives best first (as LlamaIndex's OpenAI reads
    OpenAI's top_logprobs), or the token alone with logprobs=0. The token's own logprob and `source`
    (ensemble / drafter) are in the engine's result."""
    if entries is None:
        return None
    return [
        [LogProb(token=t.token, logprob=t.logprob, bytes=list(t.bytes)) for t in e.top_logprobs]
        or [LogProb(token=e.token, logprob=e.logprob, bytes=list(e.bytes))]
        for e in entries
    ]
