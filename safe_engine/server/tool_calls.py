"""Tool calls in the ensemble's verified text, as OpenAI `tool_calls`.

The reading itself is `safe_engine.shaping.tools` (the parser every adapter shares); this module only holds a
stream back while it may turn into a call and writes the calls in OpenAI's shape (arguments as a JSON
string).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..shaping.tools import ToolCallHoldback


@dataclass
class Reply:
    """An assistant reply in OpenAI's terms."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI shape, arguments as a JSON string
    invalid_tool_calls: list[dict[str, Any]] = field(default_factory=list)  # what could not be parsed, and why


class ReplyFilter:
    """Streams content while tools are given without ever streaming a tool call as text.

    Without tools every delta passes through unchanged. `tool_choice` is the engine's form ("auto",
    "required" or a tool name): a required tool also reads a bare JSON object of its arguments as a call.
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any, first_only: bool) -> None:
        self.first_only = first_only
        self.text = ""
        self._holdback = ToolCallHoldback(tools, tool_choice) if tools else None

    def feed(self, delta: str) -> str:
        """Add verified text; return the content that can be sent now."""
        self.text += delta
        return self._holdback.feed(delta) if self._holdback is not None else delta

    def finish(self) -> tuple[str, Reply]:
        """The content not sent yet, and the complete reply."""
        if self._holdback is None:
            return "", Reply(self.text)
        tail = self._holdback.flush()
        parsed = self._holdback.parsed
        assert parsed is not None
        if self.first_only:
            parsed = parsed.first_call_only()
        calls = [
            {
                "id": call["id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)},
            }
            for call in parsed.tool_calls
        ]
        invalid = [{k: bad.get(k) for k in ("id", "name", "arguments", "error")} for bad in parsed.invalid]
        return tail, Reply(parsed.content, calls, invalid)
