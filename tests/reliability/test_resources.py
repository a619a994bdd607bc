"""Resource bounds: nothing accumulates across calls, and caches hold exactly prompt + generated."""

from __future__ import annotations

import gc
import os
import weakref

import pytest

from safe_engine import Ensemble, Member
from safe_engine.runtime.packed import KVPool
from tests.conftest import tiny_member

from .conftest import check_invariants, live_caches

PROMPTS = ["Alpha beta", "世界 and more", "def main():", "<|im_end|> x", "Once upon"]


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_200_sequential_calls_do_not_leak(ens2, monkeypatch):
    created: list[weakref.ref] = []
    original = Member.new_cache

    def new_cache(self):
        cache = original(self)
        created.append(weakref.ref(cache))
        return cache

    monkeypatch.setattr(Member, "new_cache", new_cache)
    configs = [dict(), dict(method="every_token"), dict(method="single"), dict(aggregation="gac"), dict(stop=["e"])]
    for p in PROMPTS:  # warm-up: memo tables and lazily built maps reach their steady size
        for c in configs:
            ens2.generate(p, max_new_tokens=6, **c)
    gc.collect()
    caches_before, rss_before = live_caches(), rss_bytes()
    objects_before = len(gc.get_objects())
    for k in range(200):
        kw = configs[k % len(configs)]
        if k % 4 == 0:
            res = ens2.stream(PROMPTS[k % len(PROMPTS)], max_new_tokens=6, **kw)
            "".join(res)
            res = res.result
        else:
            res = ens2.generate(PROMPTS[k % len(PROMPTS)], max_new_tokens=6, **kw)
        check_invariants(res, 6, tuple(kw.get("stop", ())))
    gc.collect()
    assert live_caches() <= caches_before
    assert all(ref() is None for ref in created)  # every request's caches were freed
    assert len(gc.get_objects()) - objects_before < 2000
    assert rss_bytes() - rss_before < 64 * 2**20


@pytest.mark.parametrize(
    ("members", "method"),
    [(1, "single"), (2, "safe")],
    ids=["single", "safe-two-copies"],
)
def test_long_generation_cache_holds_exactly_prompt_plus_generated(monkeypatch, members, method):
    max_new = 2048
    ens = Ensemble([tiny_member("gpt2", 3) for _ in range(members)])
    seen: dict[int, int] = {}  # id(member) -> the longest cache it held
    pools: list[KVPool] = []
    original = Member.forward_many

    def forward_many(self, jobs):
        out = original(self, jobs)
        for job in jobs:
            pool = job.cache
            assert isinstance(pool, KVPool)  # tiny Llamas decode with packed pools
            assert pool.length == job.start + len(job.ids)  # the cache mirrors the ids fed so far
            assert pool.length <= len(ens.members[0].prompt_ids("A long story begins")) + max_new
            seen[id(self)] = max(seen.get(id(self), 0), pool.length)
            capacity = max(k.shape[1] for k in pool.keys.values())
            assert capacity <= max(256, 2 * pool.length)  # grown by doubling, never more
            if pool not in pools:
                pools.append(pool)
        return out

    monkeypatch.setattr(Member, "forward_many", forward_many)
    prompt = "A long story begins"
    n_prompt = len(ens.members[0].prompt_ids(prompt))
    stream = ens.stream(prompt, max_new_tokens=max_new, method=method, schedule="rounds")
    text = "".join(stream)
    res = stream.result
    assert res.text == text and res.finish_reason == "length" and res.stats.tokens == max_new
    assert seen[id(ens.members[0])] == n_prompt + max_new - 1  # the last token is never fed back
    if members == 2:
        assert seen[id(ens.members[1])] == n_prompt + max_new  # the verifier scores every drafted token
        assert res.stats.ensembled_tokens == 0
        assert res.stats.forward_passes[ens.names[1]] == res.stats.rounds
    assert ens.open_requests == 0
    config = ens.members[0].model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4  # float32 K and V
    assert per_token * (n_prompt + max_new) < 2 * 2**20  # expected size of a full cache: ~1 MB here
    del stream, res
    pools_alive = [weakref.ref(p) for p in pools]
    pools.clear()
    gc.collect()
    assert all(ref() is None for ref in pools_alive)  # the request's pools were freed
