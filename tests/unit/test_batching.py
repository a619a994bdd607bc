"""Batched decoding: packed forwards equal per-sequence forwards, and every request of a mixed batch gets
exactly its solo result, whoever joins, leaves or is cancelled on the way."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from safe_engine import Ensemble, Member
from safe_engine.engine import rounds as engine_rounds
from safe_engine.runtime.packed import KVPool, packed_forward
from tests.conftest import TINY, tiny_member, tokenizer

PROMPT = "The quick brown fox"


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def tiny_gemma(window: int = 8, seed: int = 4) -> Member:
    """A 2-layer Gemma 3 over the Llama-2 tokenizer: a sliding-window layer (window 8), a global layer, GQA."""
    tok = tokenizer("llama2")
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=len(tok),
        head_dim=8,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        eos_token_id=tok.eos_token_id,
        pad_token_id=0,
        **TINY,
    )
    return Member(Gemma3ForCausalLM(config).eval(), tok, name=f"gemma-window{window}")


@pytest.mark.parametrize("family", ["gpt2", "llama2", "qwen2.5-7b-instruct", "gemma"])
def test_a_packed_forward_equals_per_sequence_forwards_also_after_rollbacks(family):
    member = tiny_gemma() if family == "gemma" else tiny_member(family, 1)
    model = member.model
    assert member.packed
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (7, 30, 3, 20)]  # some past the window
    pools = [KVPool() for _ in seqs]
    rows = packed_forward(model, [(p, 0, s, 3) for p, s in zip(pools, seqs)], member.device)
    for r, s in zip(rows, seqs):
        expected = full_logits(model, s)[-3:]
        assert torch.allclose(r, expected, atol=1e-4 * float(expected.abs().max()))
    # per-request rollbacks of different depths, then ragged continuations in one forward
    tails = [[5, 6], [7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [11]]
    starts = [len(seqs[0]) - 2, len(seqs[1]), len(seqs[2]) - 1, len(seqs[3]) - 9]
    rows = packed_forward(model, [(p, st, t, len(t)) for p, st, t in zip(pools, starts, tails)], member.device)
    for r, s, st, t in zip(rows, seqs, starts, tails):
        expected = full_logits(model, s[:st] + t)[-len(t) :]
        assert torch.allclose(r, expected, atol=1e-4 * float(expected.abs().max()))
    assert [p.length for p in pools] == [st + len(t) for st, t in zip(starts, tails)]


def test_a_sliding_window_model_decodes_past_its_window_like_its_own_generate():
    gemma = tiny_gemma()
    enc = gemma.tokenizer(PROMPT, return_tensors="pt")
    out = gemma.model.generate(**enc, max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = b"".join(gemma.token_bytes[i] or b"" for i in out[0, enc.input_ids.shape[1] :].tolist())
    ens = Ensemble([gemma, tiny_member("gpt2", 3)])
    assert ens.generate(PROMPT, max_new_tokens=40, method="single").text == expected.decode(errors="replace")
    safe = ens.generate(PROMPT, max_new_tokens=40)
    batch = ens.generate_batch([PROMPT, "Hello there", PROMPT], max_new_tokens=40)
    assert batch[0].text == batch[2].text == safe.text


REQUESTS = [
    ("The quick brown fox", {}),
    ("Hello", {"method": "every_token"}),
    ("Once upon a time there was a", {"aggregation": "gac", "max_new_tokens": 25}),
    ("Café 👩‍👩‍👧 世界 — naïve", {"method": "single"}),
    ("A", {"do_sample": True, "temperature": 0.9, "seed": 5}),
    ("Tell me about", {"gates": ("boundary",), "draft_length": 3}),
    ("Stop here", {"stop": ["e", "a"]}),
    ([{"role": "user", "content": "Say hi"}], {"max_new_tokens": 12}),
]


def solo(ens: Ensemble, request, options) -> str:
    # rounds: a lone request may otherwise take the overlap schedule (same text, other pass counts)
    options = {"max_new_tokens": 40, "schedule": "rounds", **options}
    if isinstance(request, str):
        return ens.generate(request, **options)
    return ens.generate(messages=request, **options)


@pytest.fixture
def chat3():
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    return Ensemble(
        [
            tiny_member("qwen2.5-7b-instruct", 1),
            tiny_member("llama2", 2, chat_template=template),
            tiny_member("gpt2", 3, chat_template=template),
        ]
    )


def test_each_request_of_a_mixed_batch_gets_exactly_its_solo_result(chat3, monkeypatch):
    alone = [solo(chat3, r, o) for r, o in REQUESTS]
    widths: list[int] = []
    run_round = engine_rounds.run_round

    def counting(gens):
        widths.append(len(gens))
        return run_round(gens)

    monkeypatch.setattr("safe_engine.engine.scheduler.run_round", counting)
    together: list = [None] * len(REQUESTS)

    def run(i: int) -> None:
        together[i] = solo(chat3, *REQUESTS[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(REQUESTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a, b in zip(alone, together):  # passes may differ: a batch drafts fixed lengths, a lone request adapts
        assert (b.text, b.finish_reason, b.stats.tokens, b.stats.ensembled_tokens) == (
            a.text,
            a.finish_reason,
            a.stats.tokens,
            a.stats.ensembled_tokens,
        )
    assert max(widths) > 2  # the requests really shared rounds
    assert chat3.open_requests == 0


def test_generate_batch_takes_prompts_and_messages_and_respects_max_batch_size(monkeypatch):
    members = [tiny_member("qwen2.5-7b-instruct", 1), tiny_member("llama2", 2)]
    ens = Ensemble(members, max_batch_size=2)
    prompts = ["The quick brown fox", "Hello", "Once upon a time", "A"]
    alone = [ens.generate(p, max_new_tokens=20).text for p in prompts]
    widths: list[int] = []
    run_round = engine_rounds.run_round
    monkeypatch.setattr(
        "safe_engine.engine.scheduler.run_round", lambda gens: widths.append(len(gens)) or run_round(gens)
    )
    results = ens.generate_batch(prompts, max_new_tokens=20)
    assert [r.text for r in results] == alone
    assert max(widths) == 2
    with pytest.raises(TypeError, match="list of prompt"):
        ens.generate_batch("one prompt")
    from safe_engine import ConfigError

    with pytest.raises(ConfigError, match="max_batch_size"):
        Ensemble(members, max_batch_size=0)


def test_a_request_joining_mid_batch_and_one_cancelled_mid_batch(chat3):
    expected_long = chat3.generate(PROMPT, max_new_tokens=60).text
    expected_late = chat3.generate("Hello", max_new_tokens=30).text
    long_stream = chat3.stream(PROMPT, max_new_tokens=60)
    doomed = chat3.stream("Once upon a time", max_new_tokens=60)
    first = next(long_stream)
    next(doomed)
    doomed.close()  # cancelled mid-batch: frees its caches, disturbs no one
    late = chat3.generate("Hello", max_new_tokens=30)  # joins while the long one is running
    rest = "".join(long_stream)
    assert first + rest == expected_long and late.text == expected_late
    assert chat3.open_requests == 0


async def test_async_requests_join_one_batch(chat3):
    import asyncio

    prompts = ["The quick brown fox", "Hello", "Once upon a time"]
    alone = [chat3.generate(p, max_new_tokens=25).text for p in prompts]
    results = await asyncio.gather(*(chat3.agenerate(p, max_new_tokens=25) for p in prompts))
    assert [r.text for r in results] == alone
    deltas = [d async for d in chat3.astream(prompts[0], max_new_tokens=25)]
    assert "".join(deltas) == alone[0]
    assert chat3.open_requests == 0


def test_one_request_failing_leaves_the_others_running(chat3):
    from safe_engine import GenerationTimeout

    expected = chat3.generate(PROMPT, max_new_tokens=40).text
    results: dict = {}

    def run(name, **options):
        try:
            results[name] = chat3.generate(PROMPT, **options)
        except Exception as err:
            results[name] = err

    threads = [
        threading.Thread(target=run, args=("ok",), kwargs={"max_new_tokens": 40}),
        threading.Thread(target=run, args=("late",), kwargs={"max_new_tokens": 400, "timeout_s": 0.05}),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["ok"].text == expected
    assert isinstance(results["late"], GenerationTimeout)
    assert chat3.open_requests == 0


def test_a_blocking_generate_decodes_on_the_callers_thread_and_hands_over_what_is_left(monkeypatch):
    """`generate` runs the rounds on the caller's thread while no other thread runs them (its OpenMP team is
    the one torch already has there); a request that joins meanwhile shares those rounds, and what is left when
    the caller's request ends goes on in a worker thread. Texts are each request's solo text."""
    ens = Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("llama2", 2)])
    short_alone = ens.generate(PROMPT, max_new_tokens=8).text
    long_alone = ens.generate("Hello", max_new_tokens=40).text
    rounds: list[tuple[str, int]] = []  # (thread, requests in the round)
    run_round = engine_rounds.run_round
    results: dict[str, object] = {}
    joiner = threading.Thread(
        target=lambda: results.setdefault("long", ens.generate("Hello", max_new_tokens=40)), name="joiner"
    )

    def recording(gens):
        rounds.append((threading.current_thread().name, len(gens)))
        if len(rounds) == 1 and "long" not in results:  # the caller leads its first round: a second caller arrives
            joiner.start()
            deadline = time.monotonic() + 30
            while ens.waiting_requests == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
        return run_round(gens)

    monkeypatch.setattr("safe_engine.engine.scheduler.run_round", recording)
    caller = threading.current_thread().name
    short = ens.generate(PROMPT, max_new_tokens=8)
    joiner.join(60)
    assert short.text == short_alone and results["long"].text == long_alone
    threads = [name for name, _ in rounds]
    assert threads[0] == caller and "joiner" not in threads  # the joiner waited for the caller's rounds...
    assert any(name == caller and width == 2 for name, width in rounds)  # ...shared them...
    assert threads[-1] == "safe-scheduler"  # ...and a worker took over what was left
    assert ens.wait_idle(30) and ens.open_requests == 0
    rounds.clear()  # ("long" is in results: the hook starts no second joiner)
    stream = ens.stream(PROMPT, max_new_tokens=8)  # a stream decodes in the background, on a worker
    assert "".join(stream) == short_alone and {name for name, _ in rounds} == {"safe-scheduler"}
