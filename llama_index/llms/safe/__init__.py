"""`from llama_index.llms.safe import SafeLLM`, the LlamaIndex integration naming convention.

`llama_index/` and `llama_index/llms/` deliberately have no `__init__.py`: they are namespace packages
shared with llama-index-core and other integrations.
"""

from llamaindex_safe import SafeLLM

__all__ = ["SafeLLM"]
