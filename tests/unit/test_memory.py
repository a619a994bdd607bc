"""Freed memory goes back to the OS when the scheduler goes idle (glibc's malloc_trim), unless turned off; a
finished request holds nothing heavy however long it stays referenced."""

from __future__ import annotations

import ctypes.util
import gc
import types

import pytest
import torch

from safe_engine import Ensemble
from safe_engine.engine import memory, scheduler
from tests.conftest import tiny_member


def test_release_free_memory_trims_under_glibc_and_can_be_turned_off(monkeypatch):
    glibc = memory._malloc_trim() is not None
    assert memory.release_free_memory() is glibc
    if ctypes.util.find_library("c") and "musl" not in (ctypes.util.find_library("c") or ""):
        assert glibc  # this Linux's C library is glibc: the trim must be found
    for off in ("0", "false", "off"):
        monkeypatch.setenv("SAFE_ENGINE_TRIM_IDLE", off)
        assert memory.trim_when_idle() is False and memory.release_free_memory() is False
    monkeypatch.setenv("SAFE_ENGINE_TRIM_IDLE", "1")
    assert memory.trim_when_idle() is True


@pytest.mark.parametrize("requests", [1, 3])
def test_the_scheduler_gives_memory_back_once_each_time_it_goes_idle(monkeypatch, requests):
    calls = []
    monkeypatch.setattr(scheduler, "release_free_memory", lambda: calls.append(1) or True)
    ens = Ensemble([tiny_member("gpt2", 1), tiny_member("llama2", 2)])
    ens.generate_batch(["It was a bright cold day"] * requests, max_new_tokens=4)
    assert ens.wait_idle(30)
    assert calls == [1]  # once, when the last request was over, not per request or per round
    ens.generate("The clocks were striking", max_new_tokens=3)
    assert ens.wait_idle(30) and calls == [1, 1]


def reachable_logits(root: object, vocab_sizes: set[int]) -> list[torch.Tensor]:
    """Floating-point tensors with a vocabulary-sized last dimension (rows of logits) reachable from `root`
    (objects the GC tracks, plus the tensors they hold). Integer tables of vocabulary size (id maps that
    other tests' ensembles built and cached) are the members', not a request's."""
    seen, stack, found = {id(root)}, [root], []
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point() and obj.dim() and obj.shape[-1] in vocab_sizes:
                found.append(obj)
            continue
        if isinstance(obj, type | types.ModuleType | torch.nn.Module):
            continue  # classes, modules and the members' weights are shared, not the request's
        for ref in gc.get_referents(obj):
            if id(ref) not in seen:
                seen.add(id(ref))
                stack.append(ref)
    return found


@pytest.mark.parametrize("options", [{}, {"logprobs": 2}, {"schedule": "overlap"}, {"max_new_tokens": 1}])
def test_a_finished_request_still_referenced_holds_no_logits(options):
    """The soak's growth: a server keeps finished requests referenced for a while (its stream objects, a
    reference cycle until the GC's full pass), and each held its round's logits blocks ([positions, vocab]
    views). A finished request keeps its text, stats and logprobs, and no logits."""
    ens = Ensemble([tiny_member("gpt2", 1), tiny_member("llama2", 2)])
    vocab = {m.vocab_size for m in ens.members} | {m.model.config.vocab_size for m in ens.members}
    stream = ens.stream("It was a bright cold day", **{"max_new_tokens": 12, **options})
    text = "".join(stream)
    assert stream.result.text == text and stream.result.stats.tokens > 0
    generation = stream._ticket.generation
    assert generation.finished
    assert reachable_logits(stream, vocab) == []
    if "logprobs" in options:
        assert len(stream.result.logprobs) == stream.result.stats.tokens  # what it keeps is the answer's
