"""OpenAI request bodies, validated strictly: a field the server cannot honour is a 400 that names it.

Why strict: an OpenAI client that sends `best_of=3` or `suffix="..."` to a server that silently ignores
them gets an answer to a question it did not ask. So every field of OpenAI's chat and completions APIs is
either mapped onto the engine, accepted because it cannot change the output (`user`, `metadata`, ...), or
accepted only at its neutral value (`best_of=1`, `modalities=["text"]`, ...). Unknown fields
are refused too, except the SAFE knobs (`method`, `aggregation`, ...) and `preset`, which clients send as
extra body fields (`extra_body=` in the openai SDK, LangChain and LlamaIndex).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..config import GenerationConfig

#: The most choices one request may ask for (`n`, times the prompts of a completions request): each is one
#: request in the engine's batch, so a bound keeps one client from filling the queue alone.
MAX_CHOICES = 64

# GenerationConfig fields a request may set by their own name (extra body fields); the others have OpenAI
# names (max_tokens, stop, temperature, top_p, seed).
_OPENAI_NAMED: tuple[str, ...] = ("max_new_tokens", "stop", "temperature", "top_p", "seed", "logprobs")
_OPENAI_NAMED += ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias")  # fields below
SAFE_KNOBS = tuple(f.name for f in fields(GenerationConfig) if f.name not in _OPENAI_NAMED)
#: The extra body fields a request may send: the SAFE knobs, and `preset` (a named bundle of knob values under
#: the request's own, `safe_engine.presets`).
EXTRA_FIELDS = (*SAFE_KNOBS, "preset")

# Fields that only label or route a request, with no effect on what is generated: accepted, not used.
BOOKKEEPING = ("user", "metadata", "safety_identifier", "prompt_cache_key")

# OpenAI fields the engine does not implement, with the values that mean "not used" (accepted) and why
# anything else is refused.
_TEXT_FORMAT = {"type": "text"}
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "choosing the best of several needs one score per choice; use n and choose yourself"),
    "functions": ((None,), "the deprecated functions API is not supported; use tools"),
    "function_call": ((None,), "the deprecated functions API is not supported; use tool_choice"),
    "audio": ((None,), "the members are text-only"),
    "modalities": ((None, ["text"]), "the members are text-only"),
    "prediction": ((None,), "predicted outputs are not implemented"),
    "web_search_options": ((None,), "web search is not available"),
    "reasoning_effort": ((None,), "the members have no reasoning-effort setting"),
    "verbosity": ((None,), "the members have no verbosity setting"),
    "moderation": ((None,), "moderation is not available"),
    "store": ((None, False), "nothing is stored on this server; send store=false or omit it"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
    "prompt_cache_options": ((None,), "prompt caching options are not implemented"),
    "prompt_cache_retention": ((None,), "prompt caching options are not implemented"),
    "suffix": ((None, ""), "insertion needs fill-in-the-middle; the members continue a prompt left to right"),
}


class _Model(BaseModel):
    """Strict types (no "10" for 10), unknown nested fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


# -- messages ----------------------------------------------------------------------------------------------
class FunctionCall(_Model):
    name: str
    arguments: str = ""  # a JSON string, as OpenAI sends it


class ToolCall(_Model):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    """A content part; only text parts are usable (the members are text-only LMs)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


# -- tools -------------------------------------------------------------------------------------------------
class FunctionDef(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Model):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # padding against length side channels: nothing to pad here


# -- requests ----------------------------------------------------------------------------------------------
class _Request(BaseModel):
    """Fields common to both endpoints. Extra fields are collected (`model_extra`) and checked against
    EXTRA_FIELDS by `check_extra_fields`, so a typo is a 400, not a silently ignored knob."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # bookkeeping: accepted, unused
    user: str | None = None
    metadata: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)  # choices, each decoded as one request
    # penalties, per member in its own tokens; logit_bias in the drafter's token ids (ranges: the engine's, a
    # 400 naming the field); repetition_penalty is vLLM's extra field
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # unsupported unless neutral (see UNSUPPORTED)
    best_of: Any = None
    service_tier: Any = None
    store: Any = None

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(value)}")
        return value


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None  # OpenAI's chat form: True, with top_logprobs alternatives (0-20)
    top_logprobs: int | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None


class CompletionRequest(_Request):
    # a string, several strings, or token ids (one prompt's, or several) in the drafter's vocabulary
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # the legacy form: k alternatives (0-20)
    echo: bool | None = None
    suffix: Any = None


# -- errors ------------------------------------------------------------------------------------------------
class RequestError(Exception):
    """A request the server refuses: becomes {"error": {message, type, param, code}} with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type


def parse_request(cls: type[BaseModel], body: dict[str, Any]) -> BaseModel:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its field."""
    try:
        request = cls.model_validate(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        param = _param(first.get("loc", ()))
        kind = first.get("type", "")
        if kind == "missing":
            code, message = "missing_required_parameter", f"missing required field {param!r}"
        elif kind == "extra_forbidden":
            code, message = "unknown_parameter", f"unknown field {param!r}"
        else:
            code = "invalid_type" if kind.endswith(("_type", "_parsing")) or "type" in kind else "invalid_value"
            message = f"invalid {param!r}: {first.get('msg')}"
        raise RequestError(400, message, param=param, code=code) from None
    check_extra_fields(request)
    check_unsupported(request)
    return request


def check_extra_fields(request: BaseModel) -> None:
    unknown = sorted(set(request.model_extra or {}) - set(EXTRA_FIELDS))
    if unknown:
        raise RequestError(
            400,
            f"unknown field {unknown[0]!r}; this server accepts OpenAI's fields, the SAFE knobs {list(SAFE_KNOBS)} "
            "and preset",
            param=unknown[0],
            code="unknown_parameter",
        )


def check_unsupported(request: BaseModel) -> None:
    for name, (neutral, why) in UNSUPPORTED.items():
        if name not in type(request).model_fields:
            continue
        value = getattr(request, name)
        if not any(_same(value, ok) for ok in neutral):
            raise RequestError(
                400,
                f"{name}={value!r:.80} is not supported by this server: {why}",
                param=name,
                code="unsupported_parameter",
            )


def _same(value: Any, neutral: Any) -> bool:
    """value is the neutral value: numbers by value (0 == 0.0), never a bool for a number or None for 0."""
    if neutral is None or isinstance(neutral, bool) or isinstance(value, bool | None):
        return value is neutral
    if isinstance(neutral, int | float):
        return isinstance(value, int | float) and value == neutral
    return value == neutral


def _param(loc: tuple[Any, ...]) -> str:
    """pydantic's ("messages", 0, "role") as OpenAI writes it: messages[0].role."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[ContentPart]", "NamedToolChoice", "list[str]", "list[int]", "list[list[int]]"):
            continue  # the union member pydantic tried: not part of the field's path
        elif part.startswith(("literal[", "function-")):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or "body"
