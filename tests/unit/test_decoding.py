"""The draft → verify loop on tiny random models over real tokenizers."""

from __future__ import annotations

import asyncio

import pytest
import torch

from safe_engine import ChatTemplateError, Ensemble, GenerationConfig, Member
from tests.conftest import tiny_member, tiny_model, tokenizer

PROMPT = "The quick brown fox"


def hf_greedy(member: Member, prompt: str, n: int) -> str:
    """The model's own greedy continuation via transformers' generate, as the text it appends.

    (tokenizer.decode would drop SentencePiece's leading space of the first token.)
    """
    enc = member.tokenizer(prompt, return_tensors="pt")
    out = member.model.generate(**enc, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = out[0, enc.input_ids.shape[1] :].tolist()
    return b"".join(member.token_bytes[i] or b"" for i in ids).decode(errors="replace")


@pytest.mark.parametrize("family", ["gpt2", "llama2", "qwen2.5-7b-instruct"])
@pytest.mark.parametrize("aggregation", ["unite", "gac"])
@pytest.mark.parametrize("schedule", ["rounds", "overlap"])
def test_two_copies_reproduce_the_model_with_nothing_ensembled(family, aggregation, schedule):
    a, b = tiny_member(family, 7), tiny_member(family, 7)
    ens = Ensemble([a, b])
    expected = hf_greedy(a, PROMPT, 30)
    safe = ens.generate(PROMPT, max_new_tokens=30, aggregation=aggregation, schedule=schedule)
    assert safe.text == expected
    assert safe.stats.ensembled_tokens == 0 and safe.stats.ensemble_rate == 0.0
    assert safe.stats.tokens == 30 and safe.finish_reason == "length"
    verified = safe.stats.forward_passes[ens.names[1]]
    if schedule == "rounds" and aggregation == "unite":
        assert verified == safe.stats.rounds  # one verification pass a round
    assert verified <= safe.stats.rounds  # GaC skips verifying where the drafter is sure
    assert safe.stats.replaced_tokens == safe.stats.discarded_draft_tokens == 0
    assert safe.stats.forward_passes[ens.names[0]] == 30  # no drafted token was thrown away


@pytest.mark.parametrize("family", ["gpt2", "llama2"])
def test_single_equals_the_drafters_own_generate(family):
    ens = Ensemble([tiny_member(family, 3), tiny_member("gpt2", 4)])
    res = ens.generate(PROMPT, max_new_tokens=25, method="single")
    assert res.text == hf_greedy(ens.drafter, PROMPT, 25)
    assert res.stats.ensembled_tokens == 0
    assert list(res.stats.forward_passes) == [ens.names[0]]  # verifiers never run


def test_every_token_ensembles_at_every_aligned_position():
    a, b = tiny_member("gpt2", 5), tiny_member("gpt2", 5)
    res = Ensemble([a, b]).generate(PROMPT, max_new_tokens=20, method="every_token", sharpening=None)
    assert res.stats.ensembled_tokens == res.stats.tokens == res.stats.rounds == 20
    assert res.text == hf_greedy(a, PROMPT, 20)  # averaging identical distributions changes nothing


def test_every_token_ensembles_more_than_safe_across_families(members3):
    ens = Ensemble(members3)
    every = ens.generate(PROMPT, max_new_tokens=40, method="every_token")
    safe = ens.generate(PROMPT, max_new_tokens=40, method="safe", schedule="rounds")
    assert 0 < every.stats.ensembled_tokens <= every.stats.tokens
    assert every.stats.rounds >= every.stats.tokens - every.stats.ensembled_tokens  # one drafted token a round
    assert safe.stats.rounds < every.stats.rounds


@pytest.mark.parametrize("aggregation", ["unite", "gac"])
def test_three_families_long_unicode_run_stream_equals_generate(members3, aggregation):
    ens = Ensemble(members3, drafter=1)
    prompt = "Café 👩‍👩‍👧 世界 — naïve résumé:"
    res = ens.generate(prompt, max_new_tokens=200, aggregation=aggregation)
    assert res.stats.tokens == 200 and res.finish_reason == "length"
    assert 0 < res.stats.ensembled_tokens < res.stats.tokens
    assert 0 < res.stats.ensemble_rate < 1
    stream = ens.stream(prompt, max_new_tokens=200, aggregation=aggregation)
    deltas = list(stream)
    assert "".join(deltas) == res.text == stream.result.text
    assert len(deltas) > 10


def test_stop_string_spanning_tokens_cuts_the_text(members3):
    ens = Ensemble(members3)
    full = ens.generate(PROMPT, max_new_tokens=60).text
    stop = full[20:27]  # most likely spans several tokens of the drafter
    assert len(stop) == 7
    res = ens.generate(PROMPT, max_new_tokens=60, stop=[stop, "never-appears"])
    assert res.finish_reason == "stop"
    assert res.text == full[: full.index(stop)]
    assert "".join(ens.stream(PROMPT, max_new_tokens=60, stop=[stop])) == res.text


def test_stop_string_longer_than_output_is_harmless(members3):
    res = Ensemble(members3).generate(PROMPT, max_new_tokens=5, stop=["x" * 500])
    assert res.finish_reason == "length" and res.stats.tokens == 5


def test_sampling_is_reproducible_with_a_seed(members3):
    ens = Ensemble(members3)
    cfg = GenerationConfig(do_sample=True, temperature=0.8, top_p=0.9, seed=11, max_new_tokens=40)
    first, second = ens.generate(PROMPT, config=cfg), ens.generate(PROMPT, config=cfg)
    assert first.text == second.text
    assert "".join(ens.stream(PROMPT, config=cfg)) == first.text
    other = ens.generate(PROMPT, config=cfg.updated(seed=12))
    assert other.text != first.text


def test_eos_of_the_drafter_ends_generation():
    tok = tokenizer("gpt2")
    model = tiny_model(len(tok), 21, tok.eos_token_id)
    eager = type(model)(model.config).eval()
    eager.load_state_dict(model.state_dict())
    with torch.no_grad():
        eager.lm_head.weight[tok.eos_token_id] *= 0
        eager.lm_head.weight[tok.eos_token_id] += eager.lm_head.weight.abs().max() * 50  # EOS dominates
    ens = Ensemble([Member(eager, tok, name="eager"), tiny_member("llama2", 2)])
    res = ens.generate(PROMPT, max_new_tokens=30)
    assert res.finish_reason == "eos"
    assert res.stats.tokens <= 30


def test_chat_messages_use_each_members_own_template():
    ens = Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("mistral-7b-instruct-v0.3", 2)])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say <|im_end|> 世界"}]
    res = ens.generate(messages=messages, max_new_tokens=30)
    assert res.stats.tokens == 30
    qwen = ens.members[0]
    from safe_engine.shaping.chat import chat_prompt_ids

    ids = chat_prompt_ids(qwen, messages)
    eos = qwen.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(eos) == 2  # the template's two turn ends, not the user's text
    assert "".join(ens.stream(messages=messages, max_new_tokens=30)) == res.text


def test_chat_without_template_is_a_clear_error_unless_overridden():
    ens = Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("gpt2", 2)])
    with pytest.raises(ChatTemplateError, match=r"gpt2-2.*no chat template"):
        ens.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=3)
    assert ens.generate("plain text works", max_new_tokens=3).stats.tokens == 3
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    fixed = Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("gpt2", 2, chat_template=template)])
    assert fixed.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=3).stats.tokens == 3


def test_tools_reach_templates_and_are_described_to_members_without_tool_support():
    from safe_engine.shaping.chat import chat_prompt_ids

    tool = {"type": "function", "function": {"name": "multiply", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "2*3?"}]
    qwen = tiny_member("qwen2.5-7b-instruct", 1)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    plain = tiny_member("gpt2", 2, chat_template=template)
    for member in (qwen, plain):
        text = member.tokenizer.decode(chat_prompt_ids(member, messages, tools=[tool]))
        assert "multiply" in text and "<tool_call>" in text


def test_weights_and_stats_invariants(members3):
    ens = Ensemble(members3, weights=[3, 1, 1])
    res = ens.generate(PROMPT, max_new_tokens=30)
    s = res.stats
    assert 0 <= s.ensembled_tokens <= s.tokens
    assert s.wall_time_s > 0 and s.tokens_per_s == pytest.approx(s.tokens / s.wall_time_s)
    assert set(s.forward_passes) == set(ens.names)
    assert all(v > 0 for v in s.prompt_tokens.values())


def test_discarded_draft_tokens_account_for_the_drafters_extra_passes(members3):
    """Drafter passes = kept drafted tokens + replaced ones + those thrown away after a replacement."""
    ens = Ensemble(members3)
    s = ens.generate(PROMPT, max_new_tokens=60, draft_length=5).stats
    assert 0 < s.replaced_tokens <= s.ensembled_tokens
    assert 0 < s.discarded_draft_tokens <= 4 * s.replaced_tokens  # at most draft_length - 1 per replacement
    passes = s.forward_passes[ens.names[0]]
    # each replacement adds >= 1 token of its own (more when the drafter spells the string in several)
    assert passes - s.discarded_draft_tokens <= s.tokens
    every = ens.generate(PROMPT, max_new_tokens=30, method="every_token").stats
    assert every.discarded_draft_tokens == 0  # one-token drafts leave nothing to throw away


def test_one_member_decodes_as_single_and_says_so():
    res = Ensemble([tiny_member("gpt2", 3)]).generate(PROMPT, max_new_tokens=5)
    assert res.stats.method == "single" and "one member" in res.stats.note


async def test_async_generation_does_not_block_the_event_loop(members3):
    ens = Ensemble(members3)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.005)

    task = asyncio.create_task(ticker())
    deltas = [d async for d in ens.astream(PROMPT, max_new_tokens=40)]
    result = await ens.agenerate(PROMPT, max_new_tokens=40)
    task.cancel()
    assert "".join(deltas) == result.text == ens.generate(PROMPT, max_new_tokens=40).text
    assert ticks > 5
