"""The Responses API (`POST /v1/responses`) through the openai SDK and LangChain's ChatOpenAI: replies equal
the engine's for the same request, and every body and event validates as the SDK's own types."""

from __future__ import annotations

import json

import httpx
import pytest
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import BadRequestError, OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from tests.conftest import function_tool
from tests.scripted import pieces, script

from .conftest import KEY, MODEL

SYSTEM = "You are terse."
QUESTION = "Name a prime number."
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
N = 10
AUTH = {"Authorization": f"Bearer {KEY}"}
MULTIPLY = {"type": "function", **function_tool()["function"]}  # the Responses API's flat tool
CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def client(served) -> OpenAI:
    return OpenAI(base_url=served.v1, api_key=KEY, max_retries=0, timeout=60)


def drafter(ens) -> str:
    return ens.names[ens.drafter_index]


def post(served, body: dict) -> httpx.Response:
    return httpx.post(f"{served.v1}/responses", json={"model": MODEL, **body}, headers=AUTH, timeout=60)


def sse_events(served, body: dict) -> list:
    """The raw stream, each event validated as the SDK's ResponseStreamEvent (its `event:` name = its type)."""
    events = []
    with httpx.stream(
        "POST", f"{served.v1}/responses", json={"model": MODEL, "stream": True, **body}, headers=AUTH
    ) as r:
        assert r.status_code == 200
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                event = EVENTS.validate_python(json.loads(line.removeprefix("data: ")))
                assert event.type == name
                events.append(event)
    return events


def test_create_equals_the_engine_and_validates(client, served):
    expected = served.ens.generate(messages=CHAT, max_new_tokens=N)
    res = client.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=N)
    assert res.output_text == expected.text and expected.text
    assert res.usage.output_tokens == expected.stats.tokens
    assert res.usage.input_tokens == expected.stats.prompt_tokens[drafter(served.ens)]
    assert res.status == ("incomplete" if expected.finish_reason == "length" else "completed")
    if res.status == "incomplete":
        assert res.incomplete_details.reason == "max_output_tokens"
    raw = post(served, {"instructions": SYSTEM, "input": QUESTION, "max_output_tokens": N}).json()
    checked = Response.model_validate(raw)  # strict: every required field present, every type right
    assert checked.output[0].type == "message" and checked.output[0].content[0].text == expected.text
    assert raw["safe"]["tokens"] == expected.stats.tokens


def test_message_items_sampling_and_safe_knobs(client, served):
    knobs = {"method": "every_token", "seed": 11}
    expected = served.ens.generate(messages=CHAT, max_new_tokens=N, temperature=0.8, top_p=0.9, **knobs)
    res = client.responses.create(
        model=MODEL,
        input=[
            {"role": "developer", "content": SYSTEM},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        ],
        max_output_tokens=N,
        temperature=0.8,
        top_p=0.9,
        extra_body=knobs,
    )
    assert res.output_text == expected.text
    assert res.model_extra["safe"]["method"] == "every_token"


def test_stream_sends_the_standard_events(served):
    expected = served.ens.generate(messages=CHAT, max_new_tokens=N)
    events = sse_events(served, {"instructions": SYSTEM, "input": QUESTION, "max_output_tokens": N})
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == expected.text and deltas
    final = events[-1].response
    assert final.output_text == expected.text and final.usage.output_tokens == expected.stats.tokens
    served.wait_idle()


def test_stream_helper(client, served):
    expected = served.ens.generate(messages=CHAT, max_new_tokens=N)
    with client.responses.stream(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=N) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == expected.text


def test_function_tools_and_a_round_trip(client, served, monkeypatch):
    calls = script(monkeypatch, served.ens, pieces(CALL))
    res = client.responses.create(model=MODEL, input="What is 6 times 7?", tools=[MULTIPLY], tool_choice="required")
    (call,) = res.output
    assert call.type == "function_call" and call.name == "multiply" and json.loads(call.arguments) == {"a": 6, "b": 7}
    assert calls[0].tool_choice == "required" and calls[0].tools[0]["function"]["name"] == "multiply"
    # the next turn: the call and its output go back as items, read as an assistant call and a tool message
    script(monkeypatch, served.ens, pieces("It is 42."))
    follow = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is 6 times 7?"},
            {"type": "function_call", "call_id": call.call_id, "name": "multiply", "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "42"},
        ],
        tools=[MULTIPLY],
    )
    assert follow.output_text == "It is 42."
    calls = script(monkeypatch, served.ens, pieces("It is 42."))
    client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is 6 times 7?"},
            {"type": "function_call", "call_id": "c1", "name": "multiply", "arguments": '{"a": 6, "b": 7}'},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
        ],
        tools=[MULTIPLY],
        tool_choice={"type": "function", "name": "multiply"},
    )
    assistant, answer = calls[0].messages[-2:]
    assert assistant["role"] == "assistant" and assistant["tool_calls"][0]["id"] == "c1"
    assert answer == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    assert calls[0].tool_choice == "multiply"


def test_streamed_function_call_events(served, monkeypatch):
    script(monkeypatch, served.ens, pieces(CALL))
    events = sse_events(served, {"input": "What is 6 times 7?", "tools": [MULTIPLY]})
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds  # a call is never shown as text
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.name == "multiply" and json.loads(done.arguments) == {"a": 6, "b": 7}
    delta = next(e for e in events if e.type == "response.function_call_arguments.delta")
    assert delta.delta == done.arguments and delta.item_id == done.item_id
    (item,) = events[-1].response.output
    assert item.type == "function_call" and item.call_id.startswith("call")


class Score(BaseModel):
    """Bounded, so that even a random-weight model closes the object within the token budget."""

    label: str = Field(max_length=6)


def test_text_format_json_schema_is_constrained(client):
    res = client.responses.parse(model=MODEL, input="Label this: great!", text_format=Score, max_output_tokens=40)
    assert isinstance(res.output_parsed, Score)


def test_text_format_json_object(client, served, monkeypatch):
    calls = script(monkeypatch, served.ens, pieces('{"a": 1}'))
    res = client.responses.create(
        model=MODEL, input="Reply in JSON.", text={"format": {"type": "json_object"}}, max_output_tokens=20
    )
    assert json.loads(res.output_text) == {"a": 1} and calls[0].response_format == "json_object"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call_output", "output": "42"}]}, "input[0].call_id"),
        ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 10**7}, "max_output_tokens"),
        ({"sharpenning": "x"}, "sharpenning"),
        ({"input": None}, "input"),
    ],
)
def test_refusals_name_the_field(served, body, param):
    res = post(served, {"input": QUESTION, **body})
    assert res.status_code == 400, res.text
    assert res.json()["error"]["param"] == param


def test_the_sdk_raises_for_store(client):
    with pytest.raises(BadRequestError) as err:
        client.responses.create(model=MODEL, input=QUESTION, store=True)
    assert "nothing is stored" in err.value.body["message"]


# -- LangChain ChatOpenAI(use_responses_api=True) ------------------------------------------------------------------
@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers a and b."""
    return a * b


@pytest.fixture(scope="module")
def chat(served) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL, base_url=served.v1, api_key=KEY, max_tokens=N, max_retries=0, timeout=60, use_responses_api=True
    )


def test_chatopenai_responses_invoke_and_stream(chat, served):
    expected = served.ens.generate(messages=CHAT, max_new_tokens=N)
    msg = chat.invoke([SystemMessage(SYSTEM), HumanMessage(QUESTION)])
    assert msg.text == expected.text
    assert msg.usage_metadata["output_tokens"] == expected.stats.tokens
    chunks = list(chat.stream([SystemMessage(SYSTEM), HumanMessage(QUESTION)]))
    assert "".join(c.text for c in chunks) == expected.text


def test_chatopenai_responses_bind_tools(chat, served, monkeypatch):
    calls = script(monkeypatch, served.ens, pieces(CALL))
    msg = chat.bind_tools([multiply]).invoke("What is 6 times 7?")
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("multiply", {"a": 6, "b": 7})]
    assert calls[0].tools[0]["function"]["name"] == "multiply"
    script(monkeypatch, served.ens, pieces("It is 42."))
    follow = [HumanMessage("What is 6 times 7?"), msg, ToolMessage("42", tool_call_id=msg.tool_calls[0]["id"])]
    assert chat.bind_tools([multiply]).invoke(follow).text == "It is 42."
