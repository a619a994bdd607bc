"""The engine on the real demo models: SmolLM2-135M (byte-level BPE, 49k) and gemma-3-270m
(SentencePiece, 262k), plus Qwen2.5-Coder-0.5B for chat. Fetched and converted once into the cache."""

from __future__ import annotations

import pytest

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
