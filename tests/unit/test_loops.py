"""Issue 31, an ensemble must not loop more than its drafter: token healing (the drafter is never handed a split
its tokenizer does not make), the loop guard and loop steering (both off by default), on real tokenizers and
tiny models.

The study's records (benchmarks/results/accuracy) are read as data: the guard must never fire on an answer
the drafter alone finished, and must catch the loops that answers ending at the budget show.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from safe_engine import ConfigError, Ensemble, Member
from safe_engine.algorithm.aggregation import Pick
from safe_engine.algorithm.text import ends_in_loop, loop_period
from safe_engine.runtime.rows import LocalRow
from tests.conftest import tiny_member, tiny_model, tokenizer

STUDY = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "accuracy"
PARAGRAPH = b"The force doubles when one of the masses doubles, so the answer is (B).\n"


# -- the loop guard's detector ---------------------------------------------------------------------------
def test_a_repeated_paragraph_counts_once_it_has_repeated_enough_times():
    intro = b"Let us think step by step.\n"
    assert not ends_in_loop(intro + PARAGRAPH * 2, 32, 3)
    assert ends_in_loop(intro + PARAGRAPH * 3, 32, 3)
    assert ends_in_loop(bytearray(intro + PARAGRAPH * 2), 32, 2)
    assert not ends_in_loop(intro + PARAGRAPH * 2 + PARAGRAPH[:20], 32, 3)  # the third copy is not there yet
    assert ends_in_loop(intro + PARAGRAPH * 3 + PARAGRAPH[:20], 32, 3)  # a loop seen mid-copy


def test_a_short_period_counts_through_its_multiples_and_span_bounds_the_repetition_needed():
    assert ends_in_loop(b"x" + b"ab" * 48, 32, 3)  # 96 bytes of "ab": three 32-byte copies
    assert not ends_in_loop(b"x" + b"ab" * 47, 32, 3)
    assert not ends_in_loop(b"x = 1\n" * 5, 32, 3)  # 30 bytes of repetition: below 3 x 32


def test_a_numbered_list_that_repeats_its_lines_is_a_loop_when_digits_count_as_equal():
    """GSM8K's loops count on while they repeat ("13. **Step 13: ...", "14. **Step 14: ..."): never two equal
    lines, so only loop steering's digit-blind view sees them; the guard's exact view does not."""
    steps = b"".join(b"%d. **Step %d: Calculate the total distance John drives.**\n" % (i, i) for i in range(11, 14))
    for n in (2, 3):
        text = b"Let us think.\n" + steps[: len(steps) * n // 3]
        assert loop_period(text, 32, n, digits_equal=True) == len(steps) // 3
        assert loop_period(text, 32, n) is None and not ends_in_loop(text, 32, n)
    assert loop_period(b"12 apples and 34 pears. " * 2, 8, 2) == 24  # equal copies: the same either way
    assert loop_period(b"12 apples and 34 pears. " * 2, 8, 2, digits_equal=True) == 24


def test_text_that_never_repeats_a_long_stretch_is_not_a_loop():
    rows = b"".join(b"| %d | %d | %d |\n" % (i, i * i, i * i * i) for i in range(60))  # a table: similar rows
    assert not any(ends_in_loop(rows[:k], 32, 3) for k in range(1, len(rows) + 1))
    assert not ends_in_loop(b"", 32, 3)


def study_answers(row: str) -> list[dict]:
    records = {}
    for path in sorted(STUDY.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if record.get("config") == row:
                records[record["problem_id"], record["task"]] = record
    return list(records.values())


def fires_anywhere(text: str, span: int = 32, repeats: int = 3) -> bool:
    data = text.encode()
    return any(ends_in_loop(data[:k], span, repeats) for k in range(1, len(data) + 1))


def study_loops(record: dict) -> bool:
    """The study's own looping criterion (benchmarks/accuracy_summarize.py `loops`)."""
    text = record["text"]
    return record["finish_reason"] == "length" and len(text) >= 40 and text[-1500:].count(text[-40:]) >= 3


def test_the_guard_never_fires_on_an_answer_the_drafter_alone_finished_and_catches_the_loops():
    """On every prefix of the study's answers (the guard runs after every token), at the documented setting
    (loop_guard=3, loop_span=32): 0 of the drafter's finished answers, and most answers cut in a loop (the
    rest repeat with a counter that changes, "(19) Take 10 steps", which no exact repetition matches)."""
    drafter = study_answers("qwen alone")
    finished = [r for r in drafter if r["finish_reason"] != "length"]
    assert len(finished) > 500  # the four tasks, 150 problems each: the records are there
    assert not [r["problem_id"] for r in finished if fires_anywhere(r["text"])]
    looping = [r for r in drafter + study_answers("smollm2 alone") if study_loops(r)]
    caught = sum(fires_anywhere(r["text"]) for r in looping)
    assert len(looping) > 50 and caught >= 0.8 * len(looping), (caught, len(looping))


# -- the loop guard in the engine --------------------------------------------------------------------------
CYCLE = [" the", " cat", " sat", " on", " a", " mat", "."]
LOOP = dict(zip(CYCLE, CYCLE[1:] + CYCLE[:1]))  # each word -> the next word of the cycle


def looping_member(name: str = "qwen2.5-7b-instruct", nexts: Mapping[str, str | None] = LOOP) -> Member:
    """A tiny model that follows `nexts` (word -> next word, None for end of text); by default, past its prompt,
    it writes " the cat sat on a mat." forever. Its blocks add nothing to the residual stream, so its hidden
    state is the current token's embedding, and its head maps each word's embedding to the next word."""
    tok = tokenizer(name)
    model = tiny_model(len(tok), 11, tok.eos_token_id)
    model = type(model)(model.config).eval()  # a copy: the cached tiny model stays as it is

    def token(word: str | None) -> int:
        return tok.eos_token_id if word is None else tok.convert_tokens_to_ids(tok.tokenize(word))[0]

    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for here, after in nexts.items():
            head[token(after)] += 50 * embed[token(here)] / embed[token(here)].norm()
    return Member(model, tok, name=f"{name}-loop")


@pytest.fixture(scope="module")
def loopers() -> list[Member]:
    return [looping_member(), looping_member()]


def test_a_looping_model_is_ended_by_the_guard_at_the_first_token_that_completes_the_loop(loopers):
    ens = Ensemble(loopers)
    free = ens.generate(" the", max_new_tokens=60)
    assert free.finish_reason == "length" and free.text.count(" the cat sat on a mat.") >= 5  # the model loops
    guarded = ens.generate(" the", max_new_tokens=60, loop_guard=3)
    assert guarded.finish_reason == "repetition"
    assert free.text.startswith(guarded.text) and ends_in_loop(guarded.text.encode(), 32, 3)
    shorter = guarded.text.encode()
    assert not any(ends_in_loop(shorter[:k], 32, 3) for k in range(len(shorter) - 1))
    assert guarded.stats.ensembled_tokens == 0  # two copies agree everywhere: the guard is not the ensemble's
    # token by token, whatever the schedule or the batch: the same answer
    for options in ({"schedule": "rounds"}, {"schedule": "overlap"}, {"draft_length": 1}, {"method": "single"}):
        assert ens.generate(" the", max_new_tokens=60, loop_guard=3, **options).text == guarded.text
    batch = ens.generate_batch([" the", " a"], max_new_tokens=60, loop_guard=3)
    assert batch[0].text == guarded.text and all(r.finish_reason == "repetition" for r in batch)
    assert ens.generate(" the", max_new_tokens=60, loop_guard=2, loop_span=8).text.count("mat.") == 2


def test_loop_steering_goes_back_to_the_replacement_that_helped_the_text_into_a_loop(loopers):
    """A verifier that loops, weighted so that the ensemble follows it, makes the answer repeat " the cat sat on a
    mat." at its replacements. Steering goes back, once the text ends in a stretch of 32+ bytes twice in a row, to
    the first replacement inside those two copies and keeps the drafter's own token there (unhealed picks: the
    handed token is the pick's own). Before that point the answer is the free one; the stats, the trace and the stream
    describe the final text; and the rounds do not matter."""
    ens = Ensemble([tiny_member("qwen2.5-7b-instruct", 1), loopers[0]], weights=[1, 50])
    options = {"max_new_tokens": 80, "trace": True, "token_healing": False}
    free = ens.generate(" the", **options)
    steered = ens.generate(" the", loop_steer=2, **options)

    def loops_by_replacement(res, end: int) -> int | None:  # first replacement in the copies of text[:end]'s loop
        period = loop_period(res.text.encode()[:end], 32, 2)
        inside = [p.offset for p in res.trace if p.replaced and period and end - 2 * period <= p.offset < end]
        return inside[0] if inside else None

    assert free.text.count(" the cat sat on a mat.") >= 8 and free.stats.replaced_tokens > 60
    stats, trace = steered.stats, steered.trace
    assert stats.steered_tokens > 0 and 0 < stats.rolled_back_tokens <= 80 and stats.tokens == 80
    # a loop helped by a replacement is left only where going back would take back more than the budget allows
    # (max_new_tokens tokens per answer; a token is at least one byte)
    end = len(steered.text.encode())
    left = loops_by_replacement(steered, end)
    assert left is None or stats.rolled_back_tokens + end - left > 80
    assert (stats.ensembled_tokens, stats.replaced_tokens) == (len(trace), sum(p.replaced for p in trace))
    points = [p for p in trace if p.steered]
    assert len(points) == stats.steered_tokens
    assert all(not p.replaced and p.handed == p.drafted and p.chosen != p.drafted for p in points)
    first = points[0].offset  # the free answer's first loop helped by a replacement: steering went back to it
    ends = sorted({p.offset + len(p.handed.encode()) for p in free.trace})
    assert first == next(o for e in ends if (o := loops_by_replacement(free, e)) is not None)
    assert steered.text.encode()[:first] == free.text.encode()[:first] != steered.text.encode()[: first + 1]
    # checked token by token: the same answer whatever the rounds, the schedule or the batch
    for rounds in ({"schedule": "rounds"}, {"schedule": "overlap"}, {"draft_length": 1}, {"draft_length": 7}):
        assert ens.generate(" the", loop_steer=2, **options, **rounds).text == steered.text
    assert ens.generate_batch([" the", " a"], loop_steer=2, **options)[0].text == steered.text
    # a stream never shows text that steering takes back later, and its logprobs spell the final text
    stream = ens.stream(" the", loop_steer=2, max_new_tokens=240, token_healing=False, logprobs=0)
    deltas = list(stream)
    long = stream.result
    assert long.stats.rolled_back_tokens > 0 and len([d for d in deltas if d]) > 1
    assert "".join(deltas) == long.text and "".join(t.token for t in long.logprobs) == long.text
    # the drafter's own loop is not steered: two loopers agree everywhere, so nothing is ever replaced
    twins = Ensemble(loopers)
    free_twins = twins.generate(" the", max_new_tokens=60)
    assert twins.generate(" the", max_new_tokens=60, loop_steer=2).text == free_twins.text
    # steering and the guard together: steered until the guard ends a repetition the drafter keeps writing
    assert twins.generate(" the", max_new_tokens=60, loop_steer=2, loop_guard=3).finish_reason == "repetition"


def test_loop_steering_ends_a_loop_the_verifier_keeps_going_where_the_drafter_alone_would_leave_it():
    """The study's mechanism in miniature: both members know " the cat sat on a mat." and " the dog ran away"
    (then end of text), and the drafter alone takes the dog; the verifier, weighted above it, replaces " dog" by
    " cat" at every " the", so the free answer is a loop with one replacement in each copy. Steering goes back to
    the first replacement inside the two copies, keeps " dog" there, and the answer ends within the budget."""
    away = {" Once": " more", " more": ",", ",": " the", " dog": " ran", " ran": " away", " away": None}
    verifier = looping_member(nexts={**LOOP, **away})
    drafter = looping_member(nexts={**LOOP, **away, " the": " dog"})
    ens = Ensemble([drafter, verifier], weights=[1, 2])
    options = {"max_new_tokens": 80, "trace": True}
    alone = ens.generate(" Once", method="single", **options)
    assert alone.text == " more, the dog ran away" and alone.finish_reason == "eos"
    free = ens.generate(" Once", **options)
    assert free.finish_reason == "length" and free.text.count(" the cat sat on a mat.") >= 10
    assert [p.chosen for p in free.trace if p.replaced] == [" cat"] * free.stats.replaced_tokens
    steered = ens.generate(" Once", loop_steer=2, **options)
    assert (steered.text, steered.finish_reason, steered.stats.tokens) == (alone.text, "eos", alone.stats.tokens)
    assert not ends_in_loop(steered.text.encode(), 32, 2)
    points = [p for p in steered.trace if p.steered]
    assert len(points) == steered.stats.steered_tokens == 1
    assert (points[0].offset, points[0].handed, points[0].chosen) == (len(" more, the"), " dog", " cat")
    # went back over the copies it had written (two of " cat sat on a mat. the", 7 tokens each, or more)
    assert 14 <= steered.stats.rolled_back_tokens <= 80 and steered.stats.replaced_tokens == 0
    # the stream shows none of the copies it took back
    stream = ens.stream(" Once", loop_steer=2, max_new_tokens=80)
    assert "".join(stream) == steered.text and "cat" not in "".join(stream)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"loop_guard": 1}, "loop_guard must be >= 2"),
        ({"loop_steer": 1}, "loop_steer must be >= 2"),
        ({"loop_steer": 2.0}, "loop_steer must be an integer"),
        ({"loop_guard": True}, "loop_guard must be an integer"),
        ({"loop_span": 0}, "loop_span must be >= 1"),
        ({"token_healing": "yes"}, "token_healing must be True or False"),
    ],
)
def test_bad_guard_and_healing_settings_are_refused_by_name(loopers, options, message):
    with pytest.raises(ConfigError, match=message):
        Ensemble(loopers).generate(" the", max_new_tokens=2, **options)


# -- token healing -----------------------------------------------------------------------------------------
def handed(ens: Ensemble, pick: bytes, logits: torch.Tensor, **options) -> bytes:
    """What a replacement hands the drafter at a position whose drafter distribution is `logits`."""
    generation = ens._start(ens.request("Question", **options))
    try:
        ids = generation.handover.ids(Pick.of(pick), LocalRow(logits), 0)
    finally:
        generation.cancel()
    return b"".join(ens.drafter.token_bytes[t] or b"" for t in ids)


def test_a_pick_is_handed_as_the_drafters_own_spelling_not_as_a_split_its_tokenizer_never_makes():
    """The mechanism: Llama-2's tokenizer writes ":" and "\\n" as two tokens where Qwen's writes ":\\n" as one
    (and "\\n\\n" as one). Handed the verifier's ":", a Qwen drafter would continue from ":" + "\\n", a
    sequence its tokenizer never produces; healed, it gets ":\\n" when that is its likeliest token starting
    with ":" — and ":" itself when the drafter prefers it."""
    ens = Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("llama2", 2)])
    drafter, verifier = ens.members
    vocab = drafter.vocab
    assert vocab.encode(b"Answer:\n(B)")[0][1] == vocab.id_of_bytes[b":\n"]  # Qwen: one token
    assert b":\n" not in verifier.vocab.id_of_bytes  # Llama-2 has no such token: its candidate is ":"
    logits = torch.zeros(drafter.vocab_size)
    logits[vocab.id_of_bytes[b":"]], logits[vocab.id_of_bytes[b":\n"]] = 3.0, 5.0
    assert handed(ens, b":", logits) == b":\n"
    assert handed(ens, b":", logits, token_healing=False) == b":"
    logits[vocab.id_of_bytes[b":"]] = 6.0
    assert handed(ens, b":", logits) == b":"
    # a pick the drafter spells with several tokens: UniTE hands one, healed to a spelling that agrees with
    # all of the pick (never one that contradicts its rest)
    pick = next(b for b in verifier.vocab.id_of_bytes if len(b) > 6 and len(vocab.encode(b)[0]) > 1 and b.isascii())
    logits = torch.randn(drafter.vocab_size, generator=torch.Generator().manual_seed(0))
    got = handed(ens, pick, logits)
    assert got and (pick.startswith(got) or got.startswith(pick))


def test_healed_replacements_in_a_generation_start_with_the_pick(members3):
    ens = Ensemble(members3[:2])
    res = ens.generate("The quick brown fox", max_new_tokens=120, trace=True)
    replaced = [p for p in res.trace if p.replaced and p.chosen]
    assert replaced
    for p in replaced:
        assert p.handed.startswith(p.chosen) or p.chosen.startswith(p.handed), p
    assert any(len(p.handed) > len(p.chosen) for p in replaced)  # some picks were merged into a longer token
    unhealed = ens.generate("The quick brown fox", max_new_tokens=120, trace=True, token_healing=False)
    assert all(p.handed == p.chosen or p.chosen.startswith(p.handed) for p in unhealed.trace if p.replaced)
