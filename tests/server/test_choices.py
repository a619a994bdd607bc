"""n choices and several prompts per request, echo and token-id prompts, through the openai SDK: every choice
equals the engine's own result for its request (seed + i when sampling), in OpenAI's index order."""

from __future__ import annotations

import pytest
from openai import OpenAI

from .conftest import KEY, MODEL

CHAT = [{"role": "user", "content": "Name three rivers."}]
PROMPTS = ["Once upon a time", "The capital of France is"]
TOKENS = 8


@pytest.fixture(scope="module")
def client(served) -> OpenAI:
    return OpenAI(base_url=served.v1, api_key=KEY, max_retries=0, timeout=60)


def drafter(ens) -> str:
    return ens.names[ens.drafter_index]


def test_greedy_n_gives_identical_choices_and_sums_usage(client, served):
    expected = served.ens.generate(messages=CHAT, max_new_tokens=TOKENS)
    res = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=TOKENS, n=3)
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert [c.message.content for c in res.choices] == [expected.text] * 3
    # OpenAI's (and vLLM's) usage: the prompt once, every choice's completion tokens
    assert res.usage.prompt_tokens == expected.stats.prompt_tokens[drafter(served.ens)]
    assert res.usage.completion_tokens == 3 * expected.stats.tokens
    assert [c.model_extra["safe"]["tokens"] for c in res.choices] == [expected.stats.tokens] * 3


def test_sampled_n_uses_seed_plus_i(client, served):
    expected = [
        served.ens.generate(messages=CHAT, max_new_tokens=TOKENS, temperature=0.9, seed=7 + i).text for i in range(3)
    ]
    res = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=TOKENS, n=3, temperature=0.9, seed=7)
    assert [c.message.content for c in res.choices] == expected
    assert len(set(expected)) > 1  # different seeds: different samples


def test_streamed_n_interleaves_choices_by_index(client, served):
    tokens = 3 * TOKENS  # long enough that the choices share many rounds of the batch
    expected = [
        served.ens.generate(messages=CHAT, max_new_tokens=tokens, temperature=0.9, seed=3 + i) for i in range(3)
    ]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=tokens,
        n=3,
        temperature=0.9,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finishes, order = ["", "", ""], [None, None, None], []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                texts[choice.index] += choice.delta.content
                order.append(choice.index)
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == [e.text for e in expected]
    assert all(finishes)
    assert order != sorted(order)  # decoded together: the choices' deltas interleave
    assert usage.completion_tokens == sum(e.stats.tokens for e in expected)
    assert usage.prompt_tokens == expected[0].stats.prompt_tokens[drafter(served.ens)]
    served.wait_idle()


def test_prompt_list_with_n_is_prompt_major(client, served):
    expected = [served.ens.generate(p, max_new_tokens=TOKENS) for p in PROMPTS]
    res = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=TOKENS, n=2)
    assert [c.index for c in res.choices] == [0, 1, 2, 3]
    assert [c.text for c in res.choices] == [e.text for e in expected for _ in range(2)]
    name = drafter(served.ens)
    assert res.usage.prompt_tokens == sum(e.stats.prompt_tokens[name] for e in expected)
    assert res.usage.completion_tokens == 2 * sum(e.stats.tokens for e in expected)


def test_prompt_list_streamed(client, served):
    expected = [served.ens.generate(p, max_new_tokens=TOKENS) for p in PROMPTS]
    texts = ["", ""]
    finishes = [None, None]
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=TOKENS, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [e.text for e in expected] and all(finishes)


def test_echo_prepends_the_prompt(client, served):
    expected = served.ens.generate(PROMPTS[0], max_new_tokens=TOKENS)
    res = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=TOKENS, echo=True)
    assert res.choices[0].text == PROMPTS[0] + expected.text
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=TOKENS, echo=True, stream=True)
        if c.choices
    )
    assert streamed == PROMPTS[0] + expected.text


def test_token_id_prompts_are_the_drafters(client, served):
    tokenizer = served.ens.drafter.tokenizer
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    expected = [served.ens.generate(p, max_new_tokens=TOKENS).text for p in PROMPTS]
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=TOKENS, echo=True)
    assert one.choices[0].text == PROMPTS[0] + expected[0]
    several = client.completions.create(model=MODEL, prompt=ids, max_tokens=TOKENS)
    assert [c.text for c in several.choices] == expected
    served.wait_idle()
