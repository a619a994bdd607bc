"""Fixtures for the reliability suite: one torch thread, shared tiny ensembles, small helpers.

Tiny models run about ten times faster with one intra-op thread on a shared 2-core machine (two OpenMP
threads spin against each other and against other jobs), so every test here runs with one.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from safe_engine import Ensemble, GenerationResult, Member
from safe_engine.decoding import Generation
from tests.conftest import tiny_member, tokenizer

FAMILIES = ("gpt2", "llama2", "qwen2.5-7b-instruct", "mistral-7b-instruct-v0.3", "gpt-neox-20b", "exaone-3.5")
SIMPLE_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
FINISH_REASONS = {"eos", "length", "stop"}


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_window_member(name: str = "gpt2", seed: int = 11, window: int = 64) -> Member:
    """A tiny random model over a real tokenizer whose context window is only `window` tokens."""
    tok = tokenizer(name)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=window,
        initializer_range=0.6,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    return Member(LlamaForCausalLM(config).eval(), tok, name=f"{name}-ctx{window}")


@pytest.fixture(scope="session")
def ens3() -> Ensemble:
    """Byte-level BPE (Qwen) drafter, SentencePiece (Llama-2) and GPT-2 verifiers."""
    return Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("llama2", 2), tiny_member("gpt2", 3)])


@pytest.fixture(scope="session")
def ens2() -> Ensemble:
    """Two small vocabularies (GPT-2 drafter, Llama-2 verifier): the cheapest cross-tokenizer ensemble."""
    return Ensemble([tiny_member("gpt2", 1), tiny_member("llama2", 2)])


def check_invariants(res: GenerationResult, max_new_tokens: int, stop: tuple[str, ...] = ()) -> None:
    """What every result must satisfy, whatever the input."""
    stats = res.stats
    assert res.finish_reason in FINISH_REASONS
    assert 0 <= stats.ensembled_tokens <= stats.tokens <= max_new_tokens
    assert 0.0 <= stats.ensemble_rate <= 1.0
    assert stats.rounds >= 1
    if res.finish_reason == "length":
        assert stats.tokens == max_new_tokens
    if res.finish_reason == "stop":
        assert stop
    if stats.method == "single":
        assert stats.ensembled_tokens == 0
    for s in stop:
        assert s not in res.text, (s, res.text)
    res.text.encode("utf-8")  # valid Unicode: no lone surrogates leak out


class StreamRecorder:
    """Patches `Ensemble.stream` to keep every `Generation` it starts (to inspect caches afterwards)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.generations: list[Generation] = []
        self._lock = threading.Lock()
        original = Ensemble.stream

        def stream(ens, *args, **kwargs):
            s = original(ens, *args, **kwargs)
            with self._lock:
                self.generations.append(s._generation)
            return s

        monkeypatch.setattr(Ensemble, "stream", stream)


def released(gen: Generation) -> bool:
    return all(t.cache is None for t in gen.tracks)


def idle(gen: Generation, timeout: float = 30.0) -> bool:
    """Wait until no round of `gen` is running (a worker thread may finish the round in progress)."""
    if gen._busy.acquire(timeout=timeout):
        gen._busy.release()
        return True
    return False


def live_caches() -> int:
    from transformers import DynamicCache

    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, DynamicCache))
