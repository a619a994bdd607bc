"""Alignment on bytes: where each member's tokens start in the shared text, and where all agree.

SAFE may only ensemble at a byte offset where *every* member has a token boundary; elsewhere some member
would be forced into an unnatural sub-word split. Offsets are bytes of the UTF-8 text, not characters,
because a byte-level BPE token can end inside a multi-byte character.
"""

from __future__ import annotations

from collections.abc import Sequence

from .vocab import Vocab, token_starts

__all__ = ["boundaries", "common_boundaries", "token_starts"]


def boundaries(vocab: Vocab, text: bytes) -> set[int]:
    """Offsets where this tokenizer, encoding `text`, starts a token (plus the end of the text)."""
    _, starts = vocab.encode(text)
    return {*starts, len(text)}


def common_boundaries(vocabs: Sequence[Vocab], text: bytes) -> set[int]:
    """Offsets that are token boundaries for every tokenizer: the only places SAFE may ensemble."""
    return set.intersection(*(boundaries(v, text) for v in vocabs))
