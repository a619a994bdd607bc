"""LangChain messages ⇄ the engine's OpenAI-style dicts, and tool calls parsed from verified text.

The engine renders one OpenAI-style message list with every member's own chat template (tools included,
for templates that support them). This module only translates: LangChain messages in, dicts out; the
verified text out of the ensemble in, `AIMessage` content + `tool_calls` / `invalid_tool_calls` out.

Tool-call formats understood in the generated text (only when tools are bound):

- Qwen2.5 / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (any number of them);
- a JSON object ``{"name": <a bound tool>, "arguments": {...}}`` (or a JSON list of them, or the OpenAI
  ``{"type": "function", "function": {...}}`` shape) anywhere in the reply, optionally in a Markdown code
  fence: small models often write the call untagged, and often inside a sentence;
- when the caller forces one tool (`tool_choice`), a JSON object of just its arguments (what small
  models tend to produce for `with_structured_output`), or a call-shaped object with a wrong "name" whose
  arguments fit that tool's schema. Otherwise an untagged call to a tool that is not bound is reported
  in `invalid_tool_calls`.

A call cut off by the token limit is completed by closing its brackets only, never by inventing text.
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
    A call cut off by the token limit is completed only by closing its brackets (never by inventing text);
    anything else that does not parse is an invalid tool call.
    """
    if not tools:
        return ParsedReply(text)
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    if TOOL_CALL_OPEN in text:
        spans = []
        for match in _TOOL_CALL_RE.finditer(text):
            _parse_call(match.group(1).strip(), not match.group(0).endswith(TOOL_CALL_CLOSE), calls, invalid)
            spans.append((match.start(), match.end()))
    else:
        spans = _json_calls(text, tools, forced, calls, invalid)
    return ParsedReply(_without(text, spans), calls, invalid)


def _without(text: str, spans: list[tuple[int, int]]) -> str:
    """Text outside the calls: the text before the first call as written (it may have streamed already),
    later pieces only when they say something."""
    if not spans:
        return text
    pieces = [text[: spans[0][0]]]
    pieces += [text[a:b] for (_, a), (b, _) in zip(spans, [*spans[1:], (len(text), 0)])]
    content = pieces[0] + "".join(p for p in pieces[1:] if p.strip())
    return content if content.strip() else ""


def _parse_call(body: str, truncated: bool, calls: list[ToolCall], invalid: list[InvalidToolCall]) -> None:
    fenced = _FENCE_RE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        obj = _close_json(body) if truncated else None
        if obj is None:
            error = f"invalid JSON: {err}"
            invalid.append(invalid_tool_call(name=_guess_name(body), args=body, id=new_tool_call_id(), error=error))
            return
    _parse_call_obj(obj, body, calls, invalid)


def _parse_call_obj(obj: Any, raw: str, calls: list[ToolCall], invalid: list[InvalidToolCall]) -> None:
    def bad(error: str, name: str | None = None) -> None:
        invalid.append(invalid_tool_call(name=name, args=raw, id=new_tool_call_id(), error=error))

    if not isinstance(obj, dict):
        return bad(f"a tool call must be a JSON object, got {type(obj).__name__}")
    if isinstance(obj.get("function"), dict):  # OpenAI style {"type": "function", "function": {...}}
        obj = obj["function"]
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


_JSON_START_RE = re.compile(r"[{\[]")
_CALL_START_RE = re.compile(r'\{\s*"name"\s*:\s*"([^"]*)"')
_FENCE_OPEN_BEFORE_RE = re.compile(r"```[A-Za-z0-9_-]*[ \t]*\n?[ \t]*$")
_FENCE_CLOSE_AFTER_RE = re.compile(r"[ \t]*\n?[ \t]*```")
_CALL_KEYS = frozenset({"name", "arguments", "parameters", "id", "type"})


def _json_calls(
    text: str, tools: Sequence[Mapping[str, Any]], forced: str | None, calls: list, invalid: list
) -> list[tuple[int, int]]:
    """Tool calls written as JSON without tags, anywhere in the reply; returns their spans."""
    names = {_tool_name(t) for t in tools}
    forced_tool = _tool_by_name(tools, forced) if forced else None
    decoder = json.JSONDecoder()
    spans: list[tuple[int, int]] = []
    pos = 0
    while match := _JSON_START_RE.search(text, pos):
        start = match.start()
        try:
            obj, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError as err:
            attempt = _CALL_START_RE.match(text, start)
            if not attempt or attempt.group(1) not in names:
                pos = start + 1
                continue
            # A call that does not parse: cut off by the token limit (closing brackets fix it) or malformed.
            obj, end = _close_json(text[start:]), len(text)
            if obj is None:
                raw = text[start:]
                error = f"invalid JSON: {err}"
                invalid.append(invalid_tool_call(name=attempt.group(1), args=raw, id=new_tool_call_id(), error=error))
                outer = _outermost_open(text, spans[-1][1] if spans else 0, start)
                spans.append(_with_fence(text, outer, len(text)))
                break
        found = _as_calls(obj, names, forced, forced_tool)
        if found is None:
            if _is_call_shaped(obj):  # {"name": <not a bound tool>, "arguments": ...}: a call, but to what?
                error = f"unknown tool {obj['name']!r}; bound tools: {sorted(names)}"
                raw = text[start:end]
                invalid.append(invalid_tool_call(name=obj["name"], args=raw, id=new_tool_call_id(), error=error))
                spans.append(_with_fence(text, start, end))
                pos = end
                continue
            pos = start + 1
            continue
        for item in found:
            _parse_call_obj(item, json.dumps(item, ensure_ascii=False), calls, invalid)
        spans.append(_with_fence(text, start, end))
        pos = end
    return spans


def _as_calls(obj: Any, names: set[str], forced: str | None, forced_tool: Any) -> list[dict] | None:
    """The tool calls a JSON value stands for, or None when it is just data."""

    def is_call(o: Any) -> bool:
        if not isinstance(o, dict):
            return False
        if isinstance(o.get("function"), dict) and o.get("type", "function") == "function":
            o = o["function"]
        return isinstance(o.get("name"), str) and o["name"] in names and set(o) <= _CALL_KEYS

    if is_call(obj):
        return [obj]
    if isinstance(obj, list) and obj and all(is_call(o) for o in obj):
        return list(obj)
    if forced is not None and isinstance(obj, dict):
        if _looks_like_arguments(obj, forced_tool):
            return [{"name": forced, "arguments": obj}]
        # Small models sometimes put a value in "name" ({"name": "Acme", "arguments": {...}}); with one tool
        # forced, arguments that fit its schema settle which tool was meant.
        args = obj.get("arguments", obj.get("parameters"))
        if _is_call_shaped(obj) and isinstance(args, dict) and _looks_like_arguments(args, forced_tool):
            return [{"name": forced, "arguments": args}]
    return None


def _is_call_shaped(obj: Any) -> bool:
    return (
        isinstance(obj, dict)
        and isinstance(obj.get("name"), str)
        and ("arguments" in obj or "parameters" in obj)
        and set(obj) <= _CALL_KEYS
    )


def _outermost_open(text: str, lo: int, hi: int) -> int:
    """Where the outermost bracket still open at `hi` opened (scanning from the first bracket after `lo`),
    so an unparsable call nested in a wrapper ({"function": {"name": ...) is cut out whole."""
    first = _JSON_START_RE.search(text, lo, hi)
    if first is None:
        return hi
    opened: list[int] = []
    brackets, in_string = _json_brackets(text, first.start(), hi)
    for i, ch in brackets:
        if ch in "{[":
            opened.append(i)
        elif opened:
            opened.pop()
    return opened[0] if opened and not in_string else hi


def _json_brackets(text: str, lo: int, hi: int) -> tuple[list[tuple[int, str]], bool]:
    """(index, bracket) of each bracket of text[lo:hi] outside JSON strings, and whether a string is open at hi."""
    found: list[tuple[int, str]] = []
    in_string = escaped = False
    for i in range(lo, hi):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[]}":
            found.append((i, ch))
    return found, in_string


def _with_fence(text: str, start: int, end: int) -> tuple[int, int]:
    """Widen a span to the Markdown code fence around it, if any."""
    before = _FENCE_OPEN_BEFORE_RE.search(text, 0, start)
    after = _FENCE_CLOSE_AFTER_RE.match(text, end)
    if before and before.end() == start and after:
        return before.start(), after.end()
    return start, end


def _close_json(text: str) -> Any:
    """Parse JSON that was cut off: close its open brackets, never inventing other text. None if that fails."""
    stack: list[str] = []
    brackets, in_string = _json_brackets(text, 0, len(text))
    for i, ch in brackets:
        if ch in "{[":
            stack.append("}" if ch == "{" else "]")
        else:
            if not stack or stack.pop() != ch:
                return None
            if not stack and text[i + 1 :].strip():
                return None  # it closed before the end: malformed, not truncated
    if in_string or not stack:
        return None
    body = text.rstrip()
    if body.endswith(","):
        body = body[:-1]
    try:
        return json.loads(body + "".join(reversed(stack)))
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
_HOLD_MARKERS = (TOOL_CALL_OPEN, "{", "```")


class ContentStream:
    """Decides how much of the verified text can be streamed as content while tools are bound.

    Text before anything that may be a tool call (``<tool_call>``, a JSON object, a code fence) streams as
    it is verified; from there on it is held back until the reply is complete and parsed. Whitespace-only
    text is held back too, so the streamed content is always a prefix of the final content (a reply that
    is only a tool call has content "").
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
        if text.lstrip().startswith("["):
            return ""
        cuts = [i for i in (text.find(m) for m in _HOLD_MARKERS) if i >= 0]
        if cuts:
            return text[: min(cuts)]
        # Hold back a tail that could be the start of a marker.
        for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(m.startswith(tail) for m in _HOLD_MARKERS):
                return text[:-k]
        return text
