"""Malformed requests: each gets a 4xx in OpenAI's error shape, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import KEY, MAX_BODY, MODEL

AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Once upon", "max_tokens": 4, **fields}


def drop(body: dict, key: str) -> dict:
    return {k: v for k, v in body.items() if k != key}


# (id, method, path, body: dict | bytes | None, headers, status, param or None when not checked)
CASES = [
    # authentication, model, routes
    ("no key", "POST", CHAT, chat(), {}, 401, None),
    ("wrong key", "POST", CHAT, chat(), {"Authorization": "Bearer sk-wrong"}, 401, None),
    ("key prefix", "POST", CHAT, chat(), {"Authorization": f"Bearer {KEY[:-1]}"}, 401, None),
    ("basic scheme", "POST", CHAT, chat(), {"Authorization": f"Basic {KEY}"}, 401, None),
    ("bearer without a key", "POST", CHAT, chat(), {"Authorization": "Bearer"}, 401, None),
    ("no key on models", "GET", "/v1/models", None, {}, 401, None),
    ("unknown model", "POST", CHAT, chat(model="gpt-4o"), AUTH, 404, "model"),
    ("unknown model completions", "POST", COMPLETIONS, completion(model="davinci"), AUTH, 404, "model"),
    ("unknown model card", "GET", "/v1/models/nope", None, AUTH, 404, "model"),
    ("unknown route", "POST", "/v1/embeddings", {"input": "x"}, AUTH, 404, None),
    ("wrong method", "GET", CHAT, None, AUTH, 405, None),
    # the body itself
    ("broken JSON", "POST", CHAT, b'{"model": "tiny-safe", "messages": [', AUTH, 400, None),
    ("trailing garbage", "POST", CHAT, json.dumps(chat()).encode() + b"}", AUTH, 400, None),
    ("empty body", "POST", CHAT, b"", AUTH, 400, None),
    ("array body", "POST", CHAT, b"[1, 2]", AUTH, 400, None),
    ("string body", "POST", CHAT, b'"hello"', AUTH, 400, None),
    (
        "invalid UTF-8",
        "POST",
        CHAT,
        b'{"model": "tiny-safe", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        AUTH,
        400,
        None,
    ),
    ("NaN", "POST", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', AUTH, 400, None),
    ("deep nesting", "POST", CHAT, b"[" * 20000 + b"]" * 20000, AUTH, 400, None),
    (
        "oversized body",
        "POST",
        CHAT,
        json.dumps(chat(messages=[{"role": "user", "content": "x" * MAX_BODY}])).encode(),
        AUTH,
        413,
        None,
    ),
    (
        "oversized completion",
        "POST",
        COMPLETIONS,
        json.dumps(completion(prompt="y" * (MAX_BODY + 10))).encode(),
        AUTH,
        413,
        None,
    ),
    # messages
    ("no messages", "POST", CHAT, drop(chat(), "messages"), AUTH, 400, "messages"),
    ("empty messages", "POST", CHAT, chat(messages=[]), AUTH, 400, "messages"),
    ("messages a string", "POST", CHAT, chat(messages="hi"), AUTH, 400, "messages"),
    ("message a string", "POST", CHAT, chat(messages=["hi"]), AUTH, 400, "messages[0]"),
    ("unknown role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), AUTH, 400, "messages[0].role"),
    (
        "function role",
        "POST",
        CHAT,
        chat(messages=[{"role": "function", "content": "1", "name": "f"}]),
        AUTH,
        400,
        "messages[0].role",
    ),
    ("no role", "POST", CHAT, chat(messages=[{"content": "hi"}]), AUTH, 400, "messages[0].role"),
    ("content a number", "POST", CHAT, chat(messages=[{"role": "user", "content": 42}]), AUTH, 400, None),
    (
        "image part",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        AUTH,
        400,
        "messages[0].content[0]",
    ),
    (
        "user content null",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": None}]),
        AUTH,
        400,
        "messages[0].content",
    ),
    (
        "tool without id",
        "POST",
        CHAT,
        chat(messages=[*USER, {"role": "tool", "content": "1"}]),
        AUTH,
        400,
        "messages[1].tool_call_id",
    ),
    (
        "tool_calls on user",
        "POST",
        CHAT,
        chat(
            messages=[
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        ),
        AUTH,
        400,
        "messages[0].tool_calls",
    ),
    (
        "call without function",
        "POST",
        CHAT,
        chat(messages=[*USER, {"role": "assistant", "tool_calls": [{"id": "a", "type": "function"}]}]),
        AUTH,
        400,
        "messages[1].tool_calls[0].function",
    ),
    (
        "call arguments not JSON",
        "POST",
        CHAT,
        chat(
            messages=[
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                },
            ]
        ),
        AUTH,
        400,
        None,
    ),
    (
        "unknown message field",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": "x", "mood": "happy"}]),
        AUTH,
        400,
        "messages[0].mood",
    ),
    ("lone surrogate", "POST", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', AUTH, 400, None),
    ("prompt too long", "POST", CHAT, chat(messages=[{"role": "user", "content": "a " * 6000}]), AUTH, 400, None),
    (
        "one of two prompts too long",
        "POST",
        COMPLETIONS,
        completion(prompt=["Hi", "a " * 6000], n=2, stream=True),
        AUTH,
        400,
        None,
    ),
    # limits and sampling
    ("max_tokens a string", "POST", CHAT, chat(max_tokens="ten"), AUTH, 400, "max_tokens"),
    ("max_tokens zero", "POST", CHAT, chat(max_tokens=0), AUTH, 400, "max_tokens"),
    ("max_tokens negative", "POST", CHAT, chat(max_tokens=-5), AUTH, 400, "max_tokens"),
    ("max_tokens a bool", "POST", CHAT, chat(max_tokens=True), AUTH, 400, "max_tokens"),
    ("max_tokens a float", "POST", CHAT, chat(max_tokens=3.5), AUTH, 400, "max_tokens"),
    ("huge max_tokens", "POST", CHAT, chat(max_tokens=10**12), AUTH, 400, "max_tokens"),
    ("max_tokens over the context", "POST", CHAT, chat(max_tokens=5000), AUTH, 400, "max_tokens"),
    (
        "huge max_completion_tokens",
        "POST",
        CHAT,
        drop(chat(max_completion_tokens=10**9), "max_tokens"),
        AUTH,
        400,
        "max_completion_tokens",
    ),
    ("token limits disagree", "POST", CHAT, chat(max_completion_tokens=7), AUTH, 400, "max_tokens"),
    ("temperature a string", "POST", CHAT, chat(temperature="hot"), AUTH, 400, "temperature"),
    ("temperature too high", "POST", CHAT, chat(temperature=5), AUTH, 400, "temperature"),
    ("top_p zero", "POST", CHAT, chat(top_p=0), AUTH, 400, "top_p"),
    ("top_p above one", "POST", CHAT, chat(top_p=1.5), AUTH, 400, "top_p"),
    ("seed a string", "POST", CHAT, chat(seed="abc"), AUTH, 400, "seed"),
    ("stop a number", "POST", CHAT, chat(stop=123), AUTH, 400, "stop"),
    ("stop empty string", "POST", CHAT, chat(stop=[""]), AUTH, 400, "stop"),
    ("too many stops", "POST", CHAT, chat(stop=[str(i) for i in range(20)]), AUTH, 400, "stop"),
    ("stream a string", "POST", CHAT, chat(stream="yes"), AUTH, 400, "stream"),
    (
        "stream_options wrong type",
        "POST",
        CHAT,
        chat(stream=True, stream_options={"include_usage": "yes"}),
        AUTH,
        400,
        "stream_options.include_usage",
    ),
    # unsupported or unknown fields
    ("n = 0", "POST", CHAT, chat(n=0), AUTH, 400, "n"),
    ("n over the bound", "POST", CHAT, chat(n=65), AUTH, 400, "n"),
    ("n a string", "POST", CHAT, chat(n="2"), AUTH, 400, "n"),
    # logprobs, penalties, logit_bias: bad values named
    ("logprobs a number in chat", "POST", CHAT, chat(logprobs=3), AUTH, 400, "logprobs"),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=3), AUTH, 400, "top_logprobs"),
    ("top_logprobs above 20", "POST", CHAT, chat(logprobs=True, top_logprobs=21), AUTH, 400, "top_logprobs"),
    ("presence_penalty above 2", "POST", CHAT, chat(presence_penalty=2.5), AUTH, 400, "presence_penalty"),
    ("frequency_penalty a string", "POST", CHAT, chat(frequency_penalty="x"), AUTH, 400, "frequency_penalty"),
    ("repetition_penalty zero", "POST", CHAT, chat(repetition_penalty=0), AUTH, 400, "repetition_penalty"),
    ("logit_bias above 100", "POST", CHAT, chat(logit_bias={"42": 101}), AUTH, 400, "logit_bias"),
    ("logit_bias a word key", "POST", CHAT, chat(logit_bias={"the": 1}), AUTH, 400, "logit_bias"),
    ("completions logprobs a bool", "POST", COMPLETIONS, completion(logprobs=True), AUTH, 400, "logprobs"),
    ("completions logprobs above 20", "POST", COMPLETIONS, completion(logprobs=21), AUTH, 400, "logprobs"),
    ("response_format type", "POST", CHAT, chat(response_format={"type": "xml"}), AUTH, 400, "response_format"),
    (
        "json_schema without a schema",
        "POST",
        CHAT,
        chat(response_format={"type": "json_schema"}),
        AUTH,
        400,
        "response_format",
    ),
    (
        "json mode with tools",
        "POST",
        CHAT,
        chat(response_format={"type": "json_object"}, tools=[TOOL]),
        AUTH,
        400,
        "response_format",
    ),
    ("functions", "POST", CHAT, chat(functions=[{"name": "f", "parameters": {}}]), AUTH, 400, "functions"),
    ("unknown field", "POST", CHAT, chat(temprature=0.5), AUTH, 400, "temprature"),
    # tools
    ("tools not a list", "POST", CHAT, chat(tools=TOOL), AUTH, 400, "tools"),
    ("tool type", "POST", CHAT, chat(tools=[{**TOOL, "type": "retrieval"}]), AUTH, 400, "tools[0].type"),
    (
        "tool name",
        "POST",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "no spaces allowed"}}]),
        AUTH,
        400,
        "tools[0].function.name",
    ),
    (
        "tool_choice unknown tool",
        "POST",
        CHAT,
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "mul"}}),
        AUTH,
        400,
        "tool_choice",
    ),
    ("tool_choice without tools", "POST", CHAT, chat(tool_choice="required"), AUTH, 400, "tool_choice"),
    ("tool_choice word", "POST", CHAT, chat(tools=[TOOL], tool_choice="maybe"), AUTH, 400, "tool_choice"),
    # SAFE knobs
    ("unknown method", "POST", CHAT, chat(method="magic"), AUTH, 400, "method"),
    ("unknown aggregation", "POST", CHAT, chat(aggregation="average"), AUTH, 400, "aggregation"),
    ("draft_length zero", "POST", CHAT, chat(draft_length=0), AUTH, 400, "draft_length"),
    ("top_k a string", "POST", CHAT, chat(top_k="5"), AUTH, 400, "top_k"),
    ("unknown gate", "POST", CHAT, chat(gates=["teleport"]), AUTH, 400, "gates"),
    ("sharpen_threshold", "POST", CHAT, chat(sharpen_threshold=2), AUTH, 400, "sharpen_threshold"),
    ("gates with every_token", "POST", CHAT, chat(method="every_token", gates=["boundary"]), AUTH, 400, None),
    # completions
    ("no prompt", "POST", COMPLETIONS, drop(completion(), "prompt"), AUTH, 400, "prompt"),
    ("prompt a number", "POST", COMPLETIONS, completion(prompt=7), AUTH, 400, "prompt"),
    ("no prompts", "POST", COMPLETIONS, completion(prompt=[]), AUTH, 400, "prompt"),
    ("prompts x n over the bound", "POST", COMPLETIONS, completion(prompt=["a"] * 9, n=8), AUTH, 400, "n"),
    ("token id outside the vocabulary", "POST", COMPLETIONS, completion(prompt=[1, 10**9]), AUTH, 400, "prompt"),
    ("token ids mixed with text", "POST", COMPLETIONS, completion(prompt=[1, "a"]), AUTH, 400, "prompt"),
    ("negative token id", "POST", COMPLETIONS, completion(prompt=[[5], [-1]]), AUTH, 400, "prompt[1]"),
    ("suffix", "POST", COMPLETIONS, completion(suffix="end"), AUTH, 400, "suffix"),
    ("empty prompt", "POST", COMPLETIONS, completion(prompt=""), AUTH, 400, None),
    ("echo a string", "POST", COMPLETIONS, completion(echo="yes"), AUTH, 400, "echo"),
    ("best_of", "POST", COMPLETIONS, completion(best_of=3), AUTH, 400, "best_of"),
    ("model a number", "POST", COMPLETIONS, completion(model=3), AUTH, 400, "model"),
    ("completion messages", "POST", COMPLETIONS, completion(messages=USER), AUTH, 400, "messages"),
]


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url, timeout=60) as client:
        yield client


def send(http: httpx.Client, method: str, path: str, body, headers: dict) -> httpx.Response:
    if body is None:
        return http.request(method, path, headers=headers)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.request(method, path, content=content, headers={"Content-Type": "application/json", **headers})


def test_there_are_at_least_50_cases():
    assert len(CASES) >= 50
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_malformed_request_gets_an_openai_error(http, method, path, body, headers, status, param):
    res = send(http, method, path, body, headers)
    assert res.status_code == status, res.text
    error = res.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if status == 401:
        assert error["type"] == "authentication_error" and res.headers["www-authenticate"] == "Bearer"


def test_the_server_keeps_serving_after_the_bad_requests(http, served):
    """(Runs after the cases above.) A good request still gets the engine's answer; nothing is left running."""
    expected = served.ens.generate(messages=USER, max_new_tokens=4)
    res = send(http, "POST", CHAT, chat(), AUTH)
    assert res.status_code == 200 and res.json()["choices"][0]["message"]["content"] == expected.text
    assert served.wait_idle()["open_requests"] == 0
