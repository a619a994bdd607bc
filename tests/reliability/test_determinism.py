"""Greedy decoding is a function of its input; sampling is a function of its input and seed."""

from __future__ import annotations

import pytest

from safe_engine import Ensemble, GenerationConfig
from tests.conftest import tiny_member

from .conftest import check_invariants

PROMPT = "In the beginning 世界 was"


def run(ens, how: str, **kw):
    if how == "stream":
        stream = ens.stream(PROMPT, **kw)
        text = "".join(stream)
        assert text == stream.result.text
        return stream.result
    return ens.generate(PROMPT, **kw)


@pytest.mark.parametrize("method", ["safe", "every_token", "single"])
@pytest.mark.parametrize("aggregation", ["unite", "gac"])
def test_greedy_is_identical_across_runs_and_apis(ens3, method, aggregation):
    kw = dict(max_new_tokens=12, method=method, aggregation=aggregation)
    results = [run(ens3, how, **kw) for how in ("generate", "generate", "generate", "stream", "stream")]
    first = results[0]
    check_invariants(first, 12)
    for res in results[1:]:
        # not the rounds: schedule="auto" picks each round's schedule from timings (the text does not depend on it)
        assert (res.text, res.finish_reason, res.stats.tokens, res.stats.ensembled_tokens) == (
            first.text,
            first.finish_reason,
            first.stats.tokens,
            first.stats.ensembled_tokens,
        )


def test_greedy_is_identical_on_a_second_ensemble_of_the_same_members(ens3):
    twin = Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("llama2", 2), tiny_member("gpt2", 3)])
    for kw in (dict(), dict(aggregation="gac"), dict(method="every_token", sharpening="geometric")):
        assert (
            ens3.generate(PROMPT, max_new_tokens=10, **kw).text == twin.generate(PROMPT, max_new_tokens=10, **kw).text
        )


@pytest.mark.parametrize("method", ["safe", "every_token", "single"])
def test_sampling_is_identical_for_the_same_seed(ens2, method):
    cfg = GenerationConfig(method=method, do_sample=True, temperature=1.3, top_p=0.95, seed=1234, max_new_tokens=12)
    runs = [run(ens2, how, config=cfg) for how in ("generate", "generate", "generate", "stream")]
    assert len({r.text for r in runs}) == 1
    assert len({(r.stats.tokens, r.stats.ensembled_tokens) for r in runs}) == 1  # rounds: auto times schedules
    others = {ens2.generate(PROMPT, config=cfg.updated(seed=s)).text for s in range(3)}
    assert len(others | {runs[0].text}) > 1  # the seed matters


def test_unseeded_sampling_runs_and_a_seeded_run_is_unaffected_by_it(ens3):
    cfg = GenerationConfig(do_sample=True, seed=7, max_new_tokens=10)
    before = ens3.generate(PROMPT, config=cfg).text
    for _ in range(3):
        check_invariants(ens3.generate(PROMPT, do_sample=True, max_new_tokens=10), 10)
    assert ens3.generate(PROMPT, config=cfg).text == before
