"""What ChatSafe really supports, as langchain-tests' standard suites ask it (shared by unit and integration)."""

from __future__ import annotations

from langchain_safe import ChatSafe


class ChatSafeFlags:
    """Mixin for `ChatModelUnitTests` / `ChatModelIntegrationTests`: the flags, set honestly."""

    @property
    def chat_model_class(self) -> type[ChatSafe]:
        return ChatSafe

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True  # accepted; enforced by a system-message instruction, not by constrained decoding

    @property
    def has_structured_output(self) -> bool:
        return True  # BaseChatModel's default, via tools

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        return False  # the members are fixed at construction; a per-call `model` is refused

    # Text in, text out: no JSON mode, no images, PDFs, audio, video or Anthropic-style content blocks.
    supports_json_mode = property(lambda self: False)
    supports_image_inputs = property(lambda self: False)
    supports_image_urls = property(lambda self: False)
    supports_pdf_inputs = property(lambda self: False)
    supports_audio_inputs = property(lambda self: False)
    supports_video_inputs = property(lambda self: False)
    supports_image_tool_message = property(lambda self: False)
    supports_pdf_tool_message = property(lambda self: False)
    supports_anthropic_inputs = property(lambda self: False)
