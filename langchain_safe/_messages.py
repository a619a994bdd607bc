"""LangChain messages -> the engine's OpenAI-style dicts, and the engine's tool calls -> LangChain's.

Only translation: the OpenAI shape comes from langchain-core (`convert_to_openai_messages`); reading
tool calls out of the verified text, and showing tools to each member, are the engine's
(`safe_engine.shaping.tools`), shared with the LlamaIndex adapter and the server.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from langchain_core.messages import BaseMessage, InvalidToolCall, ToolCall, convert_to_openai_messages
from langchain_core.messages.tool import invalid_tool_call, tool_call

from safe_engine import GenerationResult
from safe_engine.errors import InputError, InputTypeError

# Content blocks that carry no text for the model but are not an error either: tool calls travel in
# "tool_calls" (Anthropic-style "tool_use" blocks duplicate them), reasoning is not replayed.
_IGNORED_BLOCKS = frozenset({"tool_use", "tool_call", "tool_call_chunk", "invalid_tool_call", "reasoning", "thinking"})
_MEDIA_BLOCKS = frozenset(
    {"image", "image_url", "audio", "input_audio", "video", "file", "document", "pdf", "media", "text-plain"}
)


def to_engine_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """OpenAI-style dicts (role, content, tool_calls, tool_call_id) with text contents, for the engine."""
    for i, message in enumerate(messages):
        if not isinstance(message, BaseMessage):
            raise InputTypeError(f"messages[{i}] is a {type(message).__name__}, not a LangChain message")
    try:
        converted = convert_to_openai_messages(list(messages), text_format="block")
    except (ValueError, TypeError, NotImplementedError) as err:
        raise InputTypeError(f"ChatSafe cannot send these messages to a chat template: {err}") from err
    out = []
    for i, entry in enumerate(converted):
        entry["content"] = _text(entry.get("content") or [], i)
        if entry["role"] == "function":  # LangChain's legacy FunctionMessage: a tool result
            entry["role"] = "tool"
        out.append(entry)
    return out


def _text(blocks: list[Any], index: int) -> str:
    """The message's text; media blocks are refused (the members are text-only LMs)."""
    parts: list[str] = []
    for block in blocks:
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            parts.append(str(block.get("text", "")))
        elif kind in _IGNORED_BLOCKS:
            continue
        elif kind in _MEDIA_BLOCKS:
            raise InputError(
                f"messages[{index}] has a {kind!r} content block; the ensemble's members are text-only, "
                "so pass text (e.g. a transcription or description) instead"
            )
        else:
            raise InputError(f"messages[{index}] has an unsupported content block {block!r:.80}; pass text")
    return "".join(parts)


def langchain_tool_calls(result: GenerationResult) -> tuple[list[ToolCall], list[InvalidToolCall]]:
    """The engine's tool calls and invalid calls as LangChain's `ToolCall` / `InvalidToolCall`."""
    calls = [tool_call(name=c["name"], args=c["arguments"], id=c["id"]) for c in result.tool_calls or ()]
    invalid = [
        invalid_tool_call(name=c["name"], args=c["arguments"], id=c["id"], error=c["error"])
        for c in result.invalid_tool_calls or ()
    ]
    return calls, invalid
