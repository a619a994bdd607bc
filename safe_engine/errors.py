"""One exception family, so callers can catch everything the engine raises on purpose.

Each class also derives from the builtin that describes the mistake (ValueError, TypeError, ...), so
code written against the builtins keeps working.
"""

from __future__ import annotations

import traceback
from typing import Any


class SafeEngineError(Exception):
    """Base class of every error raised deliberately by safe_engine.

    `option`: the request option at fault, as the caller spelled it (a door reports it: the server as the
    error's `param`), or None.
    """

    def __init__(self, *args: Any, option: str | None = None) -> None:
        super().__init__(*args)
        self.option = option


class ConfigError(SafeEngineError, ValueError):
    """A generation or ensemble setting has an invalid value (unknown method, draft_length < 1, ...)."""


class InputError(SafeEngineError, ValueError):
    """The prompt or messages cannot be generated from (empty, too long for a member, ...)."""


class InputTypeError(SafeEngineError, TypeError):
    """An argument has the wrong type (a prompt that is not a string, ...)."""


class ChatTemplateError(InputError):
    """A chat request reached a member that has no chat template."""


class ModelLoadError(SafeEngineError, OSError):
    """A model spec could not be resolved or loaded."""


class ChecksumError(ModelLoadError):
    """Downloaded weights do not match their pinned sha256; they are refused."""


class MemberError(SafeEngineError, RuntimeError):
    """A member failed while serving a request (a remote actor died, timed out, a forward ran out of memory,
    ...). `member`: the member's name in the ensemble, when known."""

    def __init__(self, *args: Any, member: str | None = None, option: str | None = None) -> None:
        super().__init__(*args, option=option)
        self.member = member


class ToolCallError(SafeEngineError, ValueError):
    """A reply that had to contain a tool call has none that could be read."""


class GenerationTimeout(SafeEngineError, TimeoutError):
    """A generation ran past its `timeout_s`; its caches were freed."""


def from_validation_error(owner: str, err: Any) -> SafeEngineError:
    """The SafeEngineError a pydantic validator raised, else a ConfigError naming the rejected field.

    Why: the adapters are pydantic models; their users should catch this library's errors, not pydantic's.
    `err` is a pydantic ValidationError (duck-typed: the engine does not depend on pydantic).
    """
    first = err.errors()[0]
    raised = (first.get("ctx") or {}).get("error")
    if isinstance(raised, SafeEngineError):
        return raised
    field = ".".join(str(part) for part in first.get("loc", ())) or "arguments"
    return ConfigError(f"{owner}: invalid {field}: {first.get('msg')} (got {first.get('input')!r})")


def drop_frame_locals(err: BaseException) -> None:
    """Clear the locals of the finished frames in `err`'s traceback (and its causes'), keeping the lines.

    Why: a request keeps its error until its reader is done with it, and the frames of a failed forward
    hold the batch's jobs and KV caches; the request's memory must go when it fails, not when the error does.
    """
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)  # frames still running (this one's callers) are skipped
        current = current.__cause__ or current.__context__
