"""A scripted engine stream: makes the served ensemble "write" a given reply (tiny models write gibberish,
so the tool-call tests need a reply that is a call)."""

from __future__ import annotations

import pytest

from safe_engine import Ensemble, EnsembleStats, GenerationResult, StreamEvent


class ScriptedStream:
    """What `Ensemble.stream` returns, with fixed deltas."""

    def __init__(self, deltas: list[str], prompt_tokens: dict[str, int], finish: str = "eos") -> None:
        self.deltas = deltas
        self.closed = False
        stats = EnsembleStats(method="safe", tokens=len(deltas), ensembled_tokens=1, rounds=len(deltas))
        stats.prompt_tokens = dict(prompt_tokens)
        stats.forward_passes = {name: len(deltas) for name in prompt_tokens}
        self.result = GenerationResult("".join(deltas), finish, stats)

    def events(self):
        for delta in self.deltas[:-1]:
            yield StreamEvent(delta)
        yield StreamEvent(self.deltas[-1] if self.deltas else "", self.result)

    def close(self) -> None:
        self.closed = True


def script(monkeypatch: pytest.MonkeyPatch, ens: Ensemble, deltas: list[str]) -> list[dict]:
    """Make `ens` reply with `deltas`; returns the keyword arguments of each `stream` call."""
    calls: list[dict] = []

    def fake_stream(prompt=None, **kwargs):
        calls.append({"prompt": prompt, **kwargs})
        return ScriptedStream(deltas, {name: 10 + i for i, name in enumerate(ens.names)})

    monkeypatch.setattr(ens, "stream", fake_stream)
    return calls


def pieces(text: str, size: int = 5) -> list[str]:
    """`text` cut into deltas of `size` characters, as verified text arrives."""
    return [text[i : i + size] for i in range(0, len(text), size)]
