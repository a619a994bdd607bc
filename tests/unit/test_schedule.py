"""The single-request schedules: overlap (verifiers behind the drafter, concurrently) and rounds with
replacement-aware drafting give the same greedy text as plain rounds; each lever can be switched off;
cancelling mid-overlap frees everything; streams only ever show verified text."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from safe_engine import ConfigError, Ensemble, SafeEngineError, build_request
from safe_engine.engine.gauge import ScheduleGauge
from safe_engine.runtime.placement import Placement
from tests.conftest import tiny_member
from tests.reliability.conftest import live_caches, wait_until

PROMPT = "The quick brown fox"
SCHEDULES = [
    {"schedule": "rounds", "adaptive_draft": False},
    {"schedule": "rounds", "adaptive_draft": True},
    {"schedule": "overlap", "adaptive_draft": False},
    {"schedule": "overlap", "adaptive_draft": True},
]


def test_two_copies_give_the_models_own_text_in_every_schedule():
    ens = Ensemble([tiny_member("llama2", 7), tiny_member("llama2", 7)])
    texts = set()
    for options in SCHEDULES:
        res = ens.generate(PROMPT, max_new_tokens=40, **options)
        texts.add(res.text)
        assert res.stats.ensembled_tokens == 0 and res.stats.discarded_draft_tokens == 0
        assert res.stats.forward_passes[ens.names[0]] == 40
    assert len(texts) == 1


@pytest.mark.parametrize("aggregation", ["unite", "gac"])
def test_every_schedule_gives_the_same_greedy_text_across_tokenizer_families(members3, aggregation):
    ens = Ensemble(members3)
    ens._schedule_gauge.record_chunk = lambda *timing: None  # overlap one token a round (chunks: below)
    results = [ens.generate(PROMPT, max_new_tokens=80, aggregation=aggregation, **o) for o in SCHEDULES]
    base = results[0]
    for res in results[1:]:
        assert res.text == base.text
        assert res.stats.ensembled_tokens == base.stats.ensembled_tokens
    fixed, adaptive, overlap = results[0].stats, results[1].stats, results[2].stats
    assert adaptive.discarded_draft_tokens < fixed.discarded_draft_tokens  # drafts end where replacements are likely
    assert overlap.discarded_draft_tokens <= overlap.replaced_tokens  # at most the one token drafted meanwhile
    assert overlap.rounds == overlap.tokens + 1 or overlap.rounds > overlap.tokens  # one drafted token a round


@pytest.mark.parametrize("aggregation", ["unite", "gac"])
def test_a_verifiers_context_window_ends_the_text_before_the_same_token_in_every_schedule(aggregation):
    """The answer ends before the first drafted token whose text a verifier's window cannot hold, whether the
    round drafted 5 tokens, fewer (adaptive) or the overlap's one: each schedule cut it elsewhere before."""
    drafter, gpt2 = tiny_member("qwen2.5-7b-instruct", 1), tiny_member("gpt2", 3)
    unbounded = Ensemble([drafter, tiny_member("llama2", 2), gpt2])
    whole = unbounded.generate(PROMPT, max_new_tokens=80, aggregation=aggregation, logprobs=0)
    id_of = {piece: i for i, piece in enumerate(drafter.token_bytes) if piece}
    for window in (40, 47):
        small = tiny_member("llama2", 2, context=window)  # the same weights: a window is all that differs
        ens = Ensemble([drafter, small, gpt2])
        ens._schedule_gauge.record_chunk = lambda *timing: None  # overlap one token a round
        results = [ens.generate(PROMPT, max_new_tokens=80, aggregation=aggregation, **o) for o in SCHEDULES]
        assert {r.text for r in results} == {results[0].text}
        res = results[0]
        assert res.finish_reason == "length" and res.stats.tokens < whole.stats.tokens
        tokens = [bytes(entry.bytes) for entry in whole.logprobs[: res.stats.tokens]]
        assert res.text.encode() == b"".join(tokens)  # the unbounded answer, cut
        # the token the drafter drafted next: its greedy token after the answer's ids
        ids = drafter.prompt_ids(PROMPT) + [id_of[piece] for piece in tokens]
        with torch.no_grad():
            drafted = drafter.token_bytes[int(drafter.model(torch.tensor([ids])).logits[0, -1].argmax())]
        prompt, text = len(small.prompt_ids(PROMPT)), b"".join(tokens)
        assert prompt + len(small.vocab.encode(text)[0]) < window <= prompt + len(small.vocab.encode(text + drafted)[0])


def test_the_levers_can_be_switched_off_and_bad_values_are_refused(members3):
    ens = Ensemble(members3)
    fixed = ens.generate(PROMPT, max_new_tokens=40, schedule="rounds", adaptive_draft=False).stats
    adaptive = ens.generate(PROMPT, max_new_tokens=40, schedule="rounds", adaptive_draft=True).stats
    # every round drafts 5 new tokens, but the last rounds, which the budget of 40 may cut short
    assert fixed.forward_passes[ens.names[0]] >= 5 * (fixed.rounds - 2)
    assert adaptive.forward_passes[ens.names[0]] < 5 * (adaptive.rounds - 1)  # shorter drafts where unsure
    with pytest.raises(ConfigError, match="schedule"):
        ens.generate(PROMPT, schedule="pipelined")
    with pytest.raises(ConfigError, match="adaptive_draft"):
        ens.generate(PROMPT, adaptive_draft="yes")


SPARE = Placement(cores=2, drafter=1, verifiers=1, batch=2, process=2, chosen_by="engine")
NO_SPARE = Placement(cores=1, drafter=1, verifiers=1, batch=1, process=1, chosen_by="engine")


def test_auto_overlaps_a_lone_request_only_with_a_spare_core(members3):
    ens = Ensemble(members3)
    ens.placement = SPARE
    assert ens._start(build_request(PROMPT)).can_overlap  # the gauge times overlap first
    ens.placement = NO_SPARE
    assert not ens._start(build_request(PROMPT)).can_overlap
    assert ens._start(build_request(PROMPT, **{"schedule": "overlap"})).can_overlap
    assert not ens._start(build_request(PROMPT, **{"schedule": "overlap", "method": "every_token"})).can_overlap


def test_the_schedule_gauge_times_both_in_blocks_runs_the_faster_and_times_them_again():
    gauge, block = ScheduleGauge(), ScheduleGauge.BLOCK
    timed = []

    def round_of(seconds: float, tokens: int) -> None:
        schedule = gauge.choose()
        timed.append(schedule)
        gauge.record(schedule, seconds, tokens)

    for _ in range(block + 1):  # the first round after a switch (here: the first ever) is not timed
        round_of(0.1 if gauge.choose() == "overlap" else 0.5, 1)
    assert timed == ["overlap"] * (block + 1)
    while gauge._timing:
        round_of(0.1 if gauge.choose() == "overlap" else 0.5, 1)
    assert timed.count("rounds") == 2 * (block + 1)  # two blocks each, alternating
    assert gauge.seconds_per_token == pytest.approx({"overlap": 0.1, "rounds": 0.5})
    assert gauge.choose() == "overlap"  # the faster one, from now on
    gauge.record("overlap", 1.0, ScheduleGauge.REPROBE - 1)
    assert not gauge._timing
    gauge.record("overlap", 0.1, 1)
    assert gauge._timing  # REPROBE tokens later both are timed again (a neighbour may have started)
    while gauge._timing:
        round_of(0.3 if gauge.choose() == "overlap" else 0.2, 1)
    assert gauge.choose() == "rounds"


def test_the_overlap_chunk_grows_while_the_verifiers_cannot_keep_up():
    gauge = ScheduleGauge()
    for schedule, seconds in (("overlap", 10.0), ("overlap", 10.0), ("rounds", 1.0), ("rounds", 1.0)):
        gauge.record(schedule, seconds, ScheduleGauge.WINDOW)  # each schedule's first round is not timed
    assert gauge.choose() == "rounds"  # one token a round is slow: the verifiers made the drafter wait
    for ratio in (1.8, 1.7, 0.2, 1.9):  # median 1.75
        gauge.record_chunk(ratio)
    assert gauge.chunk == 2
    assert gauge.choose() == "overlap"  # a grown chunk is timed afresh
    for ratio in (0.9, 0.8, 2.5, 0.7):  # one outlier (a cold forward) does not move the median
        gauge.record_chunk(ratio)
    assert gauge.chunk == 2
    for _ in range(10 * ScheduleGauge.CHUNK_SAMPLES * ScheduleGauge.MAX_CHUNK):
        gauge.record_chunk(3.0, limit=5)
    assert gauge.chunk == 5  # never past the request's draft_length
    for _ in range(10 * ScheduleGauge.CHUNK_SAMPLES * ScheduleGauge.MAX_CHUNK):
        gauge.record_chunk(3.0)
    assert gauge.chunk == ScheduleGauge.MAX_CHUNK


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_an_overlap_chunk_of_any_size_gives_the_rounds_text(members3, chunk):
    ens = Ensemble(members3)
    rounds = ens.generate(PROMPT, max_new_tokens=80, schedule="rounds")
    ens._schedule_gauge.chunk = chunk
    ens._schedule_gauge.record_chunk = lambda *timing: None  # hold the chunk at its size
    overlap = ens.generate(PROMPT, max_new_tokens=80, schedule="overlap")
    assert overlap.text == rounds.text
    assert overlap.stats.ensembled_tokens == rounds.stats.ensembled_tokens
    drafted = overlap.stats.forward_passes[ens.names[0]]
    assert (chunk - 0.5) * overlap.stats.rounds <= drafted <= chunk * overlap.stats.rounds  # a chunk a round


def test_auto_falls_back_to_rounds_when_the_verifiers_cannot_keep_up(monkeypatch):
    ens = Ensemble([tiny_member("llama2", 7), tiny_member("llama2", 7)])  # no replacement: rounds draft 5 a pass
    ens.placement = SPARE
    rounds_text = ens.generate(PROMPT, max_new_tokens=100, schedule="rounds").text
    verifier = ens.members[1]
    original = verifier.forward_many

    def sluggish(jobs):  # a verifier 50 ms slower than the tiny drafter's step
        time.sleep(0.05)
        return original(jobs)

    monkeypatch.setattr(verifier, "forward_many", sluggish)
    ens._schedule_gauge = ScheduleGauge()  # timed afresh, with the sluggish verifier
    ens._schedule_gauge.record_chunk = lambda *timing: None  # one token a round (a chunk would hide the sleep)
    res = ens.generate(PROMPT, max_new_tokens=100)
    assert res.text == rounds_text  # the schedule changes mid-request; the greedy text does not
    timed = ens._schedule_gauge.seconds_per_token
    assert timed["overlap"] > timed["rounds"]  # a verification a token costs more than one a round
    assert not ens._start(build_request(PROMPT)).can_overlap
    assert ens._start(build_request(PROMPT, **{"schedule": "overlap"})).can_overlap  # forcing it still works


def test_streams_show_verified_text_only_in_the_overlap_schedule(members3):
    ens = Ensemble(members3)
    final = ens.generate(PROMPT, max_new_tokens=60, schedule="rounds").text
    stream = ens.stream(PROMPT, max_new_tokens=60, schedule="overlap")
    shown = ""
    for delta in stream:
        shown += delta
        assert final.startswith(shown)  # nothing shown is ever taken back
    assert shown == final == stream.result.text


def test_cancelling_mid_overlap_frees_everything(members3, monkeypatch):
    ens = Ensemble(members3)
    baseline = live_caches()
    verifier = ens.members[1]
    original = verifier.forward_many
    entered, proceed = threading.Event(), threading.Event()

    def slow(jobs):
        entered.set()
        assert proceed.wait(30)
        return original(jobs)

    stream = ens.stream(PROMPT, max_new_tokens=200, schedule="overlap")
    next(stream)
    monkeypatch.setattr(verifier, "forward_many", slow)  # the next verification blocks beside the drafter
    assert entered.wait(30)
    stream.close()
    proceed.set()
    with pytest.raises(SafeEngineError, match="cancelled"):
        next(stream)
    assert wait_until(lambda: ens.open_requests == 0)
    monkeypatch.undo()
    stream = None
    assert live_caches() <= baseline
    assert ens.generate(PROMPT, max_new_tokens=10).stats.tokens == 10


def test_a_seeded_sample_is_the_same_in_every_schedule_and_in_a_batch(members3):
    """Random numbers are keyed by position and purpose, not drawn in sequence, so how drafting and
    judging interleave does not change what a seed samples."""
    ens = Ensemble(members3)
    options = {"do_sample": True, "temperature": 0.9, "seed": 11, "max_new_tokens": 60}
    texts = {ens.generate(PROMPT, **options, **schedule).text for schedule in SCHEDULES}
    batch = ens.generate_batch([PROMPT, "Hello there", PROMPT], **options)
    texts |= {batch[0].text, batch[2].text}
    assert len(texts) == 1
    assert ens.generate(PROMPT, **{**options, "seed": 12}).text not in texts
