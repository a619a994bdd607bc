"""Resource bounds: nothing accumulates across calls, and caches hold exactly prompt + generated."""

from __future__ import annotations

import gc
import os
import weakref

import pytest

from safe_engine import Ensemble, Member
from safe_engine.decoding import Track
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
    seen: dict[str, int] = {}
    original = Track.run

    def run(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        length = self.cache.get_seq_length()
        assert length == len(self.ids), (self.name, length, len(self.ids))  # the cache mirrors its ids
        assert length <= self.prompt_len + max_new
        seen[self.name] = max(seen.get(self.name, 0), length)
        layers = self.cache.layers
        assert all(layer.keys.shape[-2] == length for layer in layers)
        return out

    monkeypatch.setattr(Track, "run", run)
    prompt = "A long story begins"
    stream = ens.stream(prompt, max_new_tokens=max_new, method=method)
    gen = stream._generation
    text = "".join(stream)
    res = stream.result
    assert res.text == text and res.finish_reason == "length" and res.stats.tokens == max_new
    n_prompt = gen.tracks[0].prompt_len
    assert seen[ens.names[0]] == n_prompt + max_new - 1  # the last token is never fed back
    if members == 2:
        assert seen[ens.names[1]] == n_prompt + max_new  # the verifier scores every drafted token
        assert res.stats.ensembled_tokens == 0
        assert res.stats.forward_passes[ens.names[1]] == res.stats.rounds
    assert all(t.cache is None for t in gen.tracks)
    config = ens.members[0].model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 4  # float32 K and V
    assert per_token * (n_prompt + max_new) < 2 * 2**20  # expected size of a full cache: ~1 MB here
