"""The real demo models behind the server (Qwen2.5-Coder-0.5B drafts, SmolLM2-135M verifies), answering a
chat through LangChain's ChatOpenAI exactly as the in-process ensemble answers it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI

from safe_engine import Ensemble, GenerationConfig
from safe_engine.server import BackgroundServer, create_app

pytestmark = pytest.mark.integration

MODELS = ["qwen2.5-coder-0.5b", "smollm2-135m"]
KEY = "sk-integration"
TOKENS = 24
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def served():
    ens = Ensemble.from_pretrained(MODELS)
    app = create_app(ens, api_key=KEY, defaults=GenerationConfig(max_new_tokens=TOKENS))
    with BackgroundServer(app) as srv:
        yield srv, ens


def test_chatopenai_gets_the_ensembles_answer(served):
    srv, ens = served
    chat = ChatOpenAI(model="+".join(ens.names), base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=600)
    expected = ens.generate(messages=[{"role": "user", "content": QUESTION}], max_new_tokens=TOKENS)
    streamed = "".join(chunk.content for chunk in chat.stream([HumanMessage(QUESTION)]))
    assert streamed == expected.text
    assert "Paris" in expected.text
    msg = chat.invoke([HumanMessage(QUESTION)])
    assert msg.content == expected.text
    assert msg.usage_metadata["output_tokens"] == expected.stats.tokens
    assert ens.open_requests == 0


def test_the_server_client_example():
    """examples/server_client.py starts `safe-engine serve`, asks four clients, and stops it."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "server_client.py")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    lines = proc.stdout.splitlines()
    for client in ("openai SDK", "streaming", "LangChain ChatOpenAI", "LlamaIndex OpenAILike"):
        answer = next(line for line in lines if line.startswith(f"{client}: "))
        assert "Paris" in answer, answer
    assert "[server stopped: 0 open requests, no decoding thread left]" in proc.stderr


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40}},
            "required": ["city"],
        },
    },
}


def test_tool_choice_over_http_gives_exactly_what_was_asked(served):
    """The demo models through the openai SDK: "required" gives calls and nothing else, a named tool exactly
    one call to it, parallel_tool_calls=false one call at most; each equal to the in-process reply."""
    from openai import OpenAI

    srv, ens = served
    client = OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=600)
    messages = [{"role": "user", "content": "What's the weather and the time in Paris and in Rome?"}]
    for choice, parallel in [("required", True), ("required", False), ({"name": "get_time"}, True)]:
        named = {"type": "function", "function": choice} if isinstance(choice, dict) else choice
        res = client.chat.completions.create(
            model="+".join(ens.names),
            messages=messages,
            tools=[WEATHER, TIME],
            tool_choice=named,
            parallel_tool_calls=parallel,
            max_tokens=96,
        )
        reply = res.choices[0]
        calls = reply.message.tool_calls or []
        assert reply.finish_reason == "tool_calls" and calls, (choice, parallel, reply)
        assert not (reply.message.content or "").strip()
        if isinstance(choice, dict):
            assert [c.function.name for c in calls] == ["get_time"]
        if isinstance(choice, dict) or not parallel:
            assert len(calls) == 1
        local = ens.generate(
            messages=messages, tools=[WEATHER, TIME], tool_choice=named, parallel_tool_calls=parallel, max_tokens=96
        )
        assert [(c["name"], c["arguments"]) for c in local.tool_calls] == [
            (c.function.name, json.loads(c.function.arguments)) for c in calls
        ]


def test_parse_with_a_pydantic_model_over_http(served):
    """openai SDK `chat.completions.parse(response_format=Model)`: the demo models' reply is constrained to the
    schema and parses into the model."""
    from openai import OpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)

    srv, ens = served
    client = OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=600)
    res = client.chat.completions.parse(
        model="+".join(ens.names),
        messages=[{"role": "user", "content": "Name the capital of France and its country."}],
        response_format=City,
        max_tokens=64,
    )
    city = res.choices[0].message.parsed
    assert isinstance(city, City) and "Paris" in city.name
    assert ens.open_requests == 0
