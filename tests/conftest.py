"""Shared test helpers: where ../shared is, real tokenizers, and tiny random-weight models over them."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from safe_engine import Member
from safe_engine.runtime import placement as placement_module

SHARED = Path(os.environ.get("SAFE_SHARED_DIR", Path(__file__).resolve().parents[1] / ".." / "shared")).resolve()
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> Any:
    """The script benchmarks/NAME.py as a module, registered in sys.modules (dataclasses look their module up
    while it loads)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


TOKENIZERS = SHARED / "tokenizers"


def function_tool(name: str = "multiply", description: str = "Multiply two integers.") -> dict:
    """An OpenAI-style function tool taking two integers `a` and `b` (short calls, easy to check)."""
    parameters = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    }
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def require_shared() -> None:
    if not TOKENIZERS.is_dir():
        pytest.fail(f"shared test material not found at {SHARED}; set SAFE_SHARED_DIR to its location")


@cache
def tokenizer(name: str):
    """A real tokenizer from ../shared/tokenizers (cached: loading Qwen's takes a second)."""
    require_shared()
    return AutoTokenizer.from_pretrained(TOKENIZERS / name)


#: The tiny models' sizes (any architecture): 2 layers, 4 heads over 2 KV heads, width 32.
TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "initializer_range": 0.6,
}


@cache
def tiny_model(vocab_size: int, seed: int, eos_token_id: int | None = None, context: int = 4096) -> LlamaForCausalLM:
    """A 2-layer random Llama whose vocabulary matches a real tokenizer, with a `context`-token window.

    A large init scale makes its next-token distributions peaked, so greedy choices are not
    near-ties that float noise could flip.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=context,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
        **TINY,
    )
    return LlamaForCausalLM(config).eval()


def tiny_member(name: str, seed: int = 0, context: int = 4096, **kwargs) -> Member:
    """A member over the real tokenizer `name` and a tiny random model (cached: members share it)."""
    tok = tokenizer(name)
    label = f"{name}-{seed}" if context == 4096 else f"{name}-{seed}-ctx{context}"
    return Member(tiny_model(len(tok), seed, tok.eos_token_id, context), tok, name=label, **kwargs)


def save_tiny_member(name: str, seed: int, path: Path, context: int = 4096) -> str:
    """`tiny_member(name, seed)` saved as a Hugging Face directory at `path` (what a user passes to `-m`)."""
    member = tiny_member(name, seed, context)
    member.model.save_pretrained(path)
    member.tokenizer.save_pretrained(path)
    return str(path)


def one_torch_thread() -> Iterator[None]:
    """For a package's autouse fixture: tiny models run faster on one torch thread than on two competing
    OpenMP teams; the count is put back after the package."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def machine(monkeypatch):
    """A machine of `cores` CPUs (logical = physical) with torch at its default count unless set (for the
    placement's tests)."""

    def set_up(cores: int, torch_threads: int | None = None) -> None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
        monkeypatch.setattr(placement_module, "available_cores", lambda: cores)
        monkeypatch.setattr(placement_module, "physical_cores", lambda: cores)
        monkeypatch.setattr(torch, "get_num_threads", lambda: torch_threads or cores)

    before = torch.get_num_threads()
    yield set_up
    torch.set_num_threads(before)  # the engine set counts the fake machine gave: torch's default back as it was


@pytest.fixture
def fake_clock(monkeypatch):
    """The placement's clock made a machine: each timed forward takes `costs[threads]` seconds, by the calling
    thread's torch count at the time."""

    def set_up(costs: dict[int, float]) -> None:
        now = [0.0]

        def clock() -> float:
            now[0] += costs[torch.get_num_threads()]  # read before and after a forward: one cost between
            return now[0]

        monkeypatch.setattr(placement_module, "perf_counter", clock)

    return set_up


@pytest.fixture
def members3() -> list[Member]:
    """Three tokenizer families: byte-level BPE (Qwen), SentencePiece with byte fallback (Llama-2), GPT-2."""
    return [tiny_member("qwen2.5-7b-instruct", 1), tiny_member("llama2", 2), tiny_member("gpt2", 3)]
