"""LlamaIndex integration of the SAFE ensemble engine: `SafeLLM` (a `CustomLLM`).

Also importable as `llama_index.llms.safe`. Never imports LangChain.
"""

from .llm import GENERATION_OPTIONS, SafeLLM

__all__ = ["GENERATION_OPTIONS", "SafeLLM"]
