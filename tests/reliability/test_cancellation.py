"""Abandoned and interrupted generations: caches freed, no work left running, no effect on later calls."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref

import pytest

from safe_engine import Ensemble, SafeEngineError

from .conftest import StreamRecorder, check_invariants, idle, released

PROMPT = "It was a bright cold day in April"
NEXT = "The clocks were striking"


@pytest.fixture(scope="module")
def fresh(ens3) -> dict[str, str]:
    """What the follow-up calls return on an ensemble that never saw an abandoned request."""
    return {
        "safe": ens3.generate(NEXT, max_new_tokens=10).text,
        "gac": ens3.generate(NEXT, max_new_tokens=10, aggregation="gac", method="every_token").text,
    }


def assert_unaffected(ens: Ensemble, fresh: dict[str, str]) -> None:
    assert ens.generate(NEXT, max_new_tokens=10).text == fresh["safe"]
    assert ens.generate(NEXT, max_new_tokens=10, aggregation="gac", method="every_token").text == fresh["gac"]


def passes(gen) -> int:
    return sum(t.passes for t in gen.tracks)


@pytest.mark.parametrize("method", ["safe", "every_token", "single"])
def test_closing_a_stream_after_a_few_deltas_frees_its_caches(ens3, fresh, method):
    stream = ens3.stream(PROMPT, max_new_tokens=200, method=method)
    deltas = [next(stream) for _ in range(3)]
    assert all(deltas)
    gen = stream._generation
    assert not released(gen) and gen.finish_reason is None
    caches = [weakref.ref(t.cache) for t in gen.tracks]
    stream.close()
    assert released(gen)
    done = passes(gen)
    with pytest.raises(SafeEngineError, match="cancelled"):
        next(stream)
    assert passes(gen) == done  # nothing ran after close
    del stream, gen
    gc.collect()
    assert all(ref() is None for ref in caches)
    assert_unaffected(ens3, fresh)


def test_dropping_an_unfinished_stream_frees_everything(ens3, fresh):
    stream = ens3.stream(PROMPT, max_new_tokens=200)
    next(stream)
    refs = [weakref.ref(stream._generation)] + [weakref.ref(t.cache) for t in stream._generation.tracks]
    del stream
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert_unaffected(ens3, fresh)


def test_langchain_stream_generator_close_frees_the_caches(ens3, fresh, monkeypatch):
    from langchain_safe import SafeLLM  # installed by the test extra: an import error fails the test

    recorder = StreamRecorder(monkeypatch)
    llm = SafeLLM(ensemble=ens3, max_new_tokens=200)
    chunks = llm.stream(PROMPT)
    got = [next(chunks) for _ in range(3)]
    assert len(got) == 3
    chunks.close()
    (gen,) = recorder.generations
    assert released(gen) and gen.finish_reason is None
    assert_unaffected(ens3, fresh)


async def test_cancelling_a_task_mid_astream(ens3, fresh, monkeypatch):
    recorder = StreamRecorder(monkeypatch)
    got: list[str] = []
    three = asyncio.Event()

    async def consume() -> None:
        async for delta in ens3.astream(PROMPT, max_new_tokens=400):
            got.append(delta)
            if len(got) == 3:
                three.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(three.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (gen,) = recorder.generations
    assert await asyncio.to_thread(idle, gen)  # the round in flight (if any) ends
    assert released(gen) and gen.finish_reason is None
    settled = passes(gen)
    await asyncio.sleep(0.3)
    assert passes(gen) == settled  # no work left running
    monkeypatch.undo()
    assert_unaffected(ens3, fresh)


async def test_cancelling_langchain_astream_and_agenerate(ens3, fresh, monkeypatch):
    from langchain_safe import SafeLLM  # installed by the test extra: an import error fails the test

    recorder = StreamRecorder(monkeypatch)
    llm = SafeLLM(ensemble=ens3, max_new_tokens=400)
    started = asyncio.Event()

    async def consume() -> None:
        n = 0
        async for _ in llm.astream(PROMPT):
            n += 1
            if n == 2:
                started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    agen = asyncio.create_task(ens3.agenerate(PROMPT, max_new_tokens=400))
    while len(recorder.generations) < 2 or passes(recorder.generations[1]) < 3:
        await asyncio.sleep(0.01)
    agen.cancel()
    with pytest.raises(asyncio.CancelledError):
        await agen
    for gen in recorder.generations:
        assert await asyncio.to_thread(idle, gen)
        assert released(gen)
    monkeypatch.undo()
    assert_unaffected(ens3, fresh)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("who", [0, 1], ids=["drafter", "verifier"])
def test_an_exception_mid_generation_leaves_the_ensemble_usable(ens3, fresh, monkeypatch, exc, who):
    recorder = StreamRecorder(monkeypatch)
    member = ens3.members[who]
    original = member.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise exc("interrupted mid-generation")
        return original(*args, **kwargs)

    monkeypatch.setattr(member, "forward", flaky)
    with pytest.raises(exc, match="interrupted"):
        ens3.generate(PROMPT, max_new_tokens=40)
    (gen,) = recorder.generations
    assert released(gen)
    assert calls["n"] == 4
    monkeypatch.undo()
    assert_unaffected(ens3, fresh)


def test_close_from_another_thread_while_a_round_runs(ens3, fresh, monkeypatch):
    member = ens3.members[1]  # a verifier: blocks inside `_verify`, mid-round
    original = member.forward
    entered, proceed = threading.Event(), threading.Event()

    def slow(*args, **kwargs):
        entered.set()
        assert proceed.wait(30)
        return original(*args, **kwargs)

    monkeypatch.setattr(member, "forward", slow)
    stream = ens3.stream(PROMPT, max_new_tokens=100)
    outcome: list = []

    def consume() -> None:
        try:
            for _ in stream:
                pass
            outcome.append("finished")
        except SafeEngineError as err:
            outcome.append(err)

    worker = threading.Thread(target=consume)
    worker.start()
    assert entered.wait(30)
    stream.close()  # the round holds the request: cancel marks it, the round frees the caches
    gen = stream._generation
    assert gen._cancelled
    proceed.set()
    worker.join(30)
    assert not worker.is_alive()
    assert len(outcome) == 1 and "cancelled" in str(outcome[0])
    assert released(gen)
    monkeypatch.undo()
    assert_unaffected(ens3, fresh)


def test_many_abandoned_streams_leave_no_threads_or_caches(ens3, fresh):
    from .conftest import live_caches

    before_threads = threading.active_count()
    baseline = live_caches()
    for k in range(15):
        stream = ens3.stream(f"{PROMPT} {k}", max_new_tokens=100, method=("safe", "every_token", "single")[k % 3])
        next(stream)
        if k % 2:
            stream.close()
        del stream
    time.sleep(0.05)
    assert live_caches() <= baseline
    assert threading.active_count() <= before_threads
    res = ens3.generate(NEXT, max_new_tokens=10)
    check_invariants(res, 10)
    assert res.text == fresh["safe"]
