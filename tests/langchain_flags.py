"""What ChatSafe really supports, as langchain-tests' standard suites ask it (shared by unit and integration)."""

from __future__ import annotations

from langchain_safe import ChatSafe


class ChatSafeFlags:
    """Mixin for `ChatModelUnitTests` / `ChatModelIntegrationTests`: the flags, set honestly."""

    @property
    def chat_model_class(self) -> type[ChatSafe]:
        return ChatSafe

    @property
    def standard_chat_model_params(self) -> dict:
        # The members run in this process: a failed generation would fail the same way again, so ChatSafe
        # refuses max_retries > 0 (LangChain's own .with_retry() is the way to retry anyway).
        return {**super().standard_chat_model_params, "max_retries": 0}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True  # enforced: the ensemble decodes under a tool-call grammar

    @property
    def has_structured_output(self) -> bool:
        return True  # json_schema (default), function_calling and json_mode, each constrained by a grammar

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return False  # the members are fixed at construction; a per-call `model` is refused

    supports_json_mode = property(lambda self: True)
    # Text in, text out: no images, PDFs, audio, video or Anthropic-style content blocks.
    supports_image_inputs = property(lambda self: False)
    supports_image_urls = property(lambda self: False)
    supports_pdf_inputs = property(lambda self: False)
    supports_audio_inputs = property(lambda self: False)
    supports_video_inputs = property(lambda self: False)
    supports_image_tool_message = property(lambda self: False)
    supports_pdf_tool_message = property(lambda self: False)
    supports_anthropic_inputs = property(lambda self: False)
