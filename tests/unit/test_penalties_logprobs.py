"""Penalties, logit_bias and logprobs: an ensemble of two copies of one model decodes and scores exactly as
that model alone (transformers' own `generate`), and each member is penalised in its own tokens."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from safe_engine import Ensemble, GenerationConfig, Member
from safe_engine.runtime.members import Track
from safe_engine.runtime.penalties import penalize
from tests.conftest import tiny_member, tiny_model, tokenizer

PROMPT = "The the the the"  # repeats: a penalty changes what these tiny models write after it


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency / presence penalties over the generated tokens only (the reference)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def copies(seed: int = 0, name: str = "gpt2") -> tuple[Ensemble, Member]:
    tok = tokenizer(name)
    model = tiny_model(len(tok), seed, tok.eos_token_id)
    a, b = Member(model, tok, name="a"), Member(model, tok, name="b")
    return Ensemble([a, b]), a


def own_generate(member: Member, n: int, **kwargs) -> tuple[list[int], list[torch.Tensor]]:
    """The model's own greedy ids and raw logits (with its logits processors applied by `generate`)."""
    enc = member.tokenizer(PROMPT, return_tensors="pt")
    out = member.model.generate(
        **enc, max_new_tokens=n, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        output_scores=True, **kwargs,
    )  # fmt: skip
    return out.sequences[0, enc.input_ids.shape[1] :].tolist(), [s[0] for s in out.scores]


def text_of(member: Member, ids: list[int]) -> str:
    return b"".join(member.token_bytes[i] or b"" for i in ids).decode("utf-8", errors="replace")


# -- penalties -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options",
    [
        {"repetition_penalty": 1.3},
        {"repetition_penalty": 0.8},
        {"frequency_penalty": 0.9, "presence_penalty": 0.6},
        {"frequency_penalty": -0.5},
    ],
)
def test_penalised_greedy_safe_over_two_copies_is_the_models_own_penalised_generate(options):
    ens, member = copies()
    prompt_len = len(member.prompt_ids(PROMPT))
    if "repetition_penalty" in options:
        reference = {"repetition_penalty": options["repetition_penalty"]}
    else:
        processor = OpenAIPenalties(
            prompt_len, options.get("frequency_penalty", 0.0), options.get("presence_penalty", 0.0)
        )
        reference = {"logits_processor": LogitsProcessorList([processor])}
    ids, _ = own_generate(member, 30, **reference)
    plain, _ = own_generate(member, 30)
    assert ids != plain  # the penalty matters here
    result = ens.generate(PROMPT, max_new_tokens=30, **options)
    assert result.text == text_of(member, ids)
    assert result.stats.ensembled_tokens == 0
    assert ens.generate(PROMPT, max_new_tokens=30, method="single", **options).text == result.text


def test_each_row_of_a_many_position_forward_is_penalised_with_the_tokens_before_it():
    """A verifier scores several drafted positions in one forward: row r must see only the ids before it."""
    member = tiny_member("llama2", 2)
    prompt = member.prompt_ids(PROMPT)
    generated = member.tokenizer(" the cat the cat the dog the", add_special_tokens=False)["input_ids"]
    config = GenerationConfig(repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=0.3)
    track = Track(member, prompt, "v")
    track.ids += generated
    rows, first = track.run(config, rows_from=len(prompt) - 2)  # from inside the prompt to the end
    assert first == len(prompt) - 2 and len(rows) == len(generated) + 2
    all_ids = prompt + generated
    processors = [
        RepetitionPenaltyLogitsProcessor(1.7),
        OpenAIPenalties(len(prompt), config.frequency_penalty, config.presence_penalty),
    ]
    with torch.no_grad():
        logits = member.model(input_ids=torch.tensor([all_ids])).logits[0].float()
    for r, row in enumerate(rows):
        position = first + r
        expected = logits[position : position + 1]
        context = torch.tensor([all_ids[: position + 1]])
        for p in processors:
            expected = p(context, expected)
        assert torch.allclose(row.full(), torch.log_softmax(expected[0], -1), atol=1e-4), r


def test_penalize_equals_the_reference_processors_row_by_row():
    g = torch.Generator().manual_seed(0)
    for rows, n, prompt_len in [(1, 30, 10), (5, 30, 28), (7, 12, 3), (4, 9, 9), (3, 9, 0)]:
        history = torch.randint(0, 40, (n,), generator=g).tolist()
        logits = torch.randn(rows, 50, generator=g)
        out = penalize(logits, history, prompt_len, 0.7, 0.4, 1.6)
        for r in range(rows):
            context = torch.tensor([history[: n - rows + 1 + r]])
            expected = RepetitionPenaltyLogitsProcessor(1.6)(context, logits[r : r + 1].clone())
            expected = OpenAIPenalties(prompt_len, 0.7, 0.4)(context, expected)
            assert torch.allclose(out[r], expected[0], atol=1e-6), (rows, n, prompt_len, r)


def test_penalize_is_the_identity_when_off_and_biases_only_given_ids():
    logits = torch.randn(3, 50)
    history = [1, 2, 2, 7, 9]
    assert torch.equal(penalize(logits, history, 2), logits)
    out = penalize(logits, history, 2, bias={4: 5.0, 49: -100.0, 99: 1.0})  # 99: outside the vocabulary
    assert torch.equal(out[:, 4], logits[:, 4] + 5) and torch.equal(out[:, 49], logits[:, 49] - 100)
    assert torch.equal(out[:, :4], logits[:, :4])


def test_a_penalty_applies_to_each_member_in_its_own_tokenization():
    """Every-token UniTE with a Qwen drafter and a GPT-2 verifier: at each point the verifier's probability of
    its own token is its model's, penalised with the counts of *its* tokens of prompt + accepted text."""
    drafter, verifier = tiny_member("qwen2.5-7b-instruct", 1), tiny_member("gpt2", 3)
    ens = Ensemble([drafter, verifier])
    options = {"method": "every_token", "max_new_tokens": 12, "trace": True, "repetition_penalty": 2.0,
               "frequency_penalty": 1.5}  # fmt: skip
    result = ens.generate(PROMPT, **options)
    plain = ens.generate(PROMPT, **{**options, "repetition_penalty": 1.0, "frequency_penalty": 0.0})
    accepted = result.text.encode()
    prompt = verifier.prompt_ids(PROMPT)
    checked = differs = 0
    for point, other in zip(result.trace or [], plain.trace or []):
        if "\ufffd" in point.drafted or not point.drafted:
            continue
        generated = verifier.vocab.encode(accepted[: point.offset])[0]
        ids = prompt + generated
        with torch.no_grad():
            logits = verifier.model(input_ids=torch.tensor([ids])).logits[0, -1:].float()
        logits = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([ids]), logits)
        logits = OpenAIPenalties(len(prompt), 1.5, 0.0)(torch.tensor([ids]), logits)
        own = verifier.vocab.first_id(point.drafted.encode())
        expected = float(torch.log_softmax(logits[0], -1)[own])
        assert math.log(point.member_probs[1]) == pytest.approx(expected, abs=1e-4)
        checked += 1
        differs += point.offset == other.offset and abs(math.log(point.member_probs[1] / other.member_probs[1])) > 1e-3
    assert checked >= 5 and differs >= 1


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty must be a number in [-2, 2]"),
        ({"presence_penalty": "1"}, "presence_penalty must be a number in [-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be a number > 0"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be a number > 0"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {5: 101}}, "logit_bias values must be numbers in [-100, 100]"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a mapping"),
        ({"logprobs": 21}, "logprobs must be in [0, 20]"),
        ({"logprobs": -1}, "logprobs must be >= 0"),
        ({"logprobs": True}, "logprobs must be an integer"),
    ],
)
def test_bad_values_are_refused_by_name(options, message):
    with pytest.raises(Exception, match=message.replace("[", r"\[").replace("]", r"\]")):
        GenerationConfig(**options)


def test_logit_bias_keys_may_be_strings_as_json_sends_them():
    assert GenerationConfig(logit_bias={"50256": -100, 7: 2.5}).logit_bias == {50256: -100.0, 7: 2.5}
    assert GenerationConfig(logit_bias={}).logit_bias is None


def test_logit_bias_steers_the_drafter_and_bars_the_ensembles_picks():
    ens, member = copies()
    plain = ens.generate(PROMPT, max_new_tokens=12, logprobs=0)
    first = member.vocab.id_of_bytes[bytes(plain.logprobs[0].bytes)]
    barred = ens.generate(PROMPT, max_new_tokens=12, logit_bias={first: -100}, logprobs=0)
    assert member.vocab.id_of_bytes[bytes(barred.logprobs[0].bytes)] != first
    assert barred.logprobs[0].top_logprobs == [] and barred.logprobs[0].logprob > -50
    favoured = next(i for i in range(300, 400) if member.token_bytes[i])
    pushed = ens.generate(PROMPT, max_new_tokens=3, logit_bias={favoured: 100})
    assert pushed.text.startswith(member.token_bytes[favoured].decode())
    # an ensemble of different tokenizers never picks a barred string either
    mixed = Ensemble([tiny_member("gpt2", 3), tiny_member("llama2", 2)])
    free = mixed.generate(PROMPT, max_new_tokens=20, trace=True, method="every_token")
    chosen = [p.chosen for p in free.trace or [] if p.chosen]
    gpt2 = mixed.members[0]
    bar = {gpt2.vocab.first_id(c.encode()): -100 for c in chosen[:3]}
    steered = mixed.generate(PROMPT, max_new_tokens=20, trace=True, method="every_token", logit_bias=bar)
    for p in steered.trace or []:
        if p.chosen:
            assert gpt2.vocab.first_id(p.chosen.encode()) not in bar


# -- logprobs --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"repetition_penalty": 1.3}])
def test_greedy_safe_over_two_copies_reports_the_models_own_logprobs(options):
    ens, member = copies()
    ids, scores = own_generate(member, 25, **options)
    result = ens.generate(PROMPT, max_new_tokens=25, logprobs=5, **options)
    assert result.text == text_of(member, ids) and result.stats.ensembled_tokens == 0
    entries = result.logprobs or []
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace") == result.text
    assert len(entries) == len(ids)
    for entry, tok, score in zip(entries, ids, scores):
        own = torch.log_softmax(score.float(), -1)  # scores: the logits after generate's processors
        assert entry.source == "drafter"
        assert bytes(entry.bytes) == member.token_bytes[tok]
        assert entry.logprob == pytest.approx(float(own[tok]), abs=1e-4)
        best = torch.topk(own, 5)
        assert [bytes(t.bytes) for t in entry.top_logprobs] == [member.token_bytes[i] for i in best.indices.tolist()]
        for t, value in zip(entry.top_logprobs, best.values.tolist()):
            assert t.logprob == pytest.approx(value, abs=1e-4)


def test_sampled_gac_over_two_copies_reports_the_models_tempered_logprobs():
    """Sampling: every token's logprob is the model's tempered log-probability at its position (GaC's union of
    two copies is the model's own distribution, so speculative sampling keeps every drafted token)."""
    ens, member = copies(1)
    t = 0.7
    result = ens.generate(
        PROMPT, max_new_tokens=25, temperature=t, seed=3, aggregation="gac", sharpening=None, logprobs=3
    )
    entries = result.logprobs or []
    ids = [member.vocab.id_of_bytes[bytes(e.bytes)] for e in entries]
    prompt = member.prompt_ids(PROMPT)
    with torch.no_grad():
        logits = member.model(input_ids=torch.tensor([prompt + ids])).logits[0].float()
    assert {e.source for e in entries} == {"drafter", "ensemble"}  # both kinds of position occur
    for n, (entry, tok) in enumerate(zip(entries, ids)):
        own = torch.log_softmax(logits[len(prompt) - 1 + n] / t, -1)
        assert entry.logprob == pytest.approx(float(own[tok]), abs=1e-4)
        best = torch.topk(own, 3)
        assert [t_.logprob for t_ in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)


def test_an_ensemble_point_reports_the_ensemble_distribution_it_picked_from():
    ens = Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("gpt2", 3)])
    result = ens.generate(PROMPT, max_new_tokens=30, logprobs=4, trace=True, method="every_token")
    entries = result.logprobs or []
    assert entries and all(e.source == "ensemble" for e in entries)
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace") == result.text
    for entry, point in zip(entries, result.trace or []):
        probs = dict(point.candidates)
        assert math.exp(entry.logprob) == pytest.approx(probs[point.chosen], abs=1e-6)
        assert [t.token for t in entry.top_logprobs] == [c for c, _ in point.candidates[:4]]
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob


def test_logprobs_zero_reports_the_chosen_token_only_and_a_stop_string_cuts_the_entries():
    ens, _ = copies()
    full = ens.generate(PROMPT, max_new_tokens=20, logprobs=0)
    assert all(e.top_logprobs == [] for e in full.logprobs or [])
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    cut = ens.generate(PROMPT, max_new_tokens=20, logprobs=0, stop=[stop])
    assert b"".join(bytes(e.bytes) for e in cut.logprobs or []).decode() == cut.text
    assert ens.generate(PROMPT, max_new_tokens=5).logprobs is None


def test_streamed_deltas_carry_their_tokens_logprobs():
    ens, _ = copies()
    result = ens.generate(PROMPT, max_new_tokens=25, logprobs=2)
    events = list(ens.stream(PROMPT, max_new_tokens=25, logprobs=2).events())
    streamed = [e for ev in events for e in ev.logprobs or []]
    assert streamed == result.logprobs
    for ev in events:  # each delta's entries spell it
        if ev.logprobs:
            assert b"".join(bytes(e.bytes) for e in ev.logprobs).decode(errors="replace") == ev.delta
