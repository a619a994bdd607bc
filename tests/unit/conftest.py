"""Unit tests run tiny models: one torch thread is faster for them than two competing OpenMP threads."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.conftest import tiny_member


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="package")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Two tiny members (Qwen2.5's and GPT-2's tokenizers) saved as a user's local model directories."""
    dirs = []
    for family, seed in (("qwen2.5-7b-instruct", 1), ("gpt2", 2)):
        member = tiny_member(family, seed)
        path = tmp_path_factory.mktemp(family)
        member.model.save_pretrained(path)
        member.tokenizer.save_pretrained(path)
        dirs.append(str(path))
    return dirs
