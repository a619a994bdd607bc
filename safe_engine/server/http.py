"""The HTTP edge of every endpoint: the API key, the request body, and every failure as OpenAI's error body.

Why bodies are read here rather than by FastAPI: so that every refusal is OpenAI's error shape with the
right status (400 instead of FastAPI's 422, 413 for oversized bodies) and names the offending field.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import ConfigError, GenerationTimeout, InputError, InputTypeError, MemberError, SafeEngineError
from . import openai_shapes as shapes
from .schemas import RequestError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
RETRY_AFTER_S = 1  # what a 503 tells clients to wait before retrying (the openai SDK honours it)


# -- the request -----------------------------------------------------------------------------------------------
def authorize(request: Request, api_key: str | None) -> None:
    """A 401 unless the request carries `Authorization: Bearer <api_key>` (no key set: every request passes)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise RequestError(
            401,
            "missing API key; send it as the header 'Authorization: Bearer <key>'",
            code="missing_api_key",
            type="authentication_error",
        )
    if not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise RequestError(401, "invalid API key", code="invalid_api_key", type="authentication_error")


async def json_body(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object: 413 past `limit` bytes, 400 for bad UTF-8, bad JSON or a non-object."""
    declared = request.headers.get("content-length", "")
    too_large = RequestError(
        413, f"the request body is larger than {limit} bytes", code="request_too_large", type="invalid_request_error"
    )
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:  # the client left while sending its body: nobody to answer, nothing to log
        raise RequestError(
            499, "the client closed the request", code="client_closed", type="invalid_request_error"
        ) from None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RequestError(
            400,
            f"the request body is not valid UTF-8 (byte {body[err.start]:#04x} at offset {err.start}); send UTF-8 JSON",
            code="invalid_json",
        ) from None
    if not text.strip():
        raise RequestError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except (json.JSONDecodeError, RecursionError, ValueError) as err:
        raise RequestError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise RequestError(
            400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json"
        )
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# -- errors ----------------------------------------------------------------------------------------------------
def engine_error(err: BaseException) -> RequestError:
    """The engine's refusal (or failure) of a request as an OpenAI error."""
    if isinstance(err, RequestError):
        return err
    if isinstance(err, GenerationTimeout):
        return RequestError(504, str(err), param="timeout_s", code="timeout", type="timeout_error")
    if isinstance(err, InputError | ConfigError | InputTypeError):
        code = "context_length_exceeded" if "context window" in str(err) else "invalid_value"
        return RequestError(400, str(err), code=code)
    if isinstance(err, TemplateError):
        return RequestError(
            400, f"a member's chat template refused these messages: {err}", param="messages", code="invalid_value"
        )
    if isinstance(err, MemberError | SafeEngineError):
        return RequestError(500, str(err), code="member_error", type="server_error")
    return RequestError(500, f"internal error: {type(err).__name__}: {err}", code="internal_error", type="server_error")


def error_response(err: RequestError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    if err.status == 503:  # loading, shutting down or at capacity: all pass
        headers = {"Retry-After": str(RETRY_AFTER_S)}
    body = shapes.error_body(err.message, err.type, err.param, err.code)
    return _AsciiJSON(body, status_code=err.status, headers=headers)


class _AsciiJSON(JSONResponse):
    """JSON with non-ASCII escaped: an error may quote the request's own (possibly broken) text."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def add_error_handlers(app: FastAPI) -> None:
    """Every failure, FastAPI's and Starlette's own included, answers with OpenAI's error body."""
    app.add_exception_handler(RequestError, _request_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error)


async def _request_error(request: Request, err: RequestError) -> Response:
    return error_response(err)


async def _validation_error(request: Request, err: RequestValidationError) -> Response:
    first = err.errors()[0] if err.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    return error_response(RequestError(400, f"invalid request: {first.get('msg', err)}", param=param))


async def _http_error(request: Request, err: StarletteHTTPException) -> Response:
    if err.status_code == 404:
        message = f"no route {request.method} {request.url.path}; see GET /v1/models, POST /v1/chat/completions"
        return error_response(RequestError(404, message, code="unknown_url"))
    if err.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
        return error_response(RequestError(405, message, code="method_not_allowed"))
    return error_response(RequestError(err.status_code, str(err.detail), code="http_error"))


async def _internal_error(request: Request, err: Exception) -> Response:
    return error_response(engine_error(err))
