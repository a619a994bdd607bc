"""OpenAI response and stream-chunk bodies built from the engine's results (plain dicts, JSON-ready)."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from ..stats import GenerationResult, chat_logprobs, completion_logprobs

# The engine's finish reasons in OpenAI's words: an EOS or a stop string both "stop".
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "repetition": "stop"}  # the raw one: "safe" extra


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event; ASCII-escaped JSON, so any text is safe on the wire."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def sse_event(data: dict[str, Any]) -> bytes:
    """One server-sent event named by its `type` (the Responses API's streams name each event)."""
    return f"event: {data['type']}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def tool_calls(result: GenerationResult) -> list[dict[str, Any]]:
    """The reply's tool calls in OpenAI's shape (arguments as a JSON string)."""
    return [
        {
            "id": call["id"],
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)},
        }
        for call in result.tool_calls or ()
    ]


def safe_stats(result: GenerationResult) -> dict[str, Any]:
    """The ensemble's statistics for a response's `safe` object: tokens, ensembled tokens, E/T, rounds,
    forward passes per member, and the engine's own finish reason ("eos" | "stop" | "length")."""
    out = {**result.stats.to_dict(), "finish_reason": result.finish_reason}
    out["gates"] = list(out.get("gates") or ())
    if result.trace is not None:
        out["trace"] = [point.to_dict() for point in result.trace]
    if result.invalid_tool_calls:  # calls that could not be read, and why
        out["invalid_tool_calls"] = [
            {k: bad.get(k) for k in ("id", "name", "arguments", "error")} for bad in result.invalid_tool_calls
        ]
    return out


def finish_reason(result: GenerationResult) -> str:
    if result.tool_calls:
        return "tool_calls"
    return FINISH_REASONS.get(result.finish_reason, "stop")


def chat_completion(
    request_id: str, model: str, created: int, results: list[GenerationResult], usage: dict[str, int]
) -> dict:
    """A chat.completion with one choice per result; each choice carries its `safe` statistics, and the
    top-level `safe` is the first choice's."""
    choices = []
    for index, result in enumerate(results):
        message: dict[str, Any] = {"role": "assistant", "content": result.content, "refusal": None}
        if result.tool_calls:
            message["tool_calls"] = tool_calls(result)
            message["content"] = result.content or None
        logprobs = None if result.logprobs is None else chat_logprobs(result.logprobs)
        choice = {"index": index, "message": message, "finish_reason": finish_reason(result), "logprobs": logprobs}
        choices.append({**choice, "safe": safe_stats(result)})
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
        "safe": choices[0]["safe"],
    }


def chat_chunk(
    request_id: str,
    model: str,
    created: int,
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    i: int = 0,
    logprobs: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A chat.completion.chunk of choice `i`; `delta=None` with `extra` usage makes the usage-only chunk (no
    choices); `logprobs`: those of the tokens of this chunk's content."""
    chunk: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    chunk["choices"] = (
        [] if delta is None else [{"index": i, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]
    )
    chunk.update(extra)
    return chunk


def text_completion(
    request_id: str,
    model: str,
    created: int,
    results: list[GenerationResult],
    texts: list[str],
    usage: dict[str, int],
) -> dict:
    """A text_completion with one choice per result (`texts`: each choice's text, echoed prompt included)."""
    choices = [
        {
            "index": i,
            "text": text,
            "finish_reason": finish_reason(r),
            # an echoed prompt comes first: the tokens' text_offset counts it
            "logprobs": None if r.logprobs is None else completion_logprobs(r.logprobs, len(text) - len(r.text)),
            "safe": safe_stats(r),
        }
        for i, (r, text) in enumerate(zip(results, texts))
    ]
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
        "safe": choices[0]["safe"],
    }


def completion_chunk(
    request_id: str,
    model: str,
    created: int,
    text: str | None,
    finish: str | None = None,
    i: int = 0,
    logprobs: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A streamed text_completion of choice `i`; `text=None` makes the usage-only chunk (no choices);
    `logprobs`: those of this chunk's tokens (OpenAI's legacy shape)."""
    chunk: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created, "model": model}
    choice = {"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs}
    chunk["choices"] = [] if text is None else [choice]
    chunk.update(extra)
    return chunk


def model_card(name: str, created: int, members: list[str], drafter: str, context_window: int | None) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "safe-engine",
        "max_model_len": context_window,
        "safe": {"members": members, "drafter": drafter, "context_window": context_window},
    }


def now() -> int:
    return int(time.time())
