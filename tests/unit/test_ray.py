"""Members in Ray actors, on a real local Ray cluster: tiny random models over real tokenizers.

The actors load the same tiny models the local members use, from directories written with
save_pretrained, so a Ray ensemble and a local one must agree token for token.
"""

from __future__ import annotations

import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from safe_engine import ConfigError, Ensemble, GenerationConfig, MemberError, ModelLoadError, ModelSpec, build_request
from safe_engine.algorithm.decoding import Generation
from safe_engine.engine.rounds import run_round
from safe_engine.runtime.ray import MIN_TOP_K, RayMember, load_ray_members, resolve_backends
from tests.conftest import save_tiny_member

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

PROMPT = "The quick brown fox"
PROMPTS = ["The quick brown fox", "Once upon a time", "def main():\n    return", "Paris is the capital of"]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
FAMILIES = [("qwen2.5-7b-instruct", 1), ("llama2", 2), ("gpt2", 3)]
NO_CPU = {"num_cpus": 0}  # tiny actors: do not let Ray's CPU accounting limit how many run at once


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 1024**2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models on a shared 2-core machine: one intra-op thread is faster
    yield
    torch.set_num_threads(before)
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def specs(tmp_path_factory) -> list[ModelSpec]:
    """The tiny models saved as model directories; gpt2 (no template of its own) gets one by spec."""
    root = tmp_path_factory.mktemp("ray-models")
    paths = {name: save_tiny_member(name, seed, root / f"{name}-{seed}") for name, seed in FAMILIES}
    return [ModelSpec(path, chat_template=TEMPLATE if name == "gpt2" else None) for name, path in paths.items()]


@pytest.fixture(scope="module")
def local(specs) -> Ensemble:
    return Ensemble.from_pretrained(specs)


@pytest.fixture(scope="module")
def remote(specs) -> Ensemble:
    return Ensemble.from_pretrained(specs, backend="ray", member_resources=NO_CPU)


def no_open_requests(members, wait_s: float = 0.0) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        if all(not m.open_requests() for m in members if isinstance(m, RayMember)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


# -- the member itself ------------------------------------------------------------------------------
def test_ray_members_mirror_the_local_members(local, remote):
    devices = {m.device for m in remote.members}
    assert len(devices) == 3 and all(d.startswith("ray:") for d in devices)  # verified concurrently
    assert remote._executor is not None
    for here, there in zip(local.members, remote.members):
        assert isinstance(there, RayMember) and there.model is None and there.remote_device == "cpu"
        assert there.name == here.name
        assert there.vocab_size == here.vocab_size
        assert there.eos_ids == here.eos_ids
        assert there.token_bytes == here.token_bytes
        assert there.context_window == here.context_window
        assert there.chat_template == here.chat_template
        assert there.vocab.fingerprint == here.vocab.fingerprint
        assert there.prompt_ids(PROMPT) == here.prompt_ids(PROMPT)
        with pytest.raises(ConfigError, match="Ray actor"):
            there.forward([1, 2], None)


def test_remote_rows_answer_like_local_rows(local, remote):
    """Every Row question, answered from the cached top-K or by one actor call, equals the local answer."""
    config = GenerationConfig()
    for here, there in zip(local.members, remote.members):
        ids = here.prompt_ids(PROMPT + " jumps over the lazy dog")
        key, local_key = there.new_cache(), here.new_cache()
        try:
            far = there.score(key, 0, ids, 4, config)
            near = here.score(local_key, 0, ids, 4, config)
            assert len(far) == len(near) == 4
            for f, n in zip(far, near):
                assert f.argmax() == n.argmax()
                assert f.top(10) == n.top(10)
                assert f.top(MIN_TOP_K + 20) == n.top(MIN_TOP_K + 20)  # past the cached K: fetched
                probe = [0, 5, here.vocab_size - 1, *n.top(3), *sorted(here.eos_ids)]
                assert torch.equal(f.logprob(probe), n.logprob(probe))
                with pytest.raises(ConfigError, match="unite"):
                    f.full()
            # the actor keeps the request's cache: scoring one more token continues from it
            tok = [far[-1].argmax()]
            assert torch.equal(
                there.score(key, len(ids), tok, 1, config)[0].logprob(range(50)),
                here.score(local_key, len(ids), tok, 1, config)[0].logprob(range(50)),
            )
        finally:
            there.release(key)
    assert no_open_requests(remote.members)


def test_sampling_in_the_actor_is_reproducible(remote):
    row = None
    member = remote.members[0]
    key = member.new_cache()
    try:
        row = member.score(key, 0, member.prompt_ids(PROMPT), 1, GenerationConfig(do_sample=True))[0]
        draws = [row.sample(s) for s in (1, 2, 3, 1)]
        assert draws[0] == draws[3]
        assert all(0 <= d < member.vocab_size for d in draws)
    finally:
        member.release(key)
    first = remote.generate(PROMPT, max_new_tokens=24, do_sample=True, temperature=0.8, seed=5)
    again = remote.generate(PROMPT, max_new_tokens=24, do_sample=True, temperature=0.8, seed=5)
    assert first.text == again.text and first.stats.tokens == again.stats.tokens


# -- equality with local members --------------------------------------------------------------------
@pytest.mark.parametrize("method", ["safe", "every_token"])
def test_greedy_output_equals_the_local_ensemble(local, remote, method):
    for prompt in PROMPTS[:2]:
        # one schedule for both: the rounds and passes of schedule="auto" depend on timings
        want = local.generate(prompt, max_new_tokens=40, method=method, aggregation="unite", schedule="rounds")
        got = remote.generate(prompt, max_new_tokens=40, method=method, aggregation="unite", schedule="rounds")
        assert got.text == want.text
        assert got.finish_reason == want.finish_reason
        assert got.stats.tokens == want.stats.tokens and got.stats.rounds == want.stats.rounds
        assert got.stats.ensembled_tokens == want.stats.ensembled_tokens
        assert got.stats.forward_passes == want.stats.forward_passes
    assert want.stats.ensembled_tokens > 0  # the test is not vacuous: the ensemble changed something
    assert (
        "".join(remote.stream(PROMPTS[0], max_new_tokens=30, method=method))
        == local.generate(PROMPTS[0], max_new_tokens=30, method=method).text
    )
    assert no_open_requests(remote.members)


def test_chat_and_stop_strings_equal_the_local_ensemble(local, remote):
    messages = [{"role": "user", "content": "Name three colours."}]
    pair_local = Ensemble([local.members[0], local.members[2]])
    pair_remote = Ensemble([remote.members[0], remote.members[2]])
    want = pair_local.generate(messages=messages, max_new_tokens=30)
    assert pair_remote.generate(messages=messages, max_new_tokens=30).text == want.text
    stop = want.text[10:13]
    stopped = pair_remote.generate(messages=messages, max_new_tokens=30, stop=[stop])
    assert (
        stopped.finish_reason == "stop"
        and stopped.text == pair_local.generate(messages=messages, max_new_tokens=30, stop=[stop]).text
    )


def test_mixed_local_drafter_and_ray_verifiers(local, remote):
    mixed = Ensemble([local.members[0], remote.members[1], remote.members[2]])
    assert mixed._executor is not None
    for method in ("safe", "every_token"):
        want = local.generate(PROMPT, max_new_tokens=40, method=method)
        assert mixed.generate(PROMPT, max_new_tokens=40, method=method).text == want.text
    # and a Ray drafter with a local verifier
    flipped = Ensemble([remote.members[0], local.members[1]])
    assert (
        flipped.generate(PROMPT, max_new_tokens=30).text
        == Ensemble(local.members[:2]).generate(PROMPT, max_new_tokens=30).text
    )
    assert no_open_requests(remote.members)


def test_gac_with_remote_members_fails_before_decoding(remote, local):
    calls = sum(m.traffic.calls for m in remote.members)
    with pytest.raises(ConfigError, match="unite"):
        remote.generate(PROMPT, max_new_tokens=5, aggregation="gac")
    with pytest.raises(ConfigError, match="local-only"):
        Ensemble([local.members[0], remote.members[1]]).stream(PROMPT, aggregation="gac")
    assert sum(m.traffic.calls for m in remote.members) == calls  # nothing was sent
    # the drafter alone needs no aggregation at all
    assert remote.generate(PROMPT, max_new_tokens=5, aggregation="gac", method="single").stats.tokens == 5


def test_logprobs_of_remote_members_equal_the_local_ones_and_penalties_are_refused(remote, local):
    want = local.generate(PROMPT, max_new_tokens=8, logprobs=3)
    got = remote.generate(PROMPT, max_new_tokens=8, logprobs=3)
    assert got.text == want.text and len(got.logprobs) == len(want.logprobs)
    for g, w in zip(got.logprobs, want.logprobs):
        assert (g.token, g.source, [t.token for t in g.top_logprobs]) == (
            w.token,
            w.source,
            [t.token for t in w.top_logprobs],
        )
        assert abs(g.logprob - w.logprob) < 1e-4
    calls = sum(m.traffic.calls for m in remote.members)
    with pytest.raises(ConfigError, match="Ray actor"):
        remote.generate(PROMPT, max_new_tokens=5, repetition_penalty=1.2)
    with pytest.raises(ConfigError, match="logit_bias"):
        remote.generate(PROMPT, max_new_tokens=5, logit_bias={5: 1})
    assert sum(m.traffic.calls for m in remote.members) == calls  # refused before anything was sent


def test_only_small_payloads_cross_the_wire(remote):
    for m in remote.members:
        m.traffic.reset()
    res = remote.generate(PROMPT, max_new_tokens=40, method="every_token")
    for m in remote.members:
        snap = m.traffic.snapshot()
        assert snap["calls"] > 0 and snap["bytes_sent"] > 0 and snap["bytes_received"] > 0
        # never a vocabulary-sized tensor: one float32 row of Qwen's vocabulary alone is 600 kB
        assert snap["max_call_bytes"] < 16_000 < 4 * m.vocab_size
    per_round = sum(m.traffic.snapshot()["bytes_total"] for m in remote.members) / res.stats.rounds
    assert per_round < 20_000


# -- concurrency and release ------------------------------------------------------------------------
def test_concurrent_requests_each_equal_their_solo_result(remote):
    solo = {p: remote.generate(p, max_new_tokens=25).text for p in PROMPTS}
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: remote.generate(p, max_new_tokens=25).text, PROMPTS * 2))
    assert got == [solo[p] for p in PROMPTS * 2]
    assert no_open_requests(remote.members)


def test_actors_hold_no_request_state_after_finish_or_abandon(remote):
    remote.generate(PROMPT, max_new_tokens=10)
    assert no_open_requests(remote.members)

    stream = remote.stream(PROMPT, max_new_tokens=60)
    next(stream)
    assert not no_open_requests(remote.members)  # the request holds caches while it is open
    stream.close()
    assert no_open_requests(remote.members, wait_s=5)  # at once, or when the round in flight ends

    stream = remote.stream(PROMPT, max_new_tokens=60)
    next(stream)
    del stream  # abandoned without close
    gc.collect()
    assert no_open_requests(remote.members, wait_s=5)

    # safety net: a Generation dropped without ever being released frees its caches when collected
    gen = remote._start(build_request(PROMPT, **{"max_new_tokens": 60}))
    assert isinstance(gen, Generation)
    run_round([gen])  # one round of this request alone
    assert gen.error is None
    assert not no_open_requests(remote.members)
    del gen
    gc.collect()
    assert no_open_requests(remote.members, wait_s=10)


def test_a_call_that_times_out_raises_member_error_quickly(remote):
    member = remote.members[1]
    before = member.timeout_s
    member.timeout_s = 0.3
    try:
        started = time.monotonic()
        with pytest.raises(MemberError, match=rf"{member.name}.*did not answer ping within 0.3 s"):
            member.ping(1.5)
        assert time.monotonic() - started < 1.2
    finally:
        member.timeout_s = before
    assert member.alive and member.ping() == "pong"  # a slow answer is not a dead actor


# -- failures ---------------------------------------------------------------------------------------
def test_a_killed_actor_gives_a_clear_member_error_and_leaks_nothing(specs, local):
    ens = Ensemble.from_pretrained(specs, backend=["local", "ray", "ray"], member_resources=NO_CPU)
    drafter, victim, survivor = ens.members
    assert not isinstance(drafter, RayMember) and isinstance(victim, RayMember) and isinstance(survivor, RayMember)
    assert ens.generate(PROMPT, max_new_tokens=30).text == local.generate(PROMPT, max_new_tokens=30).text

    stream = ens.stream(PROMPT, max_new_tokens=200, draft_length=2)
    assert next(stream)
    killer = threading.Thread(target=ray.kill, args=(victim.actor,))
    killer.start()
    killer.join()
    started = time.monotonic()
    with pytest.raises(MemberError, match=rf"member '{victim.name}' .*is dead.*ray.kill") as first:
        for _ in stream:
            pass
    assert time.monotonic() - started < 10
    assert not victim.alive
    assert no_open_requests([survivor])  # the other members' request state was released

    # the dead member stays dead: the next request fails at once, with the same message
    started = time.monotonic()
    with pytest.raises(MemberError) as again:
        ens.generate(PROMPT, max_new_tokens=10)
    assert time.monotonic() - started < 1 and str(again.value) == str(first.value)
    assert no_open_requests([survivor])
    # ...while the ensemble still serves what does not need that member
    assert ens.generate(PROMPT, max_new_tokens=10, method="single").stats.tokens == 10
    without = Ensemble([drafter, survivor])
    want = Ensemble([local.members[0], local.members[2]]).generate(PROMPT, max_new_tokens=20).text
    assert without.generate(PROMPT, max_new_tokens=20).text == want
    assert no_open_requests([survivor])


def test_a_model_that_cannot_load_raises_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="not a model directory"):
        load_ray_members([str(tmp_path / "missing" / "model")], member_resources=NO_CPU)


def test_bad_backend_options_fail_before_any_actor_starts(specs):
    with pytest.raises(ConfigError, match="unknown backend"):
        Ensemble.from_pretrained(specs, backend="gpu")
    with pytest.raises(ConfigError, match="3 members"):
        Ensemble.from_pretrained(specs, backend=["ray", "local"])
    with pytest.raises(ConfigError, match="member_resources"):
        Ensemble.from_pretrained(specs, backend="ray", member_resources=[NO_CPU])
    with pytest.raises(ConfigError, match="member_timeout_s"):
        Ensemble.from_pretrained(specs, backend="ray", member_timeout_s=0)
    assert resolve_backends(["local", "ray", "llama.cpp", "torch"], 4) == ["auto", "ray", "llama.cpp", "torch"]
