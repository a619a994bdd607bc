"""OpenAI's Chat Completions API (`POST /v1/chat/completions`): its request read into the engine's inputs.

Why a module of its own: OpenAI's messages (developer roles, content parts, tool calls and their answers)
are checked and mapped here, each refusal a 400 naming the message and field, so that the engine sees only
the plain dicts it reads at every door. The reply's shapes are shared with /v1/completions (openai_shapes).
"""

from __future__ import annotations

from typing import Any

from .schemas import ChatCompletionRequest, Message, NamedToolChoice, RequestError, parse_request


def parse(body: dict[str, Any]) -> ChatCompletionRequest:
    """The request, validated (a field the server cannot honour is a 400 naming it)."""
    req = parse_request(ChatCompletionRequest, body)
    assert isinstance(req, ChatCompletionRequest)
    return req


def engine_inputs(req: ChatCompletionRequest) -> dict[str, Any]:
    """`build_request`'s inputs for this request (the fields shared with the other endpoints and the SAFE
    knobs are read from the request itself)."""
    return {
        "messages": engine_messages(req.messages),
        "tools": [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
        "tool_choice": req.tool_choice.model_dump()
        if isinstance(req.tool_choice, NamedToolChoice)
        else req.tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": req.response_format,
        "max_completion_tokens": req.max_completion_tokens,
    }


def engine_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """OpenAI messages as the engine's dicts: text content only, tool-call arguments as dicts."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        entry: dict[str, Any] = {"role": role, "content": _text(m, i)}
        if entry["content"] is None and not (role == "assistant" and m.tool_calls):
            raise RequestError(
                400, f"messages[{i}] ({m.role}) has no content", param=f"messages[{i}].content", code="invalid_value"
            )
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_calls:
            if role != "assistant":
                raise RequestError(
                    400,
                    f"messages[{i}] is a {m.role} message; only assistant messages carry tool_calls",
                    param=f"messages[{i}].tool_calls",
                    code="invalid_value",
                )
            entry["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in m.tool_calls
            ]
        if role == "tool":
            if not m.tool_call_id:
                raise RequestError(
                    400,
                    f"messages[{i}] is a tool message without tool_call_id; give the id of the call it answers",
                    param=f"messages[{i}].tool_call_id",
                    code="missing_required_parameter",
                )
            entry["tool_call_id"] = m.tool_call_id
        elif m.tool_call_id is not None:
            raise RequestError(
                400,
                f"messages[{i}] is a {m.role} message; only tool messages carry tool_call_id",
                param=f"messages[{i}].tool_call_id",
                code="invalid_value",
            )
        out.append(entry)
    return out


def _text(m: Message, i: int) -> str | None:
    if m.content is None or isinstance(m.content, str):
        return m.content
    parts = []
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            raise RequestError(
                400,
                f"messages[{i}].content[{j}] is a {part.type!r} part; the ensemble's members read text only",
                param=f"messages[{i}].content[{j}]",
                code="unsupported_value",
            )
        parts.append(part.text)
    return "".join(parts)
