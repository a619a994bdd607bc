"""LangChain adapters with the real demo models: Qwen2.5-Coder-0.5B drafts, SmolLM2-135M verifies.

Includes langchain-tests' `ChatModelIntegrationTests`. Replies are capped at a few dozen tokens so a run
stays within CI time on two CPU cores; the models are loaded once per session.
"""

from __future__ import annotations

from functools import cache

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.tools import tool
from langchain_tests.integration_tests import ChatModelIntegrationTests

from langchain_safe import ChatSafe, SafeLLM
from safe_engine import Ensemble
from tests.langchain_flags import ChatSafeFlags

pytestmark = pytest.mark.integration

MODELS = ["qwen2.5-coder-0.5b", "smollm2-135m"]  # drafter first
MAX_TOKENS = 64


@cache
def real_ensemble() -> Ensemble:
    return Ensemble.from_pretrained(MODELS)


class TestChatSafeStandardIntegration(ChatSafeFlags, ChatModelIntegrationTests):
    @property
    def chat_model_params(self) -> dict:
        return {"ensemble": real_ensemble(), "max_tokens": MAX_TOKENS}

    @property
    def standard_chat_model_params(self) -> dict:
        # `timeout` (60 s in the standard parameters) is enforced as the engine's timeout_s; a 64-token reply
        # of the real models can take longer on a shared 2-core CPU.
        return {**super().standard_chat_model_params, "timeout": None}

    # Where the 0.5B drafter, not the adapter, is the limit (greedy: deterministic, but an engine change
    # could flip it, hence strict=False).
    @pytest.mark.xfail(
        reason="JSON mode is enforced (the reply is always a JSON object), but with no keys given to it the 0.5B "
        'drafter loops inside the first value ("A cat is a cat, a cat is a cat, ...") until max_tokens, so the '
        "Joke model misses its punchline; with a schema (method='json_schema', the default) it writes both",
        strict=False,
    )
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)


# -- beyond the standard suite ---------------------------------------------------------------------------
@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers a and b and return the product."""
    return a * b


def test_real_tool_call_round_trip():
    chat = ChatSafe(ensemble=real_ensemble(), max_tokens=48)
    bound = chat.bind_tools([multiply])
    question = HumanMessage("What is 1234 * 5678? Use the multiply tool.")
    first = bound.invoke([question])
    assert first.tool_calls, f"no tool call in {first!r}"
    call = first.tool_calls[0]
    assert call["name"] == "multiply" and call["args"] == {"a": 1234, "b": 5678}
    assert first.content == "" and first.response_metadata["finish_reason"] == "eos"
    # The call and its result go back through both chat templates (Qwen's renders them natively,
    # SmolLM2's gets the tool schemas in its system message). What a 0.5B model makes of the result is
    # not asserted: it tends to call the tool again (see examples/langchain_agent.py).
    tool_message = multiply.invoke(call)
    assert tool_message.content == "7006652"
    second = bound.invoke([question, first, tool_message])
    assert isinstance(second, AIMessage) and (second.content or second.tool_calls)
    assert second.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"]


def test_real_llm_invoke_stream_and_lcel():
    llm = SafeLLM(ensemble=real_ensemble(), max_new_tokens=12)
    text = llm.invoke("def fibonacci(n):")
    assert text.strip()
    assert "".join(llm.stream("def fibonacci(n):")) == text
    chain = PromptTemplate.from_template("def {name}(n):") | llm | StrOutputParser()
    assert chain.invoke({"name": "fibonacci"}) == text
    info = llm.generate(["def fibonacci(n):"]).generations[0][0].generation_info
    assert info["stats"]["tokens"] <= 12 and 0.0 <= info["ensemble_rate"] <= 1.0


def test_real_lazy_loading_by_demo_name():
    chat = ChatSafe(models=MODELS, max_tokens=8)
    assert not chat.is_loaded and chat.ensemble_name == "safe:qwen2.5-coder-0.5b+smollm2-135m"
    reply = chat.invoke("Say hello.")
    assert isinstance(reply, AIMessage) and reply.content and chat.is_loaded


def test_chat_model_is_a_base_chat_model():
    assert issubclass(ChatSafe, BaseChatModel)
