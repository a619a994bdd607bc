"""LangChain messages ⇄ the engine's OpenAI-style dicts, and tool calls parsed from verified text.

The engine renders one OpenAI-style message list with every member's own chat template (tools included,
for templates that support them). This module only translates: LangChain messages in, dicts out; the
verified text out of the ensemble in, `AIMessage` content + `tool_calls` / `invalid_tool_calls` out.

Tool-call formats understood in the generated text:

- Qwen2.5 / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (any number of them);
- a bare JSON object ``{"name": ..., "arguments": {...}}`` (or a JSON list of them), optionally inside a
  Markdown code fence, when that object is the whole reply and names a bound tool; small models often
  answer like this even though their template asks for tags;
- when exactly one tool is bound and the caller forces it (`tool_choice`), a bare JSON object of its
  arguments (what small models tend to produce for `with_structured_output`).

A call that cannot be parsed becomes an `invalid_tool_calls` entry, never an exception.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    InvalidToolCall,
    SystemMessage,
    ToolCall,
    ToolMessage,
)
from langchain_core.messages.tool import invalid_tool_call, tool_call

from safe_engine.errors import InputError, InputTypeError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FENCE_RE = re.compile(r"^```[A-Za-z0-9_-]*\s*\n?(.*?)\n?```$", re.DOTALL)

# Content blocks that carry no text for the model but are not an error either: tool calls live in
# AIMessage.tool_calls (Anthropic-style "tool_use" blocks duplicate them), reasoning is not replayed.
_IGNORED_BLOCKS = frozenset({"tool_use", "tool_call", "tool_call_chunk", "invalid_tool_call", "reasoning", "thinking"})
_MEDIA_BLOCKS = frozenset(
    {"image", "image_url", "audio", "input_audio", "video", "file", "document", "pdf", "media", "text-plain"}
)


def new_tool_call_id() -> str:
    """A 9-character alphanumeric id: the strictest format a template asks for (Mistral's)."""
    return uuid.uuid4().hex[:9]


# -- LangChain messages -> OpenAI-style dicts ------------------------------------------------------------
def to_engine_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """OpenAI-style dicts (role, content, tool_calls, tool_call_id) for the members' chat templates."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, BaseMessage):
            raise InputTypeError(f"messages[{i}] is a {type(message).__name__}, not a LangChain message")
        text = _text(message, i)
        if isinstance(message, SystemMessage):
            out.append({"role": "system", "content": text})
        elif isinstance(message, HumanMessage):
            out.append({"role": "user", "content": text})
        elif isinstance(message, AIMessage):
            entry: dict[str, Any] = {"role": "assistant", "content": text}
            if message.tool_calls:
                entry["tool_calls"] = [
                    {
                        "id": call.get("id") or new_tool_call_id(),
                        "type": "function",
                        "function": {"name": call["name"], "arguments": call.get("args") or {}},
                    }
                    for call in message.tool_calls
                ]
            out.append(entry)
        elif isinstance(message, ToolMessage):
            entry = {"role": "tool", "content": text, "tool_call_id": message.tool_call_id}
            if message.name:
                entry["name"] = message.name
            out.append(entry)
        elif isinstance(message, FunctionMessage):
            out.append({"role": "tool", "content": text, "name": message.name})
        elif isinstance(message, ChatMessage):
            out.append({"role": message.role, "content": text})
        else:
            raise InputTypeError(
                f"messages[{i}]: ChatSafe does not know how to send a {type(message).__name__} to a chat "
                "template; use System/Human/AI/Tool messages"
            )
    return out


def _text(message: BaseMessage, index: int) -> str:
    """The message's text; media blocks are refused (the members are text-only LMs)."""
    content = message.content
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
            continue
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


# -- tool calls in the generated text --------------------------------------------------------------------
@dataclass
class ParsedReply:
    """The assistant's reply split into text content and tool calls."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)


def parse_reply(text: str, tools: Sequence[Mapping[str, Any]] | None, forced: str | None = None) -> ParsedReply:
    """Split `text` into content and tool calls (only when tools are bound).

    `forced` names the single tool the caller requires (tool_choice), enabling the bare-arguments fallback.
    """
    if not tools:
        return ParsedReply(text)
    names = {_tool_name(t) for t in tools}
    if TOOL_CALL_OPEN in text:
        calls: list[ToolCall] = []
        invalid: list[InvalidToolCall] = []
        for body in _TOOL_CALL_RE.findall(text):
            _parse_call(body.strip(), calls, invalid)
        # Text before the first call is kept as written (it may have streamed already); between and after
        # calls only text that says something.
        pieces = _TOOL_CALL_RE.split(text)[::2]
        content = pieces[0] + "".join(p for p in pieces[1:] if p.strip())
        return ParsedReply("" if not content.strip() else content, calls, invalid)
    bare = _bare_json(text)
    if bare is not None:
        objs = bare if isinstance(bare, list) else [bare]
        if objs and all(isinstance(o, dict) and isinstance(o.get("name"), str) and o["name"] in names for o in objs):
            calls, invalid = [], []
            for o in objs:
                _parse_call_obj(o, json.dumps(o, ensure_ascii=False), calls, invalid)
            return ParsedReply("", calls, invalid)
        if forced is not None and isinstance(bare, dict) and _looks_like_arguments(bare, _tool_by_name(tools, forced)):
            return ParsedReply("", [tool_call(name=forced, args=bare, id=new_tool_call_id())])
    return ParsedReply(text)


def _parse_call(body: str, calls: list[ToolCall], invalid: list[InvalidToolCall]) -> None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        invalid.append(
            invalid_tool_call(name=_guess_name(body), args=body, id=new_tool_call_id(), error=f"invalid JSON: {err}")
        )
        return
    _parse_call_obj(obj, body, calls, invalid)


def _parse_call_obj(obj: Any, raw: str, calls: list[ToolCall], invalid: list[InvalidToolCall]) -> None:
    def bad(error: str, name: str | None = None) -> None:
        invalid.append(invalid_tool_call(name=name, args=raw, id=new_tool_call_id(), error=error))

    if not isinstance(obj, dict):
        return bad(f"a tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return bad('a tool call needs a "name" string')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as err:
            return bad(f"arguments are not valid JSON: {err}", name)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return bad(f"arguments must be a JSON object, got {type(args).__name__}", name)
    calls.append(tool_call(name=name, args=args, id=new_tool_call_id()))
    return None


def _bare_json(text: str) -> Any:
    """The reply as one JSON value when it is nothing but that (code fences allowed), else None."""
    stripped = text.strip()
    fenced = _FENCE_RE.match(stripped)
    if fenced:
        stripped = fenced.group(1).strip()
    if not stripped.startswith(("{", "[")):
        return None
    try:
        return json.loads(stripped)
    except json.JSONDecodeError:
        return None


def _guess_name(body: str) -> str | None:
    match = re.search(r'"name"\s*:\s*"([^"]+)"', body)
    return match.group(1) if match else None


def _tool_name(tool: Mapping[str, Any]) -> str:
    return tool.get("function", tool).get("name", "")


def _tool_by_name(tools: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any] | None:
    return next((t for t in tools if _tool_name(t) == name), None)


def _looks_like_arguments(obj: dict, tool: Mapping[str, Any] | None) -> bool:
    """Whether `obj` fits the tool's parameters: known keys only, every required key present."""
    if tool is None or not obj:
        return False
    params = tool.get("function", tool).get("parameters") or {}
    properties = set((params.get("properties") or {}).keys())
    required = set(params.get("required") or ())
    return set(obj) <= properties and required <= set(obj)


# -- streaming -------------------------------------------------------------------------------------------
class ContentStream:
    """Decides how much of the verified text can be streamed as content while tools are bound.

    Text before a tool call streams as it is verified; from ``<tool_call>`` on (or from the start, when the
    reply opens like a bare JSON object or a code fence) it is held back until the reply is complete and
    parsed. Whitespace-only text is held back too, so the streamed content is always a prefix of the final
    content (a reply that is only a tool call has content "").
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None, forced: str | None = None) -> None:
        self.tools = list(tools or [])
        self.forced = forced
        self.text = ""
        self.emitted = 0

    def feed(self, delta: str) -> str:
        """Add verified text; return the content that can be streamed now."""
        self.text += delta
        if not self.tools:
            out = self.text[self.emitted :]
            self.emitted = len(self.text)
            return out
        safe = self._safe_prefix()
        if len(safe) <= self.emitted or not safe.strip():
            return ""
        out = safe[self.emitted :]
        self.emitted = len(safe)
        return out

    def finish(self) -> tuple[str, ParsedReply]:
        """Parse the complete reply; return (the content not streamed yet, the parsed reply)."""
        parsed = parse_reply(self.text, self.tools, self.forced)
        content = parsed.content
        emitted = self.text[: self.emitted]
        if not content.startswith(emitted):  # cannot happen by construction; keep the stream honest anyway
            return "", ParsedReply(emitted, parsed.tool_calls, parsed.invalid_tool_calls)
        return content[len(emitted) :], parsed

    def _safe_prefix(self) -> str:
        text = self.text
        if text.lstrip().startswith(("{", "[", "`")):
            return ""
        cut = text.find(TOOL_CALL_OPEN)
        if cut >= 0:
            return text[:cut]
        # Hold back a tail that could be the start of "<tool_call>".
        for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
            if TOOL_CALL_OPEN.startswith(text[-k:]):
                return text[:-k]
        return text
