"""`ChatSafe`: a SAFE ensemble as a LangChain chat model (`BaseChatModel`), with tool calling."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import TYPE_CHECKING, Any, cast

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from safe_engine import GenerationResult, Request, StreamEvent
from safe_engine.errors import ConfigError
from safe_engine.shaping.tools import normalize_tool_choice
from safe_engine.stats import TokenLogprob

from ._base import SafeParams
from ._messages import langchain_tool_calls, to_engine_messages

if TYPE_CHECKING:
    from langchain_core.utils.pydantic import TypeBaseModel


class ChatSafe(SafeParams, BaseChatModel):
    """Chat with a SAFE ensemble: every member reads the conversation through its own chat template.

    Build it from an existing `Ensemble` or from model specs (loaded on first use)::

        chat = ChatSafe(models=["qwen2.5-coder-0.5b", "smollm2-135m"], max_tokens=128)
        chat.invoke("Name three primary colours.")

    Generation knobs are fields, overridable per call (see `SafeLLM`); `timeout` (seconds) is enforced
    per generation (`GenerationTimeout`). Replies carry `usage_metadata` (input tokens: the drafter's
    prompt; output tokens: the drafter's generated tokens) and `response_metadata` with `finish_reason`,
    `ensemble_rate` (E/T) and the full `stats`.

    Tools: `bind_tools` passes OpenAI-style schemas to every member's chat template. Templates that
    render `tools` (Qwen2.5, Mistral v0.3, ...) use their own format; for members whose template ignores
    tools the engine describes them in that member's system message, asking for the same
    ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` format. The engine reads the calls back
    from the verified text (`safe_engine.shaping.tools`: tagged, or a bare JSON object as small models often
    write); a malformed call becomes an `invalid_tool_calls` entry, and a stream never shows the start
    of a call as content. Decoding is constrained by a grammar across the ensemble (`safe_engine.shaping.constrained`):
    `tool_choice` "auto" allows text or valid calls, "any"/"required" one or more valid calls only, a tool
    name exactly one call to it; `with_structured_output` output follows the schema.
    """

    streaming: bool = False
    """Stream even on `invoke` (LangChain convention); output is the same either way."""

    @property
    def _llm_type(self) -> str:
        return "safe-ensemble-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._safe_identifying_params()

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return LangSmithParams(**self._ls_params("chat", stop, kwargs))

    # -- tools ---------------------------------------------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: dict | str | bool | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (any form `convert_to_openai_tool` accepts).

        `tool_choice`: None/"auto" (the model decides), "none" (tools are not shown), "any"/"required"/True
        (must call one), a tool name or {"type": "function", "function": {"name": ...}} (must call it); the
        choice is enforced by the grammar the ensemble decodes under. `parallel_tool_calls=False`: one call
        at most. `strict` is accepted for compatibility: calls always follow the tools' schemas.
        """
        del strict
        formatted = [convert_to_openai_tool(t) for t in tools]
        choice = normalize_tool_choice(tool_choice, formatted)  # an unknown tool name fails here, not later
        if choice != "auto":
            kwargs["tool_choice"] = choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        include_raw: bool = False,
        method: str = "json_schema",
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | Any]:
        """Replies parsed into `schema` (a Pydantic class, TypedDict, JSON schema or OpenAI tool schema), with
        decoding constrained so the reply follows it, whichever member proposed the text:

        - `method="json_schema"` (default): the reply is a JSON value of the schema (the members are also
          told the schema in the system message);
        - `method="function_calling"`: the schema is bound as a tool the reply must call;
        - `method="json_mode"`: the reply is a JSON object (any keys: describe the format in your prompt).

        The schema is strict unless `strict=False`: an object that does not say `additionalProperties` takes
        only the keys it names (OpenAI's strict mode); `strict=False` keeps JSON Schema's meaning (extra keys
        allowed). Either way the output follows the schema. A reply cut by `max_tokens` can still fail to
        parse: the parser then raises (or, with `include_raw=True`, gives `parsed=None` and the
        `parsing_error`).
        """
        if strict not in (None, True, False):
            raise ConfigError(f"strict must be True, False or None, got {strict!r}")
        if method == "function_calling":
            return super().with_structured_output(schema, include_raw=include_raw, **kwargs)
        if method not in ("json_schema", "json_mode"):
            raise ConfigError(f"unknown method {method!r}; use 'json_schema', 'function_calling' or 'json_mode'")
        if kwargs:
            raise ConfigError(f"unsupported argument(s) {sorted(kwargs)} for with_structured_output")
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        # (a pydantic model class, v1 or v2, when `pydantic`: checked just above)
        parser = PydanticOutputParser(pydantic_object=cast("TypeBaseModel", schema)) if pydantic else JsonOutputParser()
        if method == "json_mode":
            response_format: dict[str, Any] = {"type": "json_object"}
        else:
            spec = {"name": "output", "schema": convert_to_json_schema(schema), "strict": strict is not False}
            response_format = {"type": "json_schema", "json_schema": spec}
        llm = self.bind(
            response_format=response_format,
            ls_structured_output_format={"kwargs": {"method": method}, "schema": schema},
        )
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")

    # -- generation ----------------------------------------------------------------------------------
    def _chat_request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> Request:
        """The engine's Request: the conversation, the bound tools (any form LangChain converts), options."""
        kwargs = dict(kwargs)
        if kwargs.get("tools"):
            kwargs["tools"] = [convert_to_openai_tool(t) for t in kwargs["tools"]]
        return self._request(stop, kwargs, messages=to_engine_messages(messages))

    def _reply_fields(self, result: GenerationResult, logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        """tool_calls, invalid_tool_calls, usage_metadata, response_metadata of the final message (`logprobs`:
        those a stream's last chunk still has to report)."""
        calls, invalid = langchain_tool_calls(result)
        metadata = self._generation_info(result, logprobs)
        metadata["model_provider"] = "safe"
        prompt, output = self._prompt_tokens(result), int(result.stats.tokens)
        return {
            "tool_calls": calls,
            "invalid_tool_calls": invalid,
            "usage_metadata": UsageMetadata(input_tokens=prompt, output_tokens=output, total_tokens=prompt + output),
            "response_metadata": metadata,
        }

    def _chunk(self, event: StreamEvent) -> ChatGenerationChunk | None:
        """The chunk for one stream event: the content that can be shown; the last one has the calls."""
        if event.result is None:
            if not event.content and not event.logprobs:
                return None
            info = self._logprobs_info(event.logprobs) if event.logprobs else {}
            return ChatGenerationChunk(message=AIMessageChunk(content=event.content, response_metadata=info))
        rest = None if event.result.logprobs is None else event.logprobs or []  # the others came in earlier chunks
        fields = self._reply_fields(event.result, rest)
        return ChatGenerationChunk(message=AIMessageChunk(content=event.content, chunk_position="last", **fields))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for event in self._holder.events(self._chat_request(messages, stop, kwargs)):
            if chunk := self._chunk(event):
                yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for event in await self._holder.aevents(self._chat_request(messages, stop, kwargs)):
            if chunk := self._chunk(event):
                yield chunk

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return self._chat_result(self.get_ensemble().generate(self._chat_request(messages, stop, kwargs)))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request = self._chat_request(messages, stop, kwargs)
        ensemble = await self.aget_ensemble()
        return self._chat_result(await ensemble.agenerate(request))

    def _chat_result(self, result: GenerationResult) -> ChatResult:
        message = AIMessage(content=result.content or "", **self._reply_fields(result))
        info = {k: message.response_metadata[k] for k in ("finish_reason", "model_name")}
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])
