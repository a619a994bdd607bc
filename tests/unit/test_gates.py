"""SAFE's gates as the paper defines them, seen through the decision trace, on tiny models over three real
tokenizer families: the faithful every-token baseline, each gate alone, GaC's confidence gate, what UniTE
hands the drafter, judging a verifier's last token only once it is whole, and linear-time re-tokenization.
"""

from __future__ import annotations

import pytest
import torch

from safe_engine import Ensemble, EnsemblePoint, Member
from safe_engine.algorithm import alignment, scan
from tests.conftest import tiny_member

PROMPT = "The quick brown fox"


def ensembled_inside_a_word(res) -> list[EnsemblePoint]:
    """Trace points where some tokenizer had no token boundary (the boundary gate's business)."""
    return [p for p in res.trace if not p.aligned]


def consensus_holds(p: EnsemblePoint, n: int) -> bool:
    return p.unanimous or sum(p.member_probs) / n > 0.5


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"aggregation": "gac"},
        {"method": "every_token"},
        {"gates": ("boundary",)},
        {"gates": ("consensus",)},
        {"do_sample": True, "seed": 3},
    ],
    ids=["safe", "gac", "every_token", "boundary-only", "consensus-only", "sampling"],
)
def test_trace_lists_every_ensemble_point_and_changes_nothing(members3, options):
    ens = Ensemble(members3)
    plain = ens.generate(PROMPT, max_new_tokens=50, **options)
    assert plain.trace is None  # off by default
    res = ens.generate(PROMPT, max_new_tokens=50, trace=True, **options)
    assert res.text == plain.text and res.stats.ensembled_tokens == plain.stats.ensembled_tokens
    assert len(res.trace) == res.stats.ensembled_tokens > 0
    offsets = [p.offset for p in res.trace]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    assert res.stats.replaced_tokens == sum(p.replaced for p in res.trace)
    for p in res.trace:
        assert len(p.member_probs) == 3 and p.member_probs[0] == p.drafter_prob
        assert p.candidates and all(a[1] >= b[1] for a, b in zip(p.candidates, p.candidates[1:]))
        clean = res.text.split("\ufffd")[0].encode()  # offsets count raw bytes; U+FFFD replaced some
        if not p.replaced and p.offset + len(p.drafted.encode()) <= len(clean):
            assert clean[p.offset :].startswith(p.drafted.encode())  # the drafted token stayed


def test_safe_points_pass_the_boundary_gate_and_fail_the_consensus_gate(members3):
    ens = Ensemble(members3)
    res = ens.generate(PROMPT, max_new_tokens=80, trace=True)
    assert res.stats.gates == ("boundary", "consensus") and res.trace
    for p in res.trace:
        assert p.gates == ("boundary", "consensus") and p.aligned
        assert not consensus_holds(p, 3)


def test_every_token_is_the_faithful_baseline_without_any_gate(members3):
    ens = Ensemble(members3)
    res = ens.generate(PROMPT, max_new_tokens=60, method="every_token", trace=True)
    assert res.stats.gates == ()
    assert res.stats.ensembled_tokens == res.stats.tokens == res.stats.rounds  # every step, one token a round
    assert all(p.gates == () for p in res.trace)
    assert ensembled_inside_a_word(res)  # no boundary gate: it ensembles inside words too
    copies = Ensemble([members3[0], tiny_member("qwen2.5-7b-instruct", 1)])  # agree everywhere
    res = copies.generate(PROMPT, max_new_tokens=30, method="every_token", trace=True)
    assert res.stats.ensembled_tokens == res.stats.tokens  # no consensus gate: also where the models agree
    assert all(consensus_holds(p, 2) for p in res.trace)


def test_each_gate_alone_is_an_ablation(members3):
    ens = Ensemble(members3)
    boundary = ens.generate(PROMPT, max_new_tokens=60, gates=("boundary",), trace=True)
    assert boundary.stats.gates == ("boundary",)
    assert all(p.gates == ("boundary",) for p in boundary.trace)
    assert not ensembled_inside_a_word(boundary)
    copies = Ensemble([members3[0], tiny_member("qwen2.5-7b-instruct", 1)])
    agree = copies.generate(PROMPT, max_new_tokens=30, gates=("boundary",), trace=True)
    assert agree.stats.ensembled_tokens == agree.stats.tokens  # agreement is no reason to skip
    assert all(consensus_holds(p, 2) for p in agree.trace)
    consensus = ens.generate(PROMPT, max_new_tokens=60, gates=["consensus"], trace=True)
    assert consensus.stats.gates == ("consensus",)
    assert not any(consensus_holds(p, 3) for p in consensus.trace)
    assert ensembled_inside_a_word(consensus)  # a mismatched tokenization is no reason to skip
    none = ens.generate(PROMPT, max_new_tokens=30, gates=(), trace=True)
    every = ens.generate(PROMPT, max_new_tokens=30, method="every_token", trace=True)
    assert none.text == every.text and none.trace == every.trace  # no gate = every-token ensembling


def peaked(member, scale: float) -> Member:
    """The member with its logits scaled: a more confident model (GaC's gate then has work to do)."""
    model = type(member.model)(member.model.config).eval()
    model.load_state_dict(member.model.state_dict())
    with torch.no_grad():
        model.lm_head.weight *= scale
    return Member(model, member.tokenizer, name=f"{member.name}-x{scale}")


def test_gac_ensembles_only_where_the_drafter_is_unsure(members3):
    ens = Ensemble([peaked(members3[0], 2.0), *members3[1:]])
    for method in ("safe", "every_token"):
        res = ens.generate(PROMPT, max_new_tokens=60, method=method, aggregation="gac", trace=True)
        assert "gac" in res.stats.gates
        assert all(p.drafter_prob < 0.5 and "gac" in p.gates for p in res.trace)
    every = ens.generate(PROMPT, max_new_tokens=60, method="every_token", aggregation="gac")
    assert 0 < every.stats.ensembled_tokens < every.stats.tokens  # confident steps are left to the drafter
    # where no drafted token is unsure, GaC does not even verify
    assert every.stats.forward_passes[ens.names[1]] < every.stats.rounds


def test_unite_hands_the_drafter_its_first_token_of_the_pick_and_gac_the_whole_string(members3):
    ens = Ensemble(members3)
    drafter = ens.drafter
    seen_multi = 0
    for aggregation in ("unite", "gac"):
        res = ens.generate(PROMPT, max_new_tokens=120, aggregation=aggregation, trace=True)
        data = res.text.split("\ufffd")[0].encode()  # offsets count raw bytes; U+FFFD replaced some
        for p in (p for p in res.trace if p.replaced and p.chosen):
            chosen = p.chosen.encode()
            if drafter.vocab.id_of_bytes.get(chosen) is not None or b"\xef\xbf\xbd" in chosen:
                continue  # a single drafter token (or a cut character): nothing to tell apart
            first = drafter.token_bytes[drafter.vocab.encode(chosen)[0][0]]
            if p.offset + len(chosen) > len(data):
                continue
            if aggregation == "unite":
                assert data[p.offset :].startswith(first)
                seen_multi += not data[p.offset :].startswith(chosen)
            else:
                assert data[p.offset :].startswith(chosen)
    assert seen_multi  # the run met picks the drafter spells in several tokens


def own_token_probability(member, prompt: str, data: bytes, offset: int) -> float:
    """P_member(its token starting at `offset` of the final text | everything before), by one fresh forward."""
    prompt_ids = member.prompt_ids(prompt)
    ids, starts = member.vocab.encode(data)
    k = starts.index(offset)
    with torch.no_grad():
        logits = member.model(torch.tensor([prompt_ids + ids[: k + 1]])).logits[0, -2]
    return float(torch.softmax(logits.double(), -1)[ids[k]])


def understated_views(members, max_new_tokens: int = 120) -> tuple[int, int, int]:
    """(points checked, exact, understated): whether each judged verifier probability equals that of its
    whole token in the final text, or is below it (a cut token's falsely low probability). A bound above it
    is allowed: that is what a cut token stands for when the bounds already decide the gate.

    One-token drafts make every drafted position the last one, where a verifier's token can be cut."""
    ens = Ensemble(members)
    res = ens.generate(PROMPT, max_new_tokens=max_new_tokens, draft_length=1, trace=True)
    data = res.text.encode()
    assert "\ufffd" not in res.text  # offsets count raw bytes, as the text's own bytes here
    checked = exact = under = 0
    for p in res.trace:
        if p.replaced or p.offset >= len(data):
            continue  # a replaced point judged the draft's text, which the final text no longer holds
        for member, prob in zip(ens.members[1:], p.member_probs[1:]):
            true = own_token_probability(member, PROMPT, data, p.offset)
            checked += 1
            exact += abs(true - prob) <= 1e-4 * max(true, 1e-6)
            under += prob < true - 1e-4 * max(true, 1e-6)
    return checked, exact, under


def test_a_cut_verifier_token_is_never_judged_at_its_falsely_low_probability(monkeypatch):
    """At the last drafted position a verifier's token may be cut by the end of the draft (" Inc" of
    " Incorrect"). It then stands for the mass of every token consistent with the drafted bytes, and where
    that bound does not settle the consensus gate the position waits for the next round."""
    members = [tiny_member("llama2", 2), tiny_member("gpt2", 3)]
    checked, exact, under = understated_views(members)
    assert checked > 10 and under == 0 and exact > 0
    monkeypatch.setattr(scan, "CARRY_LIMIT", 0)  # every draft counts as final: cut tokens taken as they are
    checked, exact, under = understated_views(members)
    assert under > 0  # the old way: some verifier probabilities were those of cut tokens


def test_retokenizing_after_the_frozen_prefix_equals_full_retokenization(members3, monkeypatch):
    ens = Ensemble(members3, drafter=2)
    prompt = "Café 👩‍👩‍👧 世界 — naïve résumé:"
    lengths: list[int] = []
    encode = type(ens.members[0].vocab).encode

    def spy(self, data):
        lengths.append(len(data))
        return encode(self, data)

    monkeypatch.setattr(type(ens.members[0].vocab), "encode", spy)
    res = ens.generate(prompt, max_new_tokens=400, trace=True, schedule="rounds")  # one schedule for both runs
    assert len(res.text.encode()) > 800
    assert max(lengths) < 200  # a round re-encodes a bounded tail, not the whole output
    monkeypatch.setattr(alignment, "FREEZE_MARGIN", 10**9)  # never freeze: re-encode everything every round
    full = ens.generate(prompt, max_new_tokens=400, trace=True, schedule="rounds")
    assert full.text == res.text and full.trace == res.trace
    assert full.stats.forward_passes == res.stats.forward_passes
