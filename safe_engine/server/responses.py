"""OpenAI's Responses API (`POST /v1/responses`): its request read into the engine's, its reply and events.

Why a mapping and not a second path: a Responses request is a chat request spelled differently (`input`
items for messages, `instructions` for the system message, `max_output_tokens`, `text.format` for
`response_format`, flat function tools), so it is turned into the same `build_request` call as a chat
request and decoded the same way; only the reply's shape differs (output items, typed stream events).
Nothing is stored, so `store: true`, `previous_response_id`, `conversation` and background runs are
refused by name rather than pretended.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import ConfigDict, Field

from ..stats import GenerationResult
from . import openai_shapes as shapes
from .schemas import RequestError, StreamOptions, _Model, parse_request

# Fields of OpenAI's Responses API that ask for what this server does not do, with why.
_REFUSED = {
    "previous_response_id": "nothing is stored here; send the whole conversation as input items",
    "conversation": "nothing is stored here; send the whole conversation as input items",
    "background": "background responses need storage; send the request and wait for it (or stream it)",
    "prompt": "stored prompt templates are not available; send instructions and input",
    "reasoning": "the members have no reasoning settings",
    "max_tool_calls": "a bound on tool calls is not implemented; use parallel_tool_calls=false for one call",
    "context_management": "context management needs storage",
    "moderation": "moderation is not available",
    "top_logprobs": "logprobs are served on /v1/chat/completions (logprobs, top_logprobs), not yet here",
    "prompt_cache_options": "prompt caching options are not implemented",
    "prompt_cache_retention": "prompt caching options are not implemented",
}


class TextFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: None = None  # the members have no verbosity setting


class ResponsesRequest(_Model):
    """A Responses API request. Extra fields are the SAFE knobs (checked like the chat endpoint's)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None  # not OpenAI's (vLLM's extension): reproducible sampling
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop input silently: refused by its type
    service_tier: Literal["auto", "default"] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None
    reasoning: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    moderation: Any = None
    top_logprobs: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None


def parse(body: dict[str, Any]) -> ResponsesRequest:
    """The request, validated: a field asking for what is not done here is a 400 naming it."""
    req = parse_request(ResponsesRequest, body)
    assert isinstance(req, ResponsesRequest)
    if req.store:
        raise RequestError(
            400,
            "store=true is not supported: nothing is stored on this server; send store=false (or omit it) and "
            "keep the conversation yourself",
            param="store",
            code="unsupported_parameter",
        )
    for name, why in _REFUSED.items():
        value = getattr(req, name)
        if value not in (None, False, 0, {}):
            raise RequestError(
                400,
                f"{name}={value!r:.80} is not supported by this server: {why}",
                param=name,
                code="unsupported_parameter",
            )
    if req.include:
        raise RequestError(
            400,
            f"include={req.include!r:.80} is not supported: the reply has no extra parts to include",
            param="include",
            code="unsupported_parameter",
        )
    return req


def engine_inputs(req: ResponsesRequest) -> dict[str, Any]:
    """`build_request`'s inputs for this request (temperature, top_p, seed and the SAFE knobs are read from
    the request itself, as for chat)."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + _messages(req.input)
    if not messages:
        raise RequestError(400, "input holds no messages", param="input", code="invalid_value")
    tools = [_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None
    return {
        "messages": messages,
        "tools": tools,
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text.format if req.text else None),
        "max_tokens": req.max_output_tokens,
        "limit_name": "max_output_tokens",
    }


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as the engine's messages: function calls join the assistant turn before them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(
                    400,
                    f"input[{i}].role is {role!r}; a message item's role is user, system, developer or assistant",
                    param=f"input[{i}].role",
                    code="invalid_value",
                )
            out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", i),
                "type": "function",
                "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)},
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
                out[-1]["content"] = out[-1]["content"] or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, i, "output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": content})
        else:
            why = (
                "nothing is stored here" if kind == "item_reference" else "the members read messages and function calls"
            )
            raise RequestError(
                400,
                f"input[{i}] is a {kind!r} item; this server reads message, function_call and function_call_output "
                f"items ({why})",
                param=f"input[{i}].type",
                code="unsupported_value",
            )
    return out


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise RequestError(
            400, f"input[{i}].{key} must be a non-empty string", param=f"input[{i}].{key}", code="invalid_value"
        )
    return value


def _text(content: Any, i: int, key: str = "content") -> str:
    """A message's text: a string, or text parts (input_text, output_text); other parts are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(
            400,
            f"input[{i}].{key} must be a string or a list of text parts",
            param=f"input[{i}].{key}",
            code="invalid_type",
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise RequestError(
                400,
                f"input[{i}].{key}[{j}] is a {kind!r} part; the ensemble's members read text only",
                param=f"input[{i}].{key}[{j}]",
                code="unsupported_value",
            )
        texts.append(part["text"])
    return "".join(texts)


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """A Responses function tool ({type, name, description, parameters, strict}) in the chat shape."""
    if tool.get("type") != "function":
        raise RequestError(
            400,
            f"tools[{i}] is a {tool.get('type')!r} tool; this server runs function tools only (no hosted tools)",
            param=f"tools[{i}].type",
            code="unsupported_value",
        )
    unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
    if unknown:
        raise RequestError(
            400, f"unknown field tools[{i}].{unknown[0]}", param=f"tools[{i}].{unknown[0]}", code="unknown_parameter"
        )
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or set(choice) != {"type", "name"}:
        raise RequestError(
            400,
            f"tool_choice={choice!r:.80} is not supported; send 'auto', 'none', 'required' or "
            '{"type": "function", "name": ...}',
            param="tool_choice",
            code="unsupported_value",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(fmt: TextFormat | None) -> dict[str, Any] | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None or not fmt.name:
        raise RequestError(
            400,
            "text.format json_schema needs a name and a schema",
            param="text.format",
            code="missing_required_parameter",
        )
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}


# -- the reply -------------------------------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def echoed(req: ResponsesRequest, model: str) -> dict[str, Any]:
    """The response object before any output: what the request set, as OpenAI echoes it."""
    tool_choice: Any = req.tool_choice or "auto"
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {}
    return {
        "id": _id("resp"),
        "object": "response",
        "created_at": shapes.now(),
        "status": "in_progress",
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": tool_choice,
        "tools": [{**t, "strict": t.get("strict")} for t in req.tools or ()],
        "text": {"format": {"type": "text"}, **text},
        "truncation": "disabled",
        "store": False,
        "previous_response_id": None,
        "usage": None,
    }


def _usage(usage: dict[str, int]) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _calls(result: GenerationResult) -> list[dict[str, Any]]:
    return [
        {
            "id": _id("fc"),
            "type": "function_call",
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
            "status": "completed",
        }
        for call in shapes.tool_calls(result)
    ]


def _finish(
    body: dict[str, Any], result: GenerationResult, usage: dict[str, int], output: list[dict[str, Any]]
) -> dict:
    """The response once generated: `status` "incomplete" (reason max_output_tokens) when the limit cut it."""
    cut = result.finish_reason == "length"
    return {
        **body,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "completed_at": shapes.now(),
        "output": output,
        "usage": _usage(usage),
        "safe": shapes.safe_stats(result),
    }


def response(body: dict[str, Any], result: GenerationResult, usage: dict[str, int]) -> dict[str, Any]:
    """The whole response of a non-streaming request."""
    output = [_message(_id("msg"), result.content, "completed")] if result.content else []
    return _finish(body, result, usage, output + _calls(result))


class EventWriter:
    """A Responses stream's events in OpenAI's order, each with the next `sequence_number`: created,
    in_progress; per output item added, its deltas, done; completed (also when `max_output_tokens` cut the
    reply: its status then says "incomplete", which is what clients' stream helpers read)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.sequence = 0
        self.message_id: str | None = None
        self.text_so_far = ""

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def begin(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self.body),
            self._event("response.in_progress", response=self.body),
        ]

    def text(self, delta: str) -> list[dict[str, Any]]:
        events = []
        if self.message_id is None:
            self.message_id = _id("msg")
            item = {**_message(self.message_id, "", "in_progress"), "content": []}
            events.append(self._event("response.output_item.added", output_index=0, item=item))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(
                self._event(
                    "response.content_part.added", item_id=self.message_id, output_index=0, content_index=0, part=part
                )
            )
        self.text_so_far += delta
        where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        events.append(self._event("response.output_text.delta", **where, delta=delta, logprobs=[]))
        return events

    def end(self, result: GenerationResult, usage: dict[str, int]) -> list[dict[str, Any]]:
        events, output = [], []
        if self.message_id is not None:
            where = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
            message = _message(self.message_id, self.text_so_far, "completed")
            events.append(self._event("response.output_text.done", **where, text=self.text_so_far, logprobs=[]))
            events.append(self._event("response.content_part.done", **where, part=message["content"][0]))
            events.append(self._event("response.output_item.done", output_index=0, item=message))
            output.append(message)
        for call in _calls(result):
            index = len(output)
            started = {**call, "arguments": "", "status": "in_progress"}
            events.append(self._event("response.output_item.added", output_index=index, item=started))
            where = {"item_id": call["id"], "output_index": index}
            events.append(self._event("response.function_call_arguments.delta", **where, delta=call["arguments"]))
            events.append(
                self._event(
                    "response.function_call_arguments.done", **where, arguments=call["arguments"], name=call["name"]
                )
            )
            events.append(self._event("response.output_item.done", output_index=index, item=call))
            output.append(call)
        events.append(self._event("response.completed", response=_finish(self.body, result, usage, output)))
        return events

    def error(self, message: str, code: str | None) -> dict[str, Any]:
        return self._event("error", code=code, message=message, param=None)
