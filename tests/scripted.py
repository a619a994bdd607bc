"""A scripted engine for adapter and server tests: tiny random models write gibberish, so tests that need a
particular reply (a tool call, JSON) make the ensemble "write" given deltas. Everything around the decoding
is the engine's own: each call is checked by `Ensemble.request` (`build_request`), and its events come from
the engine's `Reply` (content with tool calls held back, the calls parsed once at the end)."""

from __future__ import annotations

from safe_engine import Ensemble, EnsembleStats, GenerationResult, Request, TextStream
from safe_engine.shaping.reply import Reply


class ScriptedStream(TextStream):
    """Stands in for the engine's TextStream: the events of given deltas, then a GenerationResult."""

    def __init__(self, request: Request, deltas: list[str], finish: str = "eos", prompt_tokens=None) -> None:
        self._reply = Reply(request)
        self._left = list(deltas)
        self._text = "".join(deltas)
        self._finish = finish
        self._prompt_tokens = prompt_tokens or {}
        self.result: GenerationResult | None = None
        self.closed = False

    def events(self):  # TextStream's iteration reads the deltas from here
        """As the engine's: each delta as it comes, the last one with the result."""
        while self.result is None:
            delta = self._left.pop(0) if self._left else ""
            if self._left:
                yield self._reply.event(delta)
                continue
            stats = EnsembleStats(method="safe", tokens=7, ensembled_tokens=1, rounds=2)
            stats.prompt_tokens = dict(self._prompt_tokens)
            stats.forward_passes = {name: 2 for name in self._prompt_tokens}
            event = self._reply.final(delta, GenerationResult(self._text, self._finish, stats))
            self.result = event.result
            yield event

    def close(self) -> None:
        self.closed = True


class ScriptedAsyncStream:
    """The engine's AsyncTextStream over a ScriptedStream."""

    def __init__(self, stream: ScriptedStream) -> None:
        self._stream = stream

    @property
    def result(self) -> GenerationResult | None:
        return self._stream.result

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        try:
            return next(self._stream)
        except StopIteration:
            raise StopAsyncIteration from None

    async def start(self) -> None:
        pass

    async def events(self):
        for event in self._stream.events():
            yield event

    async def aclose(self) -> None:
        self._stream.close()


def script(monkeypatch, ens: Ensemble, *replies: list[str]) -> list[Request]:
    """Make `ens` reply with the given delta lists, in order, through `stream`, `astream`, `generate` and
    `agenerate`; returns the Request of each call."""
    calls: list[Request] = []
    queue = list(replies)
    build = ens.request

    def open_stream(prompt=None, **kwargs) -> ScriptedStream:
        request = build(prompt, **kwargs)
        calls.append(request)
        deltas = queue.pop(0) if len(queue) > 1 else queue[0]
        return ScriptedStream(request, deltas, prompt_tokens={name: 10 + i for i, name in enumerate(ens.names)})

    def generate(prompt=None, **kwargs) -> GenerationResult:
        stream = open_stream(prompt, **kwargs)
        for _ in stream.events():
            pass
        assert stream.result is not None
        return stream.result

    async def agenerate(prompt=None, **kwargs) -> GenerationResult:
        return generate(prompt, **kwargs)

    monkeypatch.setattr(ens, "stream", open_stream)
    monkeypatch.setattr(ens, "astream", lambda prompt=None, **kw: ScriptedAsyncStream(open_stream(prompt, **kw)))
    monkeypatch.setattr(ens, "generate", generate)
    monkeypatch.setattr(ens, "agenerate", agenerate)
    return calls


def pieces(text: str, size: int = 5) -> list[str]:
    """`text` cut into deltas of `size` characters, as verified text arrives."""
    return [text[i : i + size] for i in range(0, len(text), size)]
