"""Unit tests run tiny models: one torch thread is faster for them than two competing OpenMP threads."""

from __future__ import annotations

import pytest

from tests.conftest import one_torch_thread, save_tiny_member

_one_torch_thread = pytest.fixture(scope="package", autouse=True)(one_torch_thread)  # before module fixtures


@pytest.fixture(scope="package")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Two tiny members (Qwen2.5's and GPT-2's tokenizers) saved as a user's local model directories."""
    return [
        save_tiny_member(f, seed, tmp_path_factory.mktemp(f)) for f, seed in (("qwen2.5-7b-instruct", 1), ("gpt2", 2))
    ]
