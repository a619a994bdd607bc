"""LangChain's ChatOpenAI and LlamaIndex's OpenAILike pointed at the server: results equal the engine's."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from llama_index.core.llms import ChatMessage
from llama_index.llms.openai_like import OpenAILike
from pydantic import BaseModel, Field

from tests.scripted import pieces, script

from .conftest import KEY, MODEL

SYSTEM = "You are terse."
QUESTION = "Name a prime number."
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
N = 10


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers a and b."""
    return a * b


class Product(BaseModel):
    """The product of two numbers."""

    value: int


# -- LangChain ChatOpenAI -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat(served) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=served.v1, api_key=KEY, max_tokens=N, max_retries=0, timeout=60)


def test_chatopenai_invoke(chat, served):
    expected = served.ens.generate(messages=CHAT, max_new_tokens=N)
    msg = chat.invoke([SystemMessage(SYSTEM), HumanMessage(QUESTION)])
    assert msg.content == expected.text
    assert msg.usage_metadata["output_tokens"] == expected.stats.tokens
    assert msg.response_metadata["finish_reason"] in ("stop", "length")


async def test_chatopenai_stream_and_astream(chat, served):
    expected = served.ens.generate(messages=CHAT, max_new_tokens=N)
    chunks = list(chat.stream([SystemMessage(SYSTEM), HumanMessage(QUESTION)], stream_usage=True))
    assert "".join(c.content for c in chunks) == expected.text
    assert sum((c for c in chunks[1:]), chunks[0]).usage_metadata["output_tokens"] == expected.stats.tokens
    achunks = [c async for c in chat.astream([SystemMessage(SYSTEM), HumanMessage(QUESTION)])]
    assert "".join(c.content for c in achunks) == expected.text


def test_chatopenai_safe_knobs_through_extra_body(served):
    llm = ChatOpenAI(
        model=MODEL, base_url=served.v1, api_key=KEY, max_tokens=N, max_retries=0, extra_body={"method": "single"}
    )
    expected = served.ens.generate(messages=CHAT, max_new_tokens=N, method="single")
    assert llm.invoke([SystemMessage(SYSTEM), HumanMessage(QUESTION)]).content == expected.text


def test_chatopenai_bind_tools(chat, served, monkeypatch):
    calls = script(monkeypatch, served.ens, pieces('<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}'))
    msg = chat.bind_tools([multiply]).invoke("What is 6 times 7?")
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("multiply", {"a": 6, "b": 7})]
    assert calls[0].tools[0]["function"]["name"] == "multiply"
    # the agent's next turn: the call and its result go back through the members' templates
    follow = [
        HumanMessage("What is 6 times 7?"),
        msg,
        ToolMessage("42", tool_call_id=msg.tool_calls[0]["id"]),
    ]
    script(monkeypatch, served.ens, pieces("It is 42."))
    assert chat.bind_tools([multiply]).invoke(follow).content == "It is 42."


def test_chatopenai_streamed_tool_call(chat, served, monkeypatch):
    script(
        monkeypatch, served.ens, pieces('<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 5}}</tool_call>')
    )
    chunks = list(chat.bind_tools([multiply]).stream("What is 2 times 5?"))
    msg = sum(chunks[1:], chunks[0])
    assert msg.content == "" and [(c["name"], c["args"]) for c in msg.tool_calls] == [("multiply", {"a": 2, "b": 5})]


def test_chatopenai_with_structured_output(chat, served, monkeypatch):
    calls = script(monkeypatch, served.ens, pieces('{"value": 42}'))  # a small model's bare-arguments reply
    result = chat.with_structured_output(Product, method="function_calling").invoke("6 times 7?")
    assert result == Product(value=42)
    assert "Product" in calls[0].messages[0]["content"]  # tool_choice forced it: the system note names it


class Score(BaseModel):
    """Bounded, so that even a random-weight model closes the object within the token budget."""

    label: str = Field(max_length=6)
    value: int = Field(ge=0, le=99)


def test_chatopenai_with_structured_output_is_constrained(served):
    """Unscripted: ChatOpenAI's default structured output (response_format json_schema) reaches the engine's
    grammar, so the tiny random models' reply always parses."""
    llm = ChatOpenAI(model=MODEL, base_url=served.v1, api_key=KEY, max_tokens=64, max_retries=0, temperature=0)
    reply = llm.with_structured_output(Score, method="json_schema").invoke("Give a score.")
    assert isinstance(reply, Score) and 0 <= reply.value <= 99 and len(reply.label) <= 6


def test_chatopenai_an_unscripted_agent_turn_equals_the_engine(chat, served):
    history = [
        HumanMessage("What is 6 times 7?"),
        AIMessage("", tool_calls=[{"name": "multiply", "args": {"a": 6, "b": 7}, "id": "abc123def"}]),
        ToolMessage("42", tool_call_id="abc123def"),
    ]
    engine = [
        {"role": "user", "content": "What is 6 times 7?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "abc123def", "type": "function", "function": {"name": "multiply", "arguments": {"a": 6, "b": 7}}}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "abc123def"},
    ]
    from langchain_core.utils.function_calling import convert_to_openai_tool

    expected = served.ens.generate(messages=engine, tools=[convert_to_openai_tool(multiply)], max_new_tokens=N)
    msg = chat.bind_tools([multiply]).invoke(history)
    if not msg.tool_calls:  # gibberish, unless the random model happened to write a call
        assert msg.content == expected.text


# -- LlamaIndex OpenAILike ----------------------------------------------------------------------------------------
def openai_like(served, chat_model: bool) -> OpenAILike:
    return OpenAILike(
        model=MODEL,
        api_base=served.v1,
        api_key=KEY,
        is_chat_model=chat_model,
        context_window=4096,
        max_tokens=N,
        temperature=0.0,
        max_retries=0,
        timeout=60,
    )


def test_openailike_complete_and_stream_complete(served):
    llm = openai_like(served, chat_model=False)
    prompt = "Once upon a time"
    expected = served.ens.generate(prompt, max_new_tokens=N)
    assert llm.complete(prompt).text == expected.text
    streamed = list(llm.stream_complete(prompt))
    assert streamed[-1].text == expected.text
    assert "".join(r.delta or "" for r in streamed) == expected.text


def test_openailike_chat_and_stream_chat(served):
    llm = openai_like(served, chat_model=True)
    messages = [ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content=QUESTION)]
    expected = served.ens.generate(messages=CHAT, max_new_tokens=N)
    assert llm.chat(messages).message.content == expected.text
    streamed = list(llm.stream_chat(messages))
    assert streamed[-1].message.content == expected.text


async def test_openailike_async(served):
    llm = openai_like(served, chat_model=True)
    expected = served.ens.generate(messages=[{"role": "user", "content": QUESTION}], max_new_tokens=N)
    res = await llm.acomplete(QUESTION)  # a chat model completes through /v1/chat/completions
    assert res.text == expected.text
