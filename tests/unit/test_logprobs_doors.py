"""logprobs and penalties through the framework adapters: each gives the engine's entries, in the shape its
framework's OpenAI model gives (ChatOpenAI, langchain_openai's OpenAI LLM, LlamaIndex's LogProb lists)."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage

from langchain_safe import ChatSafe
from langchain_safe import SafeLLM as LangChainLLM
from llamaindex_safe import SafeLLM as LlamaIndexLLM
from safe_engine import ConfigError, Ensemble
from safe_engine.stats import chat_logprobs, completion_logprobs
from tests.conftest import tiny_member

PROMPT = "The the the the"
N = 10


def same(a, b) -> bool:
    """Equal, floats within 1e-5 (two forwards of one text differ in the last bits)."""
    if isinstance(a, float) or isinstance(b, float):
        return a == pytest.approx(b, abs=1e-5)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def ens() -> Ensemble:
    return Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("exaone-3.5", 2)])


def test_chatsafe_reports_logprobs_as_chatopenai_does_also_streaming(ens):
    chat = ChatSafe(ensemble=ens, max_tokens=N, logprobs=True, top_logprobs=3, repetition_penalty=1.2)
    expected = ens.generate(messages=[{"role": "user", "content": PROMPT}], max_new_tokens=N, logprobs=3,
                            repetition_penalty=1.2)  # fmt: skip
    message = chat.invoke([HumanMessage(PROMPT)])
    assert message.content == expected.content
    assert same(message.response_metadata["logprobs"], chat_logprobs(expected.logprobs))
    first = message.response_metadata["logprobs"]["content"][0]
    assert set(first) == {"token", "bytes", "logprob", "top_logprobs", "source"} and len(first["top_logprobs"]) == 3
    merged = None
    for chunk in chat.stream([HumanMessage(PROMPT)]):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and same(merged.response_metadata["logprobs"], chat_logprobs(expected.logprobs))
    assert "logprobs" not in ChatSafe(ensemble=ens, max_tokens=N).invoke([HumanMessage(PROMPT)]).response_metadata
    # per call, as ChatOpenAI binds them
    bound = ChatSafe(ensemble=ens, max_tokens=N).bind(logprobs=True, top_logprobs=1).invoke([HumanMessage(PROMPT)])
    assert all(len(e["top_logprobs"]) == 1 for e in bound.response_metadata["logprobs"]["content"])


def test_langchain_llm_reports_openais_completion_logprobs_also_streaming(ens):
    llm = LangChainLLM(ensemble=ens, max_tokens=N, logprobs=2, frequency_penalty=0.5)
    expected = ens.generate(PROMPT, max_new_tokens=N, logprobs=2, frequency_penalty=0.5)
    info = llm.generate([PROMPT]).generations[0][0].generation_info
    assert info is not None and same(info["logprobs"], completion_logprobs(expected.logprobs))
    assert info["logprobs"]["text_offset"][0] == 0 and len(info["logprobs"]["tokens"]) == len(expected.logprobs)
    merged = None
    for chunk in llm._stream(PROMPT):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None and merged.text == expected.text
    assert same(merged.generation_info["logprobs"], completion_logprobs(expected.logprobs))


def test_llamaindex_responses_carry_logprob_lists(ens):
    llm = LlamaIndexLLM(ensemble=ens, max_new_tokens=N, logprobs=True, top_logprobs=2, presence_penalty=0.4)
    expected = ens.generate(PROMPT, max_new_tokens=N, logprobs=2, presence_penalty=0.4)
    response = llm.complete(PROMPT, formatted=True)
    assert response.text == expected.text
    assert same(
        [[(p.token, p.logprob) for p in alts] for alts in response.logprobs],
        [[(t.token, t.logprob) for t in e.top_logprobs] for e in expected.logprobs],
    )
    streamed = [p for r in llm.stream_complete(PROMPT, formatted=True) for p in (r.logprobs or [])]
    assert streamed == response.logprobs
    zero = LlamaIndexLLM(ensemble=ens, max_new_tokens=N, logprobs=0, presence_penalty=0.4)
    zero = zero.complete(PROMPT, formatted=True)
    assert same(
        [[(p.token, p.logprob) for p in alts] for alts in zero.logprobs],
        [[(e.token, e.logprob)] for e in expected.logprobs],
    )


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ({"frequency_penalty": 9}, "frequency_penalty"),
    ],
)
def test_adapters_refuse_bad_values_by_name(ens, options, name):
    with pytest.raises(ConfigError, match=name):
        ChatSafe(ensemble=ens, **options)
    with pytest.raises(ConfigError, match=name):
        LlamaIndexLLM(ensemble=ens, **options).complete(PROMPT)
