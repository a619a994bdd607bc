"""A scripted engine for adapter tests: tiny random models write gibberish, so tests that need a particular
reply (a tool call, JSON) make the ensemble's stream/astream/generate/agenerate return given deltas."""

from __future__ import annotations

from safe_engine import Ensemble, EnsembleStats, GenerationResult, StreamEvent, TextStream


class ScriptedStream(TextStream):
    """Stands in for the engine's TextStream (its `events()` included): yields given deltas, then holds a
    GenerationResult."""

    def __init__(self, deltas: list[str], finish: str = "eos", prompt_tokens: dict | None = None) -> None:
        self._left = list(deltas)
        self._text = "".join(deltas)
        self._finish = finish
        self._prompt_tokens = prompt_tokens or {}
        self.result: GenerationResult | None = None
        self.closed = False

    def __iter__(self):
        return self

    def __next__(self) -> str:
        if not self._left:
            self._done()
            raise StopIteration
        delta = self._left.pop(0)
        if not self._left:
            self._done()
        return delta

    def _done(self) -> None:
        if self.result is None:
            stats = EnsembleStats(method="safe", tokens=7, ensembled_tokens=1, rounds=2)
            stats.prompt_tokens = dict(self._prompt_tokens)
            self.result = GenerationResult(self._text, self._finish, stats)

    def events(self):
        """As the engine's: each delta as it comes, the last one with the result."""
        while self._left:
            delta = self._left.pop(0)
            if not self._left:
                self._done()
            yield StreamEvent(delta, self.result)
        if self.result is None:
            self._done()
            yield StreamEvent("", self.result)

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

    async def events(self):
        for event in self._stream.events():
            yield event

    async def aclose(self) -> None:
        self._stream.close()


def patch_streams(monkeypatch, ens: Ensemble, open_stream) -> None:
    """Route `ens.stream/astream/generate/agenerate` through `open_stream(prompt=None, **kwargs)`."""

    def generate(prompt=None, **kwargs):
        stream = open_stream(prompt, **kwargs)
        for _ in stream:
            pass
        return stream.result

    async def agenerate(prompt=None, **kwargs):
        return generate(prompt, **kwargs)

    monkeypatch.setattr(ens, "stream", open_stream)
    monkeypatch.setattr(ens, "astream", lambda prompt=None, **kw: ScriptedAsyncStream(open_stream(prompt, **kw)))
    monkeypatch.setattr(ens, "generate", generate)
    monkeypatch.setattr(ens, "agenerate", agenerate)


def script(monkeypatch, ens: Ensemble, *replies: list[str]) -> list[dict]:
    """Make `ens` reply with the given delta lists, in order; returns the captured request kwargs."""
    calls: list[dict] = []
    queue = list(replies)

    def fake_stream(prompt=None, **kwargs):
        calls.append({"prompt": prompt, **kwargs})
        deltas = queue.pop(0) if len(queue) > 1 else queue[0]
        return ScriptedStream(deltas, prompt_tokens={name: 10 + i for i, name in enumerate(ens.names)})

    patch_streams(monkeypatch, ens, fake_stream)
    return calls
