"""LangChain's standard unit tests for ChatSafe (langchain-tests `ChatModelUnitTests`), tiny models."""

from __future__ import annotations

from functools import cache

from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_safe import ChatSafe
from safe_engine import Ensemble
from tests.conftest import tiny_member


@cache
def _ensemble() -> Ensemble:
    return Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("exaone-3.5", 2)])


class TestChatSafeStandardUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatSafe]:
        return ChatSafe

    @property
    def chat_model_params(self) -> dict:
        return {"ensemble": _ensemble()}

    # Flags, set to what ChatSafe really does.
    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True  # accepted; enforced by instruction, not by constrained decoding

    @property
    def has_structured_output(self) -> bool:
        return True  # BaseChatModel's default, via tools

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_image_urls(self) -> bool:
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        return False

    @property
    def supports_video_inputs(self) -> bool:
        return False

    @property
    def supports_image_tool_message(self) -> bool:
        return False

    @property
    def supports_pdf_tool_message(self) -> bool:
        return False

    @property
    def supports_anthropic_inputs(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return False  # the members are fixed at construction; a per-call `model` is refused
