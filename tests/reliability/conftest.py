"""Fixtures for the reliability suite: one torch thread, shared tiny ensembles, small helpers.

Tiny models run about ten times faster with one intra-op thread on a shared 2-core machine (two OpenMP
threads spin against each other and against other jobs), so every test here runs with one.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from safe_engine import Ensemble, GenerationResult, Member
from tests.conftest import one_torch_thread, tiny_member, tokenizer

FAMILIES = ("gpt2", "llama2", "qwen2.5-7b-instruct", "mistral-7b-instruct-v0.3", "gpt-neox-20b", "exaone-3.5")
SIMPLE_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
FINISH_REASONS = {"eos", "length", "stop"}


_one_torch_thread = pytest.fixture(scope="package", autouse=True)(one_torch_thread)  # before module fixtures


def small_window_member(
    name: str = "gpt2", seed: int = 11, window: int = 64, learned_positions: bool = False
) -> Member:
    """A tiny random model over a real tokenizer whose context window is only `window` tokens.

    `learned_positions` builds a GPT-2 (absolute position embeddings: running past the window is an
    IndexError, not silent garbage as with rotary Llama)."""
    if not learned_positions:
        return tiny_member(name, seed, context=window)
    tok = tokenizer(name)
    torch.manual_seed(seed)
    gpt2 = GPT2Config(
        vocab_size=len(tok),
        n_positions=window,
        n_embd=32,
        n_layer=2,
        n_head=4,
        initializer_range=0.6,
        eos_token_id=tok.eos_token_id,
    )
    return Member(GPT2LMHeadModel(gpt2).eval(), tok, name=f"{name}-abs{window}")


@pytest.fixture(scope="package")
def ens3() -> Ensemble:
    """Byte-level BPE (Qwen) drafter, SentencePiece (Llama-2) and GPT-2 verifiers."""
    return Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("llama2", 2), tiny_member("gpt2", 3)])


@pytest.fixture(scope="package")
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


def wait_until(condition, timeout: float = 30.0) -> bool:
    """Poll `condition` until it holds (a round in flight ends within a second on these tiny models)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def live_caches() -> int:
    """KV caches of any request still alive in this process (packed pools or transformers' caches)."""
    from transformers import DynamicCache

    from safe_engine.runtime.packed import KVPool

    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) in (DynamicCache, KVPool))


def script(member: Member, monkeypatch: pytest.MonkeyPatch, token_ids: list[int]) -> Member:
    """Make `member` (as drafter) emit `token_ids` in order, then its EOS: its real forward still runs (so
    its cache is real), only the logits of each request's last row are replaced by a one-hot choice."""
    import weakref

    original = member.forward_many
    prompt_len: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    eos = min(member.eos_ids)

    def forward_many(jobs):
        out = []
        for job, logits in zip(jobs, original(jobs)):
            if job.start == 0:
                prompt_len[job.cache] = len(job.ids)
            k = job.start + len(job.ids) - prompt_len.get(job.cache, 0)
            logits = logits.clone()
            logits[-1] = -1e4
            logits[-1, token_ids[k] if k < len(token_ids) else eos] = 1e4
            out.append(logits)
        return out

    monkeypatch.setattr(member, "forward_many", forward_many)
    return member
