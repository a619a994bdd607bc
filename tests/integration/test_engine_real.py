"""The engine on the real demo models: SmolLM2-135M (byte-level BPE, 49k) and gemma-3-270m
(SentencePiece, 262k), plus Qwen2.5-Coder-0.5B for chat. Fetched and converted once into the cache."""

from __future__ import annotations

import pytest
import torch

from safe_engine import Ensemble, ModelSpec
from safe_engine.runtime.members import load_member

pytestmark = pytest.mark.integration

PROMPT = "The capital of France is Paris. The capital of Germany is"
STORY = "Once upon a time, in a small village by the sea, there lived"


@pytest.fixture(scope="module")
def smol():
    return load_member("smollm2-135m")


@pytest.fixture(scope="module")
def gemma():
    return load_member("gemma3-270m")


def hf_greedy(member, prompt: str, n: int) -> str:
    enc = member.tokenizer(prompt, return_tensors="pt")
    out = member.model.generate(**enc, max_new_tokens=n, do_sample=False, eos_token_id=None)
    return b"".join(member.token_bytes[i] or b"" for i in out[0, enc.input_ids.shape[1] :].tolist()).decode()


@pytest.mark.parametrize("name", ["smol", "gemma"])
def test_single_equals_hf_generate(name, request):
    member = request.getfixturevalue(name)
    res = Ensemble([member]).generate(PROMPT, max_new_tokens=24, method="single")
    assert res.text == hf_greedy(member, PROMPT, 24)


def test_safe_over_two_copies_equals_single(smol):
    twin = Ensemble([smol, smol])
    single = twin.generate(STORY, max_new_tokens=40, method="single")
    safe = twin.generate(STORY, max_new_tokens=40)
    assert safe.text == single.text
    assert safe.stats.ensembled_tokens == 0


def test_safe_across_tokenizer_families(smol, gemma):
    ens = Ensemble([smol, gemma])
    res = ens.generate(STORY, max_new_tokens=64)
    words = res.text.split()
    assert len(words) >= 20 and sum(w.isalpha() for w in words) / len(words) > 0.6, res.text  # fluent prose
    assert 0 < res.stats.ensemble_rate < 1, res.stats
    assert "".join(ens.stream(STORY, max_new_tokens=64)) == res.text
    # a stop string taken from the output is honoured and never emitted
    stop = words[len(words) // 2]
    stopped = ens.generate(STORY, max_new_tokens=64, stop=[stop])
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert res.text.startswith(stopped.text)


def test_gac_across_tokenizer_families(smol, gemma):
    res = Ensemble([smol, gemma], drafter=1).generate(STORY, max_new_tokens=32, aggregation="gac")
    assert res.stats.tokens == 32 and 0 <= res.stats.ensemble_rate < 1


def test_chat_ensemble_answers_a_question(smol):
    qwen = load_member("qwen2.5-coder-0.5b")
    ens = Ensemble([qwen, smol])
    res = ens.generate(
        messages=[{"role": "user", "content": "What is the capital of France? One word."}], max_new_tokens=12
    )
    assert "paris" in res.text.lower(), res.text
    assert res.finish_reason in {"eos", "length"}


def test_base_model_joins_a_chat_ensemble_with_a_template_override(smol):
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}Assistant:"
    )
    gemma_chat = load_member(ModelSpec("gemma3-270m", chat_template=template))
    res = Ensemble([smol, gemma_chat]).generate(
        messages=[{"role": "user", "content": "Name a primary color."}], max_new_tokens=12
    )
    assert res.stats.tokens > 0 and res.text.strip()


def test_after_replacements_the_drafters_cache_gives_what_a_fresh_forward_gives(smol, gemma, monkeypatch):
    """Issue 31's suspect (b): a cache cropped at a replacement and extended by the handed token must give the
    distributions a fresh forward over the same ids gives (measured on the study's pair: 3.4e-5 at most)."""
    from safe_engine.algorithm import decoding

    seen = []
    take = decoding.Generation.take_draft

    def recording(self, rnd, rows):
        seen.append((list(self.drafter.ids), rows[-1].values.clone()))
        return take(self, rnd, rows)

    monkeypatch.setattr(decoding.Generation, "take_draft", recording)
    res = Ensemble([smol, gemma]).generate(STORY, max_new_tokens=64, schedule="rounds")
    assert res.stats.replaced_tokens >= 3, res.stats
    worst = 0.0
    with torch.no_grad():
        for ids, values in seen[::4]:
            fresh = torch.log_softmax(smol.model(torch.tensor([ids])).logits[0, -1].float(), -1)
            worst = max(worst, float((fresh - values).abs().max()))
    assert worst < 1e-3


def test_the_verifiers_views_give_what_a_fresh_forward_gives(smol, gemma, monkeypatch):
    """Issue 31's suspect (b) on the verifier's side: a verifier's cache is cropped to its frozen prefix and its
    tail re-encoded round after round; each distribution it gives an ensemble point must be what a fresh
    forward over the same ids gives (a stale cache would favour repeating what it has seen). Gemma verifies:
    its sliding-window layers are the cropping that needs past recording (measured on the study's pair over
    1,120 views of a looping GSM8K answer: 5.7e-5 at most, the same argmax in all)."""
    from safe_engine.algorithm import alignment

    seen = []
    view = alignment.Verification.view

    def recording(self, offset, final):
        row, own, cut = view(self, offset, final)
        k = self.starts.index(offset) if offset in self.starts else len(self.ids)
        head = self.track.prompt_len + self.track.frozen_ids
        seen.append((list(self.track.ids[:head]) + list(self.ids[:k]), row.full().clone()))
        return row, own, cut

    monkeypatch.setattr(alignment.Verification, "view", recording)
    res = Ensemble([smol, gemma]).generate(STORY, max_new_tokens=64, schedule="rounds")
    assert res.stats.replaced_tokens >= 3 and res.stats.rounds >= 5 and len(seen) >= 10, res.stats
    worst, argmax_differs = 0.0, 0
    with torch.no_grad():
        for ids, values in seen[::2]:
            fresh = torch.log_softmax(gemma.model(torch.tensor([ids])).logits[0, -1].float(), -1)
            fresh = fresh[: values.shape[-1]]
            worst = max(worst, float((fresh - values.float()).abs().max()))
            argmax_differs += int(fresh.argmax()) != int(values.argmax())
    assert worst < 1e-3 and argmax_differs == 0


def test_token_healing_never_replaces_a_drafted_token_by_a_piece_of_it(smol):
    """Greedy: a pick that is a prefix of the drafted token heals back to that token (the drafter's argmax is
    its likeliest extension), so the only replacements left change the text beyond the drafter's token. On
    the study's pair and a GSM8K-like question the reference handover replaces Qwen's " by" by SmolLM2's " "."""
    ens = Ensemble([load_member("qwen2.5-coder-0.5b"), smol])
    question = "A train travels 60 km in 45 minutes. What is its speed in km/h? Think step by step."

    def pieces(**options) -> list:
        res = ens.generate(messages=[{"role": "user", "content": question}], max_new_tokens=96, trace=True, **options)
        return [p for p in res.trace if p.replaced and p.chosen and p.drafted.startswith(p.chosen)]

    assert pieces() == []
    assert pieces(token_healing=False)
