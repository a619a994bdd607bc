"""Tools in a conversation: shown to each member, and read back out of the verified text.

One implementation for every caller (the LangChain and LlamaIndex adapters, the server), so a tool call
means the same thing everywhere:

- `template_messages`: what one member's chat template gets. A template that renders `tools` (found by
  the variables it uses, not by a text search) gets the schemas itself; for one that ignores them the
  schemas go in the system message, asking for the Qwen2.5 / Hermes format
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, so one parser serves all members.
- `with_tool_choice`: "none" hides the tools, "required" / a tool name adds an instruction to call it
  (an instruction only: nothing constrains decoding yet).
- `parse_tool_calls`: the reply split into content, tool calls and invalid calls (with the reason).
- `ToolCallHoldback`: how much of a stream can be shown while it may still turn into a tool call.

Formats read back (only when tools are given): tagged ``<tool_call>`` blocks (any number; the last one
may be cut off); otherwise JSON calls anywhere in the reply, as small models often write them: an object
``{"name": <a given tool>, "arguments": {...}}`` (or "parameters", or OpenAI's ``{"type": "function",
"function": {...}}``), a list of them, optionally in a Markdown code fence. With one tool required, a bare
object of its arguments, or a call-shaped object with a wrong name whose arguments fit that tool, is a
call to it. JSON cut off by the token limit is completed by closing its brackets only, never by
inventing text. Anything else that looks like a call but does not parse is an invalid call, never an
exception.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta
from jinja2.ext import Extension

from ..errors import ConfigError, InputError, InputTypeError

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_CHOICES = ("auto", "none", "required")


def new_tool_call_id() -> str:
    """A unique id in OpenAI's shape; templates that need another shape get an alias (`template_messages`)."""
    return "call_" + uuid.uuid4().hex[:24]


# -- the tools and the caller's choice -------------------------------------------------------------------
def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    """The tools' names; OpenAI-style ``{"type": "function", "function": {...}}`` or bare function schemas."""
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Sequence):
        raise InputTypeError(f"tools must be a list of JSON schemas, got {type(tools).__name__}")
    names = []
    for i, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name:
            raise InputTypeError(
                f"tools[{i}] must be a JSON schema with a name, e.g. "
                '{"type": "function", "function": {"name": "add", "parameters": {...}}}; got ' + f"{tool!r:.80}"
            )
        names.append(name)
    return names


#: A tool choice as the engine carries it once `build_request` has read it: "auto" | "none" | "required" |
#: a tool name. Everything downstream (templates, grammar, reply reader) takes this value as it is.
ToolChoice = str


def normalize_tool_choice(choice: Any, tools: Sequence[Mapping[str, Any]] | None) -> ToolChoice:
    """ "auto" | "none" | "required" | a tool name, from the forms callers use: None, True/False, "any"
    (LangChain, Anthropic), {"type": "function", "function": {"name": ...}} (OpenAI) or {"name": ...}.
    The one place a caller's tool choice is read (`build_request` calls it; a door may call it early to
    fail at bind time)."""
    if choice is None or choice is False:
        return "auto"
    if choice is True or choice == "any":
        return "required"
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name") or choice.get("name")
        if not isinstance(name, str):
            raise ConfigError(f"tool_choice {choice!r} names no tool; use {{'function': {{'name': ...}}}}")
        choice = name
    if not isinstance(choice, str):
        raise ConfigError(f"tool_choice must be a string, dict, bool or None, got {choice!r}")
    if choice in TOOL_CHOICES:
        return choice
    names = tool_names(tools or [])
    if choice not in names:
        raise ConfigError(f"tool_choice {choice!r} is not a bound tool; bound tools: {names}")
    return choice


def required_tool(tools: Sequence[Mapping[str, Any]] | None, choice: ToolChoice) -> str | None:
    """The one tool the reply must call: the named one, or the only tool when any call is required."""
    if not tools:
        return None
    if choice == "required":
        names = tool_names(tools)
        return names[0] if len(names) == 1 else None
    return None if choice in TOOL_CHOICES else choice


def with_tool_choice(
    messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None, choice: ToolChoice
) -> tuple[list[dict[str, Any]], list[Mapping[str, Any]] | None]:
    """(messages, tools) for a request: "none" drops the tools; "required" or a name asks for the call in
    the system message. Measured on the demo models: a direct "must call" + "only the tool call" makes a
    0.5B model answer with the call instead of talking about it."""
    if not tools or choice == "none":
        return messages, None
    if choice == "auto":
        return messages, list(tools)
    forced = required_tool(tools, choice)
    instruction = (
        f'You must call the tool "{forced}". Reply with only the tool call, no other text.'
        if forced
        else "You must call one of the tools. Reply with only the tool call(s), no other text."
    )
    return _add_to_system_message(messages, instruction), list(tools)


# -- what one member's template gets ---------------------------------------------------------------------
class _GenerationTag(Extension):
    """Parses transformers' ``{% generation %}`` block (assistant-token tracking) so templates using it parse."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


_PARSER = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _GenerationTag])


@lru_cache(maxsize=64)
def template_renders_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable (a comment or a string that says "tools" does not count)."""
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(_PARSER.parse(template))
    except jinja2.TemplateSyntaxError:
        return False  # rendering will report the broken template; here, describe the tools ourselves


def template_messages(
    messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None, template: str
) -> tuple[list[dict[str, Any]], list[Mapping[str, Any]] | None]:
    """(messages, tools) for one member's template.

    Tool calls in the history take the shape templates read (arguments as a dict, not a JSON string;
    ids as 9 alphanumerics, Mistral's strict format: other ids get a stable alias, the same for the call
    and its result). A template that ignores `tools` gets them described in the system message and the
    history's calls as ``<tool_call>`` text, so it sees the conversation the others see.
    """
    messages = [_template_message(m, i) for i, m in enumerate(messages)]
    if tools:
        tool_names(tools)
    renders = template_renders_tools(template)
    if renders:
        return messages, list(tools) if tools else None
    messages = [_calls_as_text(m) for m in messages]
    if tools:
        messages = _tools_in_system_message(messages, tools)
    return messages, None


def _template_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    out = dict(message)
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = _template_id(message["tool_call_id"])
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, Sequence) or isinstance(calls, str | bytes):
            raise InputTypeError(f"messages[{index}]['tool_calls'] must be a list, got {type(calls).__name__}")
        out["tool_calls"] = [
            _template_call(call, f"messages[{index}]['tool_calls'][{j}]") for j, call in enumerate(calls)
        ]
    return out


def _template_call(call: Any, where: str) -> dict[str, Any]:
    """OpenAI ``{"id", "type", "function": {"name", "arguments"}}`` or this module's ``{"id", "name", "arguments"}``."""
    if not isinstance(call, Mapping):
        raise InputTypeError(f"{where} must be a dict, got {type(call).__name__}")
    function = call.get("function", call)
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise InputTypeError(f"{where} needs a function name, e.g. {{'function': {{'name': ..., 'arguments': {{}}}}}}")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise InputError(f"{where}: arguments are not valid JSON ({err}); pass a JSON object") from None
    if not isinstance(arguments, Mapping):
        raise InputTypeError(f"{where}: arguments must be a JSON object, got {type(arguments).__name__}")
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": dict(arguments)}}
    if call.get("id") is not None:
        out["id"] = _template_id(call["id"])
    return out


_STRICT_ID = re.compile(r"[A-Za-z0-9]{9}")


def _template_id(call_id: Any) -> str:
    call_id = str(call_id)
    return call_id if _STRICT_ID.fullmatch(call_id) else hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = "".join(
        TOOL_CALL_OPEN
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
        + TOOL_CALL_CLOSE
        for c in calls
    )
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = f"{message.get('content') or ''}{text}"
    return out


def _tools_in_system_message(messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[dict]:
    described = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    instructions = (
        "You may call functions. Available tools (JSON schemas):\n"
        f"{described}\n"
        f'To call one, reply with {TOOL_CALL_OPEN}{{"name": <tool name>, "arguments": <JSON object>}}{TOOL_CALL_CLOSE}.'
    )
    return _add_to_system_message(messages, instructions)


def _add_to_system_message(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0].get("role") == "system":
        first = {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{text}".strip()}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


# -- reading calls back ----------------------------------------------------------------------------------
@dataclass
class ToolCallParse:
    """A reply split into its text content, its tool calls and the calls that could not be read.

    tool_calls: ``[{"id", "name", "arguments": dict}]``; invalid: ``[{"id", "name" (or None),
    "arguments": the raw text, "error": why}]``.
    """

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    invalid: list[dict[str, Any]] = field(default_factory=list)

    def first_call_only(self) -> ToolCallParse:
        """For callers that asked for one call per turn (parallel tool calls off): the first call, nothing else."""
        if not self.tool_calls:
            return self
        return ToolCallParse(self.content, self.tool_calls[:1], [])


def parse_tool_calls(
    text: str, tools: Sequence[Mapping[str, Any]] | None, tool_choice: ToolChoice = "auto"
) -> ToolCallParse:
    """Split a reply into content and tool calls; without tools (or with tool_choice "none") it is all content."""
    if not tools or tool_choice == "none":
        return ToolCallParse(text)
    found = ToolCallParse("")
    if TOOL_CALL_OPEN in text:
        spans = _tagged_calls(text, found)
    else:
        spans = _json_calls(text, tools, required_tool(tools, tool_choice), found)
    found.content = _without(text, spans)
    return found


_TAGGED_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.DOTALL)
_FENCED_RE = re.compile(r"^```[A-Za-z0-9_-]*\s*\n?(.*?)\n?```$", re.DOTALL)


def _tagged_calls(text: str, found: ToolCallParse) -> list[tuple[int, int]]:
    spans = []
    for match in _TAGGED_RE.finditer(text):
        body = match.group(1).strip()
        fenced = _FENCED_RE.match(body)
        if fenced:
            body = fenced.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            cut_off = not match.group(0).endswith(TOOL_CALL_CLOSE)
            obj = _close_json(body) if cut_off else None
            if obj is None:
                _add_invalid(found, _guess_name(body), body, f"invalid JSON: {err}")
        if obj is not None:
            _add_call(found, obj, body)
        spans.append(match.span())
    return spans


def _add_call(found: ToolCallParse, obj: Any, raw: str) -> None:
    """Append `obj` as a call, or as an invalid call saying what is wrong with it."""
    if not isinstance(obj, dict):
        return _add_invalid(found, None, raw, f"a tool call must be a JSON object, got {type(obj).__name__}")
    if isinstance(obj.get("function"), dict):  # OpenAI style {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return _add_invalid(found, None, raw, 'a tool call needs a "name" string')
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            return _add_invalid(found, name, raw, f"arguments are not valid JSON: {err}")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return _add_invalid(found, name, raw, f"arguments must be a JSON object, got {type(arguments).__name__}")
    found.tool_calls.append({"id": new_tool_call_id(), "name": name, "arguments": arguments})
    return None


def _add_invalid(found: ToolCallParse, name: str | None, raw: str, error: str) -> None:
    found.invalid.append({"id": new_tool_call_id(), "name": name, "arguments": raw, "error": error})


_JSON_START_RE = re.compile(r"[{\[]")
_CALL_START_RE = re.compile(r'\{\s*"name"\s*:\s*"([^"]*)"')
_FENCE_BEFORE_RE = re.compile(r"```[A-Za-z0-9_-]*[ \t]*\n?[ \t]*$")
_FENCE_AFTER_RE = re.compile(r"[ \t]*\n?[ \t]*```")
_CALL_KEYS = frozenset({"name", "arguments", "parameters", "id", "type"})


def _json_calls(
    text: str, tools: Sequence[Mapping[str, Any]], forced: str | None, found: ToolCallParse
) -> list[tuple[int, int]]:
    """Tool calls written as JSON without tags, anywhere in the reply; returns their spans."""
    names = set(tool_names(tools))
    forced_schema = _parameters(tools, forced) if forced else None
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
            # A call to a given tool that does not parse: cut off by the token limit, or malformed.
            obj, end = _close_json(text[start:]), len(text)
            if obj is None:
                _add_invalid(found, attempt.group(1), text[start:], f"invalid JSON: {err}")
                outer = _outermost_open(text, spans[-1][1] if spans else 0, start)
                spans.append(_with_fence(text, outer, len(text)))
                break
        calls = _as_calls(obj, names, forced, forced_schema)
        if calls is None:
            if _is_call_shaped(obj):  # {"name": <not a given tool>, "arguments": ...}: a call, but to what?
                error = f"unknown tool {obj['name']!r}; bound tools: {sorted(names)}"
                _add_invalid(found, obj["name"], text[start:end], error)
                spans.append(_with_fence(text, start, end))
                pos = end
            else:
                pos = start + 1
            continue
        for call in calls:
            _add_call(found, call, json.dumps(call, ensure_ascii=False))
        spans.append(_with_fence(text, start, end))
        pos = end
    return spans


def _as_calls(obj: Any, names: set[str], forced: str | None, forced_schema: Mapping | None) -> list[dict] | None:
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
        if _fits(obj, forced_schema):
            return [{"name": forced, "arguments": obj}]
        # Small models sometimes put a value in "name" ({"name": "Acme", "arguments": {...}}); with one tool
        # required, arguments that fit its schema settle which tool was meant.
        arguments = obj.get("arguments", obj.get("parameters"))
        if _is_call_shaped(obj) and isinstance(arguments, dict) and _fits(arguments, forced_schema):
            return [{"name": forced, "arguments": arguments}]
    return None


def _is_call_shaped(obj: Any) -> bool:
    return (
        isinstance(obj, dict)
        and isinstance(obj.get("name"), str)
        and ("arguments" in obj or "parameters" in obj)
        and set(obj) <= _CALL_KEYS
    )


def _parameters(tools: Sequence[Mapping[str, Any]], name: str) -> Mapping[str, Any] | None:
    for tool in tools:
        function = tool.get("function", tool)
        if function.get("name") == name:
            return function.get("parameters") or {}
    return None


def _fits(obj: dict, parameters: Mapping[str, Any] | None) -> bool:
    """Whether `obj` fits a tool's parameters: known keys only, every required key present."""
    if parameters is None or not obj:
        return False
    properties = set((parameters.get("properties") or {}).keys())
    required = set(parameters.get("required") or ())
    return set(obj) <= properties and required <= set(obj)


def _outermost_open(text: str, lo: int, hi: int) -> int:
    """Where the outermost bracket still open at `hi` opened (from the first bracket after `lo`), so an
    unparsable call nested in a wrapper ({"function": {"name": ...) is cut out whole."""
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


def _close_json(text: str) -> Any:
    """JSON cut off by the token limit, completed by closing its open brackets (nothing else); None if that fails."""
    stack: list[str] = []
    brackets, in_string = _json_brackets(text, 0, len(text))
    for i, ch in brackets:
        if ch in "{[":
            stack.append("}" if ch == "{" else "]")
        else:
            if not stack or stack.pop() != ch:
                return None
            if not stack and text[i + 1 :].strip():
                return None  # it closed before the end: malformed, not cut off
    if in_string or not stack:
        return None
    body = text.rstrip().removesuffix(",")
    try:
        return json.loads(body + "".join(reversed(stack)))
    except json.JSONDecodeError:
        return None


def _with_fence(text: str, start: int, end: int) -> tuple[int, int]:
    """Widen a span to the Markdown code fence around it, if any."""
    before = _FENCE_BEFORE_RE.search(text, 0, start)
    after = _FENCE_AFTER_RE.match(text, end)
    if before and before.end() == start and after:
        return before.start(), after.end()
    return start, end


def _guess_name(body: str) -> str | None:
    match = re.search(r'"name"\s*:\s*"([^"]+)"', body)
    return match.group(1) if match else None


def _without(text: str, spans: list[tuple[int, int]]) -> str:
    """The text outside the calls: what came before the first call as written (it may have streamed
    already), later pieces only when they say something; "" when nothing but calls and white space."""
    if not spans:
        return text
    pieces = [text[: spans[0][0]]]
    pieces += [text[a:b] for (_, a), (b, _) in zip(spans, [*spans[1:], (len(text), 0)])]
    content = pieces[0] + "".join(p for p in pieces[1:] if p.strip())
    return content if content.strip() else ""


# -- streaming -------------------------------------------------------------------------------------------
_HOLD_MARKERS = (TOOL_CALL_OPEN, "{", "[", "```")  # where any call the parser reads can start


class ToolCallHoldback:
    """How much of a stream of verified text can be shown as content while tools are given.

    Text before anything that may start a tool call (``<tool_call>``, a JSON object or list, a code fence)
    is shown as it is verified; from there on it is held back until the reply is complete and parsed, as
    is a tail that may be the start of ``<tool_call>`` and text that is only white space. So what was
    shown is always a prefix of the final content, and a stream never shows the start of a call.

        holdback = ToolCallHoldback(tools, tool_choice)
        for delta in stream: show(holdback.feed(delta))
        show(holdback.flush()); holdback.parsed.tool_calls
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None, tool_choice: ToolChoice = "auto") -> None:
        self.tools = list(tools or [])
        self.tool_choice = tool_choice
        self._active = bool(self.tools) and tool_choice != "none"
        self.text = ""
        self.shown = 0
        self.parsed: ToolCallParse | None = None  # set by flush()

    def feed(self, delta: str) -> str:
        """Add verified text; return the content that can be shown now."""
        self.text += delta
        safe = self._safe_prefix() if self._active else self.text
        if len(safe) <= self.shown or not safe.strip():
            return ""
        out = safe[self.shown :]
        self.shown = len(safe)
        return out

    def flush(self) -> str:
        """Parse the complete reply (into `parsed`); return the content not shown yet."""
        self.parsed = parse_tool_calls(self.text, self.tools, self.tool_choice)
        shown = self.text[: self.shown]
        assert self.parsed.content.startswith(shown), "held-back text must be a prefix of the content"
        return self.parsed.content[len(shown) :]

    def _safe_prefix(self) -> str:
        text = self.text
        cuts = [i for i in (text.find(m) for m in _HOLD_MARKERS) if i >= 0]
        if cuts:
            return text[: min(cuts)]
        for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):  # a tail that may start a marker
            if any(marker.startswith(text[-k:]) for marker in _HOLD_MARKERS):
                return text[:-k]
        return text
