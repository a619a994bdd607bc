"""The official openai SDK against the real server: every response equals the in-process result."""

from __future__ import annotations

import json

import pytest
from openai import AsyncOpenAI, BadRequestError, NotFoundError, OpenAI

from safe_engine.shaping.tools import parse_tool_calls
from tests.conftest import function_tool
from tests.scripted import pieces, script

from .conftest import DEFAULT_TOKENS, KEY, MODEL

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]
MULTIPLY = function_tool()
ADD = function_tool("add", "Add two integers.")


@pytest.fixture(scope="module")
def client(served) -> OpenAI:
    return OpenAI(base_url=served.v1, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def aclient(served) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=served.v1, api_key=KEY, max_retries=0, timeout=60)


def drafter(ens) -> str:
    return ens.names[ens.drafter_index]


def test_models_lists_the_served_model(client, served):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.owned_by == "safe-engine"
    assert card.model_extra["safe"]["members"] == served.ens.names
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_equals_the_engine(client, served):
    expected = served.ens.generate(messages=CHAT, max_new_tokens=10)
    res = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10)
    choice = res.choices[0]
    assert choice.message.content == expected.text and expected.text
    assert choice.message.role == "assistant" and choice.message.tool_calls is None
    assert choice.finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[expected.finish_reason]
    assert res.object == "chat.completion" and res.model == MODEL and res.id.startswith("chatcmpl-")
    assert res.usage.completion_tokens == expected.stats.tokens
    assert res.usage.prompt_tokens == expected.stats.prompt_tokens[drafter(served.ens)]
    assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens
    safe = res.model_extra["safe"]
    for field in ("tokens", "ensembled_tokens", "method"):
        assert safe[field] == getattr(expected.stats, field), field
    assert safe["ensemble_rate"] == pytest.approx(expected.stats.ensemble_rate)
    # rounds and forward passes depend on the schedule, which schedule="auto" picks per round from timings
    # (overlap drafts one token a round): the same text either way, their counts not
    assert safe["rounds"] >= 1 and set(safe["forward_passes"]) == set(expected.stats.forward_passes)


def test_server_defaults_apply_when_the_request_has_none(client, served):
    expected = served.ens.generate(messages=CHAT, max_new_tokens=DEFAULT_TOKENS)
    res = client.chat.completions.create(model=MODEL, messages=CHAT)
    assert res.choices[0].message.content == expected.text
    assert res.usage.completion_tokens == expected.stats.tokens


def test_max_completion_tokens_stop_and_sampling_with_a_seed(client, served):
    opts = {"max_new_tokens": 14, "do_sample": True, "temperature": 0.7, "top_p": 0.9, "seed": 1234, "stop": ("e",)}
    expected = served.ens.generate(messages=CHAT, **opts)
    res = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=14, temperature=0.7, top_p=0.9, seed=1234, stop="e"
    )
    assert res.choices[0].message.content == expected.text
    assert res.model_extra["safe"]["finish_reason"] == expected.finish_reason


async def test_async_chat_with_safe_knobs(aclient, served):
    knobs = {"method": "every_token", "aggregation": "gac", "top_k": 4, "sharpening": None}
    expected = served.ens.generate(messages=CHAT, max_new_tokens=8, **knobs)
    res = await aclient.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, extra_body=knobs)
    assert res.choices[0].message.content == expected.text
    assert res.model_extra["safe"]["method"] == "every_token"
    assert res.model_extra["safe"]["gates"] == list(expected.stats.gates)


def test_streaming_chat_equals_the_engine(client, served):
    expected = served.ens.generate(messages=CHAT, max_new_tokens=12)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=12, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["safe"]["tokens"] == expected.stats.tokens
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == expected.stats.tokens
    assert usage_chunk.model_extra["safe"]["ensembled_tokens"] == expected.stats.ensembled_tokens
    assert len({c.id for c in chunks}) == 1


async def test_async_streaming_without_usage(aclient, served):
    expected = served.ens.generate(messages=CHAT, max_new_tokens=9)
    stream = await aclient.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=9, stream=True)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert all(c.usage is None for c in chunks)
    assert "safe" in chunks[-1].model_extra and chunks[-1].choices[0].finish_reason


def test_completions_sync_and_streaming(client, served):
    prompt = "Once upon a time"
    expected = served.ens.generate(prompt, max_new_tokens=10, method="every_token")
    res = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, extra_body={"method": "every_token"})
    assert res.choices[0].text == expected.text and res.object == "text_completion"
    assert res.model_extra["safe"]["tokens"] == expected.stats.tokens
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=[prompt],
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"method": "every_token"},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == expected.stats.tokens


def test_unsupported_fields_are_named(client):
    for kwargs, param in [
        ({"n": 100}, "n"),
        ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"extra_body": {"sharpenning": "heuristic"}}, "sharpenning"),
    ]:
        with pytest.raises(BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=CHAT, **kwargs)
        assert err.value.body["param"] == param


# -- tools ------------------------------------------------------------------------------------------------------
def test_tools_and_a_tool_round_trip_equal_the_engine(client, served):
    """Unscripted: the conversation (assistant tool call + tool result) reaches every member's template
    exactly as the in-process call gives it."""
    messages = [
        {"role": "user", "content": "What is 6 times 7?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "abc123def", "type": "function", "function": {"name": "multiply", "arguments": '{"a":6,"b":7}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "abc123def", "content": "42"},
    ]
    expected = served.ens.generate(messages=messages, tools=[MULTIPLY], max_new_tokens=10)
    res = client.chat.completions.create(model=MODEL, messages=messages, tools=[MULTIPLY], max_tokens=10)
    reply = parse_tool_calls(expected.text, [MULTIPLY])
    assert (res.choices[0].message.content or "") == reply.content
    assert len(res.choices[0].message.tool_calls or []) == len(reply.tool_calls)


CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n</tool_call>'


def test_a_tool_call_reply(client, served, monkeypatch):
    calls = script(monkeypatch, served.ens, pieces(CALL))
    res = client.chat.completions.create(model=MODEL, messages=CHAT, tools=[MULTIPLY, ADD])
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "multiply"
    assert json.loads(call.function.arguments) == {"a": 6, "b": 7}
    assert call.id.startswith("call_")
    assert calls[0].tools == (MULTIPLY, ADD)


def test_a_streamed_tool_call_is_never_streamed_as_text(client, served, monkeypatch):
    script(monkeypatch, served.ens, pieces("Sure. " + CALL + CALL.replace('"a": 6', '"a": 1'), 3))
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, tools=[MULTIPLY], stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == "Sure. "
    deltas = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == [0, 1]
    assert [json.loads(d.function.arguments) for d in deltas] == [{"a": 6, "b": 7}, {"a": 1, "b": 7}]
    assert all(d.id and d.function.name == "multiply" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_stream_helper_accumulates_tool_calls(client, served, monkeypatch):
    script(monkeypatch, served.ens, pieces(CALL, 4))
    with client.chat.completions.stream(model=MODEL, messages=CHAT, tools=[MULTIPLY]) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "multiply" and json.loads(call.function.arguments) == {"a": 6, "b": 7}


def test_tool_choice_none_never_returns_tool_calls(client, served, monkeypatch):
    calls = script(monkeypatch, served.ens, pieces(CALL))
    res = client.chat.completions.create(model=MODEL, messages=CHAT, tools=[MULTIPLY], tool_choice="none")
    assert res.choices[0].message.tool_calls is None and res.choices[0].finish_reason == "stop"
    assert res.choices[0].message.content == CALL
    assert calls[0].tools is None  # the templates never saw the tools


def test_a_named_tool_choice_reads_bare_arguments(client, served, monkeypatch):
    calls = script(monkeypatch, served.ens, pieces('{"a": 2, "b": 3}'))
    res = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        tools=[MULTIPLY, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    (call,) = res.choices[0].message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    system = calls[0].messages[0]
    assert system["role"] == "system" and '"add"' in system["content"] and "You are terse." in system["content"]


def test_parallel_tool_calls_false_keeps_the_first_call(client, served, monkeypatch):
    script(monkeypatch, served.ens, pieces(CALL + CALL.replace("multiply", "add")))
    res = client.chat.completions.create(
        model=MODEL, messages=CHAT, tools=[MULTIPLY, ADD], tool_choice="required", parallel_tool_calls=False
    )
    assert [c.function.name for c in res.choices[0].message.tool_calls] == ["multiply"]


def test_an_unparsable_call_is_reported_in_safe(client, served, monkeypatch):
    script(monkeypatch, served.ens, pieces('<tool_call>{"name": "multiply", "arguments": {a: 2}}</tool_call>'))
    res = client.chat.completions.create(model=MODEL, messages=CHAT, tools=[MULTIPLY])
    assert res.choices[0].message.tool_calls is None and res.choices[0].finish_reason == "stop"
    (bad,) = res.model_extra["safe"]["invalid_tool_calls"]
    assert bad["name"] == "multiply" and "JSON" in bad["error"]


# -- structured output ---------------------------------------------------------------------------------------------
def test_parse_with_a_pydantic_model_returns_a_parsed_object(client, served):
    """Unscripted: `chat.completions.parse(response_format=Model)` sends a strict json_schema; the engine's grammar
    holds even random-weight models to it, so the reply parses (the schema is bounded so that they finish)."""
    from openai.lib._parsing._completions import type_to_response_format_param
    from pydantic import BaseModel, Field

    class Score(BaseModel):
        label: str = Field(max_length=6)
        value: int = Field(ge=0, le=99)

    for stream in (False, True):
        if stream:
            with client.chat.completions.stream(model=MODEL, messages=CHAT, response_format=Score, max_tokens=64) as s:
                for _ in s:
                    pass
                res = s.get_final_completion()
        else:
            res = client.chat.completions.parse(model=MODEL, messages=CHAT, response_format=Score, max_tokens=64)
        score = res.choices[0].message.parsed
        assert isinstance(score, Score) and 0 <= score.value <= 99 and len(score.label) <= 6
        sent = type_to_response_format_param(Score)  # the strict json_schema the SDK sends
        expected = served.ens.generate(messages=CHAT, response_format=sent, max_tokens=64)
        assert res.choices[0].message.content == expected.content


def test_response_format_is_strict_unless_it_says_strict_false(client, served, monkeypatch):
    """Chat Completions and Responses: a json_schema without `additionalProperties` takes only its keys
    (OpenAI's strict mode), also when `strict` is left out; `"strict": false` keeps JSON Schema's meaning."""
    schema = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 6}}, "required": ["label"]}
    for flag, extra_keys in [(None, False), (True, False), (False, True)]:
        spec = {"name": "score", "schema": schema} | ({} if flag is None else {"strict": flag})
        calls = script(monkeypatch, served.ens, pieces('{"label": "ok"}'))
        fmt = {"type": "json_schema", "json_schema": spec}
        client.chat.completions.create(model=MODEL, messages=CHAT, response_format=fmt, max_tokens=16)
        client.responses.create(model=MODEL, input="Score it.", text={"format": {"type": "json_schema", **spec}})
        assert [call.json_schema.get("additionalProperties", True) for call in calls] == [extra_keys] * 2, flag


def test_json_mode_streams_a_json_object(client, served):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, response_format={"type": "json_object"}, max_tokens=12, stream=True
        )
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content.lstrip().startswith("{")
    expected = served.ens.generate(messages=CHAT, response_format={"type": "json_object"}, max_tokens=12)
    assert content == expected.content
