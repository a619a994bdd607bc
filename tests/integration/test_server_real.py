"""The real demo models behind the server (Qwen2.5-Coder-0.5B drafts, SmolLM2-135M verifies), answering a
chat through LangChain's ChatOpenAI exactly as the in-process ensemble answers it."""

from __future__ import annotations

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
    assert "[server stopped]" in proc.stderr
