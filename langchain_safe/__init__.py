"""LangChain adapters for SAFE ensembles: `SafeLLM` (text completion) and `ChatSafe` (chat, tools)."""

from .chat_models import ChatSafe
from .llms import SafeLLM

__all__ = ["ChatSafe", "SafeLLM"]
