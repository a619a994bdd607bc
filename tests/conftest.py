"""Shared test helpers: where ../shared is, real tokenizers, and tiny random-weight models over them."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from safe_engine import Member

SHARED = Path(os.environ.get("SAFE_SHARED_DIR", Path(__file__).resolve().parents[1] / ".." / "shared")).resolve()
TOKENIZERS = SHARED / "tokenizers"


def require_shared() -> None:
    if not TOKENIZERS.is_dir():
        pytest.fail(f"shared test material not found at {SHARED}; set SAFE_SHARED_DIR to its location")


@cache
def tokenizer(name: str):
    """A real tokenizer from ../shared/tokenizers (cached: loading Qwen's takes a second)."""
    require_shared()
    return AutoTokenizer.from_pretrained(TOKENIZERS / name)


@cache
def tiny_model(vocab_size: int, seed: int, eos_token_id: int | None = None) -> LlamaForCausalLM:
    """A 2-layer random Llama whose vocabulary matches a real tokenizer.

    A large init scale makes its next-token distributions peaked, so greedy choices are not
    near-ties that float noise could flip.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.6,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def tiny_member(name: str, seed: int = 0, **kwargs) -> Member:
    tok = tokenizer(name)
    return Member(tiny_model(len(tok), seed, tok.eos_token_id), tok, name=f"{name}-{seed}", **kwargs)


@pytest.fixture
def members3() -> list[Member]:
    """Three tokenizer families: byte-level BPE (Qwen), SentencePiece with byte fallback (Llama-2), GPT-2."""
    return [tiny_member("qwen2.5-7b-instruct", 1), tiny_member("llama2", 2), tiny_member("gpt2", 3)]
