"""llamaindex_safe.SafeLLM on the real demo models: Qwen2.5-Coder-0.5B (drafter) + SmolLM2-135M.

Different tokenizers (151,936 vs 49,152 tokens) and chat templates. Slow on CPU (≈ 0.2-0.5 s per token),
so the generations are short. The demo models are fetched into the cache once.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration

pytest.importorskip("gguf")
from llama_index.core.llms import ChatMessage, MessageRole  # noqa: E402

from llamaindex_safe import SafeLLM  # noqa: E402

MODELS = ["qwen2.5-coder-0.5b", "smollm2-135m"]


@pytest.fixture(scope="module")
def llm() -> SafeLLM:
    llm = SafeLLM(models=MODELS, max_new_tokens=12)
    assert not llm.is_loaded
    return llm


def test_metadata_before_loading(llm):
    meta = llm.metadata  # peeked from the converted models' configs
    assert not llm.is_loaded
    # the members run in llama.cpp (the demo GGUFs, backend "auto"), whose context holds 4096 positions:
    # less than SmolLM2's 8192, the smaller of the two trained windows
    assert meta.context_window == 4096
    assert meta.is_chat_model is True
    assert meta.model_name == "safe:qwen2.5-coder-0.5b+smollm2-135m"


def test_complete(llm):
    response = llm.complete("def add(a, b):\n")
    assert llm.is_loaded
    assert llm.metadata.context_window == 4096  # the peeked window was the loaded one
    assert "return" in response.text and "a + b" in response.text.replace("b+a", "a + b")
    stats = response.additional_kwargs
    assert 0 < stats["tokens"] <= 12
    assert 0.0 <= stats["ensemble_rate"] <= 1.0
    assert set(stats["forward_passes"]) == set(MODELS)
    assert response.raw["usage"]["completion_tokens"] == stats["tokens"]


def test_stream_chat(llm):
    messages = [ChatMessage(role=MessageRole.USER, content="What is the capital of France? Answer in one word.")]
    chunks = list(llm.stream_chat(messages))
    text = ""
    for chunk in chunks:
        text += chunk.delta
        assert chunk.message.content == text
    assert "Paris" in text
    assert chunks[-1].additional_kwargs["finish_reason"] in {"eos", "length"}
    assert chunks[-1].additional_kwargs["tokens"] > 0
