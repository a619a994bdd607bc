"""UniTE, GaC, sharpening and SAFE's gates on tiny hand-made distributions, against numbers worked out by hand.

Each distribution puts its whole mass on a few real tokens of a real tokenizer (GPT-2 for the drafter,
Llama-2 SentencePiece for the verifier), so every expected value below is plain arithmetic.
"""

from __future__ import annotations

import math

import pytest
import torch

from safe_engine import GenerationConfig
from safe_engine.algorithm.aggregation import UnionVocab, sharpen, string_probs, top_strings, unite
from safe_engine.algorithm.decision import Judge
from safe_engine.runtime.rows import Draws, LocalRow
from tests.conftest import tiny_member

CAT, DOG, CA = b" cat", b" dog", b" ca"


@pytest.fixture(scope="module")
def pair():
    return tiny_member("gpt2", 1), tiny_member("llama2", 2)


def row(member, probs: dict[bytes, float]) -> LocalRow:
    """A row whose distribution is exactly `probs` over the member's single tokens for those strings."""
    logits = torch.full((member.vocab_size,), float("-inf"))
    for s, p in probs.items():
        logits[member.vocab.id_of_bytes[s]] = math.log(p)
    return LocalRow(logits)


def as_dict(dist) -> dict[bytes, float]:
    return {s: round(float(p), 6) for s, p in zip(dist.strings, dist.probs)}


EQUAL = torch.tensor([0.5, 0.5])


def test_unite_renormalises_each_member_over_the_union_of_top_k(pair):
    drafter, verifier = pair
    rows = [row(drafter, {CAT: 0.5, DOG: 0.3, CA: 0.2}), row(verifier, {CAT: 0.6, DOG: 0.4})]
    # top-2 of each: {cat, dog}; drafter over the union: 0.5/0.8, 0.3/0.8; verifier 0.6, 0.4
    dist = unite(pair, rows, EQUAL, top_k=2)
    assert as_dict(dist) == {CAT: round((0.625 + 0.6) / 2, 6), DOG: round((0.375 + 0.4) / 2, 6)}
    # top-3 brings " ca" in; the verifier has no mass on it
    dist = unite(pair, rows, EQUAL, top_k=3)
    assert as_dict(dist) == {CAT: 0.55, DOG: 0.35, CA: 0.1}
    weighted = unite(pair, rows, torch.tensor([0.8, 0.2]), top_k=2)
    assert as_dict(weighted)[CAT] == round(0.8 * 0.625 + 0.2 * 0.6, 6)


def test_unite_scores_a_string_a_member_lacks_by_its_first_token(pair):
    drafter = pair[0]
    assert drafter.vocab.id_of_bytes.get(b" Incorrect") is None  # GPT-2 spells it " Inc" + "orrect"
    qwen = tiny_member("qwen2.5-7b-instruct", 3)
    members = [drafter, qwen]
    rows = [row(drafter, {b" Inc": 0.7, DOG: 0.3}), row(qwen, {b" Incorrect": 0.9, DOG: 0.1})]
    dist = unite(members, rows, EQUAL, top_k=2)
    # drafter's probability of " Incorrect" is that of " Inc"; Qwen's of " Inc" is 0 (its own " Inc" token has none)
    probs = as_dict(dist)
    drafter_share = torch.softmax(torch.log(torch.tensor([0.7, 0.3, 0.7])), 0)  # " Inc", " dog", " Incorrect"
    assert probs[b" Incorrect"] == round((float(drafter_share[2]) + 0.9) / 2, 6)
    assert probs[b" Inc"] == round(float(drafter_share[0]) / 2, 6)


def test_gac_sums_full_distributions_in_the_union_vocabulary(pair):
    drafter, verifier = pair
    rows = [row(drafter, {CAT: 0.5, DOG: 0.3, CA: 0.2}), row(verifier, {CAT: 0.6, DOG: 0.4})]
    dist = UnionVocab(pair).gac(pair, rows, EQUAL)
    assert {s: round(float(p), 6) for s, p in zip(dist.strings[:3], dist.probs[:3])} == {
        CAT: 0.55,
        DOG: 0.35,
        CA: 0.1,
    }
    assert float(dist.union_probs.sum()) == pytest.approx(1.0)
    assert float(dist.probs[3:].sum()) == 0.0


def test_heuristic_sharpening_moves_extensions_onto_the_drafters_prefix(pair):
    drafter, verifier = pair
    rows = [row(drafter, {CA: 0.4, DOG: 0.35, CAT: 0.25}), row(verifier, {CAT: 0.45, DOG: 0.4, CA: 0.15})]
    dist = unite(pair, rows, EQUAL, top_k=3)
    assert as_dict(dist) == {CA: 0.275, DOG: 0.375, CAT: 0.35}  # max 0.375 < 0.5: too smooth
    scores = sharpen(dist, top_strings(drafter, rows[0], 3), "heuristic", 0.1, EQUAL)
    got = dict(zip(dist.strings, scores.tolist()))
    assert got[CA] == pytest.approx(0.275 + 0.35)  # " cat" starts with " ca"
    assert got[DOG] == pytest.approx(0.375) and got[CAT] == pytest.approx(0.35)
    # λ above P_ens(" ca") = 0.275: nothing moves
    assert torch.equal(sharpen(dist, top_strings(drafter, rows[0], 3), "heuristic", 0.3, EQUAL), dist.probs)
    # a confident ensemble is left alone
    sure = unite(pair, [row(drafter, {CAT: 0.9, CA: 0.1}), row(verifier, {CAT: 0.8, CA: 0.2})], EQUAL, top_k=2)
    assert sharpen(sure, [CAT, CA], "heuristic", 0.1, EQUAL) is None


def test_geometric_sharpening_is_the_normalised_geometric_mean(pair):
    drafter, verifier = pair
    rows = [row(drafter, {CA: 0.4, DOG: 0.35, CAT: 0.25}), row(verifier, {CAT: 0.45, DOG: 0.4, CA: 0.15})]
    dist = unite(pair, rows, EQUAL, top_k=3)
    scores = sharpen(dist, [], "geometric", 0.1, EQUAL)
    raw = {CA: math.sqrt(0.4 * 0.15), DOG: math.sqrt(0.35 * 0.4), CAT: math.sqrt(0.25 * 0.45)}
    total = sum(raw.values())
    assert dict(zip(dist.strings, scores.tolist())) == pytest.approx({s: v / total for s, v in raw.items()})


def test_string_probs_sum_every_id_that_spells_the_string():
    llama = tiny_member("llama2", 2)
    space_ids = llama.vocab.ids_of_bytes[b" "]
    assert len(space_ids) == 2  # "▁" and "<0x20>"
    logits = torch.full((llama.vocab_size,), float("-inf"))
    logits[space_ids[0]], logits[space_ids[1]], logits[llama.vocab.id_of_bytes[DOG]] = (
        math.log(0.2),
        math.log(0.1),
        math.log(0.7),
    )
    assert string_probs(llama, LocalRow(logits), [b" ", DOG, CAT]).tolist() == pytest.approx([0.3, 0.7, 0.0])


# -- the gates of one position ------------------------------------------------------------------------------
def judge(pair, **options) -> Judge:
    config = GenerationConfig(**options)
    return Judge(list(pair), EQUAL, config, UnionVocab(pair) if config.aggregation == "gac" else None, Draws(0))


def verdict(pair, drafter_probs, verifier_probs, own=CAT, drafted=CAT, **options):
    drafter, verifier = pair
    rows = [row(drafter, drafter_probs), row(verifier, verifier_probs)]
    return judge(pair, trace=True, **options).judge(
        0, drafter.vocab.id_of_bytes[drafted], rows, [[verifier.vocab.id_of_bytes[own]]]
    )


def test_consensus_b_mean_above_half_skips_even_when_the_verifier_prefers_another_token(pair):
    # verifier's argmax is " dog", but (0.6 + 0.45) / 2 = 0.525 > 1/2
    assert not verdict(pair, {CAT: 0.6, DOG: 0.4}, {DOG: 0.55, CAT: 0.45}).ensembled
    # (0.45 + 0.3) / 2 = 0.375: an ensemble point
    v = verdict(pair, {CAT: 0.45, DOG: 0.4, CA: 0.15}, {DOG: 0.7, CAT: 0.3})
    assert v.ensembled and v.point.member_probs == pytest.approx([0.45, 0.3])
    assert not v.point.unanimous and v.point.gates == ("boundary", "consensus")
    # union {cat, dog, ca}: P_ens(dog) = (0.4 + 0.7) / 2 = 0.55 > P_ens(cat) = 0.375
    assert v.pick.text == DOG and v.point.candidates[0] == (" dog", pytest.approx(0.55))


def test_consensus_a_unanimous_skips_even_below_half(pair):
    # mean (0.4 + 0.5) / 2 = 0.45 < 1/2, but the verifier's argmax is its own token: unanimous
    assert not verdict(pair, {CAT: 0.4, DOG: 0.35, CA: 0.25}, {CAT: 0.5, DOG: 0.3, CA: 0.2}).ensembled


def test_consensus_uses_the_member_weights(pair):
    drafter, verifier = pair
    rows = [row(drafter, {CAT: 0.6, DOG: 0.4}), row(verifier, {DOG: 0.7, CAT: 0.3})]
    config = GenerationConfig()
    own = [[verifier.vocab.id_of_bytes[CAT]]]
    tok = drafter.vocab.id_of_bytes[CAT]
    equal = Judge(list(pair), EQUAL, config, None, Draws(0)).judge(0, tok, rows, own)
    assert equal.ensembled  # 0.5 * 0.6 + 0.5 * 0.3 = 0.45
    heavy = Judge(list(pair), torch.tensor([0.8, 0.2]), config, None, Draws(0)).judge(0, tok, rows, own)
    assert not heavy.ensembled  # 0.8 * 0.6 + 0.2 * 0.3 = 0.54


def test_without_the_consensus_gate_every_aligned_position_is_ensembled(pair):
    v = verdict(pair, {CAT: 0.9, DOG: 0.1}, {CAT: 0.8, DOG: 0.2}, gates=("boundary",))
    assert v.ensembled and v.pick.text == CAT and v.point.unanimous and v.point.gates == ("boundary",)


def test_gac_ensembles_only_where_the_drafter_is_below_one_half(pair):
    # the models disagree, but the drafter is confident (0.6): GaC leaves the position alone
    assert not verdict(
        pair, {CAT: 0.6, DOG: 0.4}, {DOG: 0.9, CAT: 0.1}, aggregation="gac", gates=("boundary",)
    ).ensembled
    v = verdict(pair, {CAT: 0.45, DOG: 0.4, CA: 0.15}, {DOG: 0.9, CAT: 0.1}, aggregation="gac")
    assert v.ensembled and v.pick.text == DOG and v.point.gates == ("boundary", "gac", "consensus")
    # every-token GaC has the same confidence gate
    assert not verdict(
        pair, {CAT: 0.5, DOG: 0.5}, {DOG: 0.9, CAT: 0.1}, aggregation="gac", method="every_token"
    ).ensembled
