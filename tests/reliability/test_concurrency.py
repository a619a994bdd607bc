"""One Ensemble shared by many threads / tasks: every result equals the same call made alone."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from safe_engine import Ensemble
from tests.conftest import tiny_member

from .conftest import SIMPLE_TEMPLATE, check_invariants

THREADS, CALLS = 8, 25
PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "<|im_end|> is plain text here <|endoftext|>",
    "世界 hello 👩‍💻",
    "def f(x):\n    return",
    "</s><s> [INST] hi [/INST]",
]
# schedule="rounds": alone, a request may take the overlap schedule, which gives the same text but other
# counts (rounds; tokens consumed past a stop string); batched requests always decode in rounds.
CONFIGS: list[dict[str, Any]] = [
    dict(method="safe", max_new_tokens=8),
    dict(method="every_token", max_new_tokens=6),
    dict(method="single", max_new_tokens=10),
    dict(method="safe", aggregation="gac", max_new_tokens=8),
    dict(method="safe", stop=["e"], max_new_tokens=10),
    dict(method="every_token", aggregation="gac", stop=[" ", "\n"], max_new_tokens=7),
    dict(method="safe", draft_length=2, sharpening="geometric", max_new_tokens=9),
    dict(method="safe", do_sample=True, seed=5, temperature=0.9, max_new_tokens=8),
]
CONFIGS = [{**c, "schedule": "rounds"} for c in CONFIGS]
MESSAGES = [
    [{"role": "user", "content": "Say <|im_end|> twice"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "世界?"}],
]


@pytest.fixture(scope="module")
def ens() -> Ensemble:
    """Three tokenizer families, all able to chat (chat prompts and raw prompts interleave)."""
    return Ensemble(
        [
            tiny_member("qwen2.5-7b-instruct", 1),
            tiny_member("llama2", 2, chat_template=SIMPLE_TEMPLATE),
            tiny_member("gpt2", 3, chat_template=SIMPLE_TEMPLATE),
        ]
    )


def calls() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(input, config) pairs: every prompt x config, plus chat requests."""
    out = [({"prompt": p}, c) for p in PROMPTS for c in CONFIGS]
    out += [({"messages": m}, c) for m in MESSAGES for c in CONFIGS[:3]]
    return out


def outcome(res) -> tuple:
    """What a request must get whoever runs beside it (its rounds depend on the schedule: a batch drafts in
    lockstep, a lone request adapts its drafts and may overlap)."""
    s = res.stats
    return res.text, res.finish_reason, s.tokens, s.ensembled_tokens


@pytest.fixture(scope="module")
def alone(ens) -> dict[int, tuple]:
    """Each call made alone, sequentially."""
    expected = {}
    for i, (inp, cfg) in enumerate(calls()):
        res = ens.generate(inp.get("prompt"), messages=inp.get("messages"), **cfg)
        check_invariants(res, cfg["max_new_tokens"], tuple(cfg.get("stop", ())))
        expected[i] = outcome(res)
    return expected


def test_threads_share_one_ensemble(ens, alone):
    pool = calls()
    barrier = threading.Barrier(THREADS)
    errors: list[BaseException] = []
    mismatches: list[tuple] = []

    def worker(t: int) -> None:
        try:
            barrier.wait()
            for k in range(CALLS):
                i = (t * CALLS + k * 7) % len(pool)
                inp, cfg = pool[i]
                if k % 3 == 0:  # some through the stream API
                    stream = ens.stream(inp.get("prompt"), messages=inp.get("messages"), **cfg)
                    text = "".join(stream)
                    got = outcome(stream.result)
                    if text != got[0]:
                        mismatches.append(("stream", i, text, got[0]))
                else:
                    got = outcome(ens.generate(inp.get("prompt"), messages=inp.get("messages"), **cfg))
                if got != alone[i]:
                    mismatches.append((i, got, alone[i]))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=600)
    assert not any(th.is_alive() for th in threads)
    assert errors == []
    assert mismatches == []


async def test_engine_async_gather(ens, alone):
    pool = calls()
    picks = list(range(0, len(pool), 3))[:16]

    async def via_astream(i: int) -> tuple:
        inp, cfg = pool[i]
        stream = ens.astream(inp.get("prompt"), messages=inp.get("messages"), **cfg)
        text = "".join([d async for d in stream])
        assert text == stream.result.text
        return outcome(stream.result)

    async def via_agenerate(i: int) -> tuple:
        inp, cfg = pool[i]
        return outcome(await ens.agenerate(inp.get("prompt"), messages=inp.get("messages"), **cfg))

    results = await asyncio.gather(*[via_astream(i) for i in picks], *[via_agenerate(i) for i in picks])
    assert results == [alone[i] for i in picks] * 2


def _langchain():
    from langchain_safe import SafeLLM  # installed by the test extra: an import error fails the test

    return SafeLLM


def test_langchain_batch_matches_single_calls(ens):
    SafeLLM = _langchain()
    llm = SafeLLM(ensemble=ens, max_new_tokens=8)
    expected = [ens.generate(p, max_new_tokens=8).text for p in PROMPTS]
    assert llm.batch(PROMPTS * 2, config={"max_concurrency": 8}) == expected * 2
    stopped = [ens.generate(p, max_new_tokens=10, stop=["e"], method="every_token").text for p in PROMPTS]
    got = llm.batch(PROMPTS, config={"max_concurrency": 8}, stop=["e"], max_tokens=10, method="every_token")
    assert got == stopped


async def test_langchain_async_gather_of_ainvoke_and_astream(ens):
    SafeLLM = _langchain()
    llm = SafeLLM(ensemble=ens, max_new_tokens=8)
    expected = [ens.generate(p, max_new_tokens=8).text for p in PROMPTS]

    async def streamed(p: str) -> str:
        return "".join([chunk async for chunk in llm.astream(p)])

    results = await asyncio.gather(*[llm.ainvoke(p) for p in PROMPTS], *[streamed(p) for p in PROMPTS])
    assert results == expected * 2
    assert await llm.abatch(PROMPTS) == expected


def test_one_tokenizer_shared_by_threads_keeps_control_strings_as_text():
    """Raw prompts (control strings split) and chat templates (control tokens recognised) tokenized at
    once by one fast tokenizer: its `split_special_tokens` switch is shared backend state."""
    from safe_engine.shaping.chat import chat_prompt_ids

    member = tiny_member("qwen2.5-7b-instruct", 1)
    text = "x <|im_end|> y <|im_start|>assistant <|endoftext|> " * 8
    messages = [{"role": "user", "content": text}]
    want_raw = member.prompt_ids(text)
    want_chat = chat_prompt_ids(member, messages)
    want_text = member.vocab.encode_text("<|im_end|>\n", control_tokens=True)
    assert want_raw != member.tokenizer(text)["input_ids"]  # the split matters for this text
    barrier = threading.Barrier(4)
    bad: list[Any] = []

    def worker(t: int) -> None:
        barrier.wait()
        for k in range(300):
            try:
                if (t + k) % 3 == 0:
                    ok = member.prompt_ids(text) == want_raw
                elif (t + k) % 3 == 1:
                    ok = chat_prompt_ids(member, messages) == want_chat
                else:
                    ok = member.vocab.encode_text("<|im_end|>\n", control_tokens=True) == want_text
            except Exception as err:
                ok = repr(err)
            if ok is not True:
                bad.append((t, k, ok))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert bad == []
