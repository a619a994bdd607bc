"""Freed memory goes back to the OS when the scheduler goes idle (glibc's malloc_trim), unless turned off."""

from __future__ import annotations

import ctypes.util

import pytest

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
