"""LlamaIndex messages and tools -> the engine's OpenAI-style dicts, and the engine's tool calls -> LlamaIndex's.

Only translation: showing tools to each member and reading calls back out of the verified text are the
engine's (`safe_engine.shaping.tools`), shared with the LangChain adapter and the server.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock, ToolCallBlock
from llama_index.core.llms.llm import ToolSelection

from safe_engine import GenerationResult
from safe_engine.errors import InputTypeError

_ROLE_ALIASES = {MessageRole.CHATBOT.value: "assistant", MessageRole.MODEL.value: "assistant"}
_MESSAGE_EXTRAS = ("tool_calls", "tool_call_id", "name")


def engine_message(message: ChatMessage) -> dict[str, Any]:
    """One OpenAI-style dict: role, text content, tool calls (ToolCallBlocks), tool_call_id and name."""
    role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
    converted: dict[str, Any] = {"role": _ROLE_ALIASES.get(role, role), "content": message.content or ""}
    for key in _MESSAGE_EXTRAS:  # older integrations keep tool calls and ids in additional_kwargs
        if message.additional_kwargs.get(key) is not None:
            converted[key] = message.additional_kwargs[key]
    calls = [_openai_call(block) for block in message.blocks if isinstance(block, ToolCallBlock)]
    if calls:  # the blocks are the calls; additional_kwargs may repeat them
        converted["tool_calls"] = calls
    return converted


def _openai_call(block: ToolCallBlock) -> dict[str, Any]:
    call: dict[str, Any] = {"type": "function", "function": {"name": block.tool_name, "arguments": block.tool_kwargs}}
    if block.tool_call_id is not None:
        call["id"] = block.tool_call_id
    return call


def tool_schema(tool: Any) -> dict[str, Any]:
    """An OpenAI-style schema from a LlamaIndex tool (or a schema given as a dict).

    Pydantic's generated property titles ({"a": {"title": "A", "type": "integer"}}) are dropped, as
    LangChain's `convert_to_openai_tool` drops them: shown them, a 0.5B model fills in
    {"a": {"title": "1234", ...}} instead of {"a": 1234}.
    """
    if isinstance(tool, dict):
        return tool
    metadata = getattr(tool, "metadata", None)
    if metadata is None or not hasattr(metadata, "to_openai_tool"):
        raise InputTypeError(f"tools must be LlamaIndex tools or OpenAI-style schemas, got {type(tool).__name__}")
    schema = metadata.to_openai_tool()
    schema["function"]["parameters"] = _without_titles(schema["function"].get("parameters") or {})
    return schema


def _without_titles(schema: Any) -> Any:
    """The schema without the "title" of each property (a property *named* "title" stays)."""
    if isinstance(schema, list):
        return [_without_titles(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {name: _without_titles(_untitled(sub)) for name, sub in value.items()}
        else:
            out[key] = _without_titles(value)
    return out


def _untitled(schema: Any) -> Any:
    if isinstance(schema, dict) and isinstance(schema.get("title"), str):
        return {k: v for k, v in schema.items() if k != "title"}
    return schema


def reply_message(result: GenerationResult) -> ChatMessage:
    """The assistant's message: its text, then one ToolCallBlock per call (LlamaIndex's own shape); the
    calls also in OpenAI's shape in additional_kwargs["tool_calls"], where LlamaIndex's streaming
    structured output looks for them."""
    calls = [
        ToolCallBlock(tool_call_id=c["id"], tool_name=c["name"], tool_kwargs=c["arguments"])
        for c in result.tool_calls or ()
    ]
    extras = {"tool_calls": [_openai_call(block) for block in calls]} if calls else {}
    return ChatMessage(
        role=MessageRole.ASSISTANT, blocks=[TextBlock(text=result.content or ""), *calls], additional_kwargs=extras
    )


def tool_selections(message: ChatMessage) -> list[ToolSelection]:
    """The calls of a reply as LlamaIndex's ToolSelections (what agents and programs run)."""
    return [
        ToolSelection(
            tool_id=block.tool_call_id or "",
            tool_name=block.tool_name,
            tool_kwargs=block.tool_kwargs if isinstance(block.tool_kwargs, dict) else {},
        )
        for block in message.blocks
        if isinstance(block, ToolCallBlock)
    ]
