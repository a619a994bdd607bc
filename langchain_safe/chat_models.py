"""`ChatSafe`: a SAFE ensemble as a LangChain chat model (`BaseChatModel`), with tool calling."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool

from safe_engine import Ensemble, GenerationResult
from safe_engine.errors import ConfigError

from ._base import SafeParams, awith_result, drafter_prompt_tokens, with_result
from ._messages import ContentStream, ParsedReply, to_engine_messages


class ChatSafe(SafeParams, BaseChatModel):
    """Chat with a SAFE ensemble: every member reads the conversation through its own chat template.

    Build it from an existing `Ensemble` or from model specs (loaded on first use)::

        chat = ChatSafe(models=["qwen2.5-coder-0.5b", "smollm2-135m"], max_tokens=128)
        chat.invoke("Name three primary colours.")

    Generation knobs are fields, overridable per call (see `SafeLLM`). Replies carry `usage_metadata`
    (input tokens: the drafter's prompt; output tokens: the drafter's generated tokens) and
    `response_metadata` with `finish_reason`, `ensemble_rate` (E/T) and the full `stats`.

    Tools: `bind_tools` passes OpenAI-style schemas to every member's chat template. Templates that
    render `tools` (Qwen2.5, Mistral v0.3, ...) use their own format; for members whose template ignores
    tools the engine describes them in that member's system message, asking for the same
    ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` format. Tool calls are parsed from the
    verified text (tagged, or a bare JSON object as small models often write); a malformed call becomes
    an `invalid_tool_calls` entry. `tool_choice` ("any"/"required"/a tool name) cannot constrain
    decoding; it adds an instruction to call the tool(s) to the system message.
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
        (must call one), a tool name or {"type": "function", "function": {"name": ...}} (must call it).
        `parallel_tool_calls=False` keeps only the first call of a reply. `strict` is accepted for
        compatibility and has no effect: arguments are parsed from free text, never schema-constrained.
        """
        del strict
        formatted = [convert_to_openai_tool(t) for t in tools]
        names = [t["function"]["name"] for t in formatted]
        choice = _normalise_tool_choice(tool_choice, names)
        if choice is not None:
            kwargs["tool_choice"] = choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    # -- generation ----------------------------------------------------------------------------------
    def _request(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[dict[str, Any], ContentStream, bool]:
        """(Ensemble.stream keyword arguments, content filter, keep only the first tool call)."""
        kwargs = dict(kwargs)
        tools = kwargs.pop("tools", None) or None
        choice = kwargs.pop("tool_choice", None)
        parallel = kwargs.pop("parallel_tool_calls", None)
        if tools is not None:
            tools = [convert_to_openai_tool(t) for t in tools]
        options = self._engine_options(stop, kwargs)
        engine_messages = to_engine_messages(messages)
        forced: str | None = None
        if tools and choice not in (None, "auto"):
            names = [t["function"]["name"] for t in tools]
            choice = _normalise_tool_choice(choice, names)
            if choice == "none":
                tools = None
            elif choice is not None and choice != "auto":
                if choice == "any" and len(names) == 1:
                    forced = names[0]
                elif choice != "any":
                    forced = choice
                engine_messages = _with_tool_instruction(engine_messages, forced)
        request = {"messages": engine_messages, **options}
        if tools:
            request["tools"] = tools
        return request, ContentStream(tools, forced), parallel is False

    def _final_chunk(
        self, tail: str, parsed: ParsedReply, result: GenerationResult, ens: Ensemble, first_only: bool
    ) -> ChatGenerationChunk:
        fields = self._reply_fields(parsed, result, ens, first_only)
        return ChatGenerationChunk(message=AIMessageChunk(content=tail, chunk_position="last", **fields))

    def _reply_fields(
        self, parsed: ParsedReply, result: GenerationResult, ens: Ensemble, first_only: bool
    ) -> dict[str, Any]:
        """tool_calls, invalid_tool_calls, usage_metadata, response_metadata of the final message."""
        calls, invalid = parsed.tool_calls, parsed.invalid_tool_calls
        if first_only and calls:
            calls, invalid = calls[:1], []
        metadata = self._generation_info(result, ens)
        metadata["model_provider"] = "safe"
        return {
            "tool_calls": calls,
            "invalid_tool_calls": invalid,
            "usage_metadata": self._usage(result, ens),
            "response_metadata": metadata,
        }

    def _usage(self, result: GenerationResult, ens: Ensemble) -> UsageMetadata:
        prompt = drafter_prompt_tokens(result, ens)
        output = int(result.stats.tokens)
        return UsageMetadata(input_tokens=prompt, output_tokens=output, total_tokens=prompt + output)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        request, content, first_only = self._request(messages, stop, kwargs)
        ens = self.get_ensemble()
        for delta, result in with_result(lambda: ens.stream(**request)):
            text = content.feed(delta)
            if result is None:
                if text:
                    yield ChatGenerationChunk(message=AIMessageChunk(content=text))
                continue
            tail, parsed = content.finish()
            yield self._final_chunk(text + tail, parsed, result, ens, first_only)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        request, content, first_only = self._request(messages, stop, kwargs)
        ens = await self.aget_ensemble()
        async for delta, result in awith_result(lambda: ens.astream(**request)):
            text = content.feed(delta)
            if result is None:
                if text:
                    yield ChatGenerationChunk(message=AIMessageChunk(content=text))
                continue
            tail, parsed = content.finish()
            yield self._final_chunk(text + tail, parsed, result, ens, first_only)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request, content, first_only = self._request(messages, stop, kwargs)
        ens = self.get_ensemble()
        result = ens.generate(**request)
        return self._chat_result(content, result, ens, first_only)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request, content, first_only = self._request(messages, stop, kwargs)
        ens = await self.aget_ensemble()
        result = await ens.agenerate(**request)
        return self._chat_result(content, result, ens, first_only)

    def _chat_result(
        self, content: ContentStream, result: GenerationResult, ens: Ensemble, first_only: bool
    ) -> ChatResult:
        content.feed(result.text)
        _, parsed = content.finish()
        message = AIMessage(content=parsed.content, **self._reply_fields(parsed, result, ens, first_only))
        info = {k: message.response_metadata[k] for k in ("finish_reason", "model_name")}
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])


def _normalise_tool_choice(choice: Any, names: list[str]) -> str | None:
    """None | "auto" | "none" | "any" | a tool name, from the forms LangChain callers use."""
    if choice is None or choice is False:
        return None
    if choice is True or choice == "required":
        return "any"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") or choice.get("name")
        if not isinstance(name, str):
            raise ConfigError(f"tool_choice {choice!r} names no tool; use {{'function': {{'name': ...}}}}")
        choice = name
    if not isinstance(choice, str):
        raise ConfigError(f"tool_choice must be a string, dict, bool or None, got {choice!r}")
    if choice in ("auto", "none", "any"):
        return choice
    if choice not in names:
        raise ConfigError(f"tool_choice {choice!r} is not a bound tool; bound tools: {names}")
    return choice


def _with_tool_instruction(messages: list[dict[str, Any]], forced: str | None) -> list[dict[str, Any]]:
    """Ask for a tool call in the system message (decoding itself cannot be constrained)."""
    # Measured on the demo models: a direct "must call" + "only the tool call" makes a 0.5B model answer
    # with the call instead of talking about it.
    instruction = (
        f'You must call the tool "{forced}". Reply with only the tool call, no other text.'
        if forced
        else "You must call one of the tools. Reply with only the tool call(s), no other text."
    )
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{instruction}".strip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]
