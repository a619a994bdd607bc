"""LangChain's standard unit tests for ChatSafe (langchain-tests `ChatModelUnitTests`), tiny models."""

from __future__ import annotations

from functools import cache

from langchain_tests.unit_tests import ChatModelUnitTests

from safe_engine import Ensemble
from tests.conftest import tiny_member
from tests.langchain_flags import ChatSafeFlags


@cache
def _ensemble() -> Ensemble:
    return Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("exaone-3.5", 2)])


class TestChatSafeStandardUnit(ChatSafeFlags, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict:
        return {"ensemble": _ensemble()}
