"""The reply of one request as it streams: `StreamEvent`s, read from the verified text by one `Reply`.

Why here and once: every door shows the same thing — content that can never turn out to be a tool call,
then the final content, tool calls and invalid calls, parsed once when the text is complete. The
scheduler builds the events with a `Reply`; `generate`, `stream`, `astream`, both adapters and the server
read them, none parses again.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..stats import GenerationResult, TokenLogprob
from .request import Request
from .tools import ToolCallHoldback


@dataclass(frozen=True)
class StreamEvent:
    """One step of a request: new verified text; the last event also carries the result.

    `delta` is the verified text as generated; `content` the part of the reply's content that can be
    shown now (equal to `delta` without tools; with tools, text that may start a tool call is held back
    and the rest of the content comes with the result). `error` is set on the event that ends a failed
    request: the readers (`Ticket.events`) raise it instead of yielding it.
    """

    delta: str
    result: GenerationResult | None = None
    content: str = ""
    error: BaseException | None = None
    logprobs: list[TokenLogprob] | None = None  # with logprobs=k: the entries of the tokens that spell `delta`


class Reply:
    """Turns one request's verified text into `StreamEvent`s and completes its result."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self._holdback = ToolCallHoldback(request.tools, request.tool_choice) if request.reads_tool_calls else None

    def event(self, delta: str, logprobs: list[TokenLogprob] | None = None) -> StreamEvent:
        """The event for text verified in a round that did not finish the request."""
        return StreamEvent(delta, content=self._feed(delta), logprobs=logprobs)

    def final(self, delta: str, result: GenerationResult, logprobs: list[TokenLogprob] | None = None) -> StreamEvent:
        """The last event: the remaining content, and the result with its content and tool calls."""
        content = self._feed(delta)
        if self._holdback is None:
            result.content = result.text
            return StreamEvent(delta, result, content, logprobs=logprobs)
        content += self._holdback.flush()
        parsed = self._holdback.parsed
        assert parsed is not None
        if not self.request.parallel_tool_calls:
            parsed = parsed.first_call_only()
        result.content, result.tool_calls, result.invalid_tool_calls = parsed.content, parsed.tool_calls, parsed.invalid
        return StreamEvent(delta, result, content, logprobs=logprobs)

    def _feed(self, delta: str) -> str:
        return self._holdback.feed(delta) if self._holdback is not None else delta
