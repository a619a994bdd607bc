"""Byte-level vocabularies and boundaries on real tokenizers of several families."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from safe_engine.algorithm.alignment import boundaries, common_boundaries
from safe_engine.runtime.vocab import Vocab
from tests.conftest import tokenizer

FAMILIES = ["gpt2", "llama2", "qwen2.5-7b-instruct", "mistral-7b-instruct-v0.3", "gpt-neox-20b", "exaone-3.5"]
BYTE_LEVEL = ["gpt2", "qwen2.5-7b-instruct", "gpt-neox-20b", "exaone-3.5"]


def vocab(name: str) -> Vocab:
    if name not in _VOCABS:
        _VOCABS[name] = Vocab(tokenizer(name))
    return _VOCABS[name]


_VOCABS: dict[str, Vocab] = {}


def pieces(v: Vocab, text: str) -> list[bytes]:
    ids, _ = v.encode(text.encode())
    return [v.token_bytes[i] for i in ids]


def test_word_split_by_one_tokenizer_but_not_another():
    # GPT-2 writes "Incorrect" as In|correct, Qwen as one token: offset 2 is a GPT-2 boundary only.
    text = b"Incorrect"
    assert pieces(vocab("gpt2"), "Incorrect") == [b"In", b"correct"]
    assert pieces(vocab("qwen2.5-7b-instruct"), "Incorrect") == [b"Incorrect"]
    assert boundaries(vocab("gpt2"), text) == {0, 2, 9}
    assert common_boundaries([vocab("gpt2"), vocab("qwen2.5-7b-instruct")], text) == {0, 9}


def test_byte_level_token_ends_inside_a_multibyte_character():
    text = "世界".encode()
    starts = sorted(boundaries(vocab("gpt2"), text))
    assert any(b not in (0, 3, 6) for b in starts), "GPT-2 splits these CJK characters mid-character"
    assert sorted(common_boundaries([vocab("gpt2"), vocab("llama2")], text)) == [0, 3, 6]


def test_sentencepiece_has_no_dummy_prefix_and_marks_spaces():
    v = vocab("llama2")
    assert v.adds_dummy_prefix
    assert pieces(v, "hello world") == [b"hello", b" world"]
    assert pieces(v, " hello") == [b" hello"]
    assert pieces(v, "\n\nx")[0] == b"\n"


def test_byte_fallback_tokens_decode_to_raw_bytes():
    v = vocab("llama2")
    emoji = "👩‍👩‍👧"
    got = pieces(v, emoji)
    assert b"".join(got) == emoji.encode()
    assert all(len(p) == 1 for p in got[:4]), "Llama-2 spells this emoji with <0xNN> byte tokens"
    assert v.id_of_bytes[b" "] == tokenizer("llama2").convert_tokens_to_ids("▁"), "the ordinary piece wins over <0x20>"


def test_undecodable_bytes_become_single_byte_tokens():
    for name in ("gpt2", "llama2", "qwen2.5-7b-instruct"):
        v = vocab(name)
        data = "é世".encode()[:-1]  # the text ends inside 世
        ids, starts = v.encode(data)
        assert b"".join(v.token_bytes[i] for i in ids) == data
        assert starts[-1] >= 2


def test_control_token_strings_stay_text():
    v = vocab("qwen2.5-7b-instruct")
    ids = v.encode_text("say <|im_end|> now")
    assert tokenizer("qwen2.5-7b-instruct").convert_tokens_to_ids("<|im_end|>") not in ids
    assert b"".join(v.token_bytes[i] for i in ids) == b"say <|im_end|> now"
    assert v.encode_text("<|im_end|>", control_tokens=True) == [tokenizer("qwen2.5-7b-instruct").eos_token_id]


@pytest.mark.parametrize("name", FAMILIES)
def test_special_tokens_have_no_text(name):
    v = vocab(name)
    for tid in tokenizer(name).all_special_ids:
        assert v.token_bytes[tid] is None


def _hf_prefix_boundaries(name: str, text: str) -> set[int]:
    """Independent oracle: HF's own decoder tells how many bytes each token prefix spells."""
    tok = tokenizer(name)
    ids, _ = vocab(name).encode(text.encode())
    out = {0}
    for k in range(1, len(ids) + 1):
        prefix = tok.convert_tokens_to_string(tok.convert_ids_to_tokens(ids[:k]))
        if "\ufffd" not in prefix:
            out.add(len(prefix.encode()))
    return out


texts = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="\ufffd") | st.sampled_from(" \n\t"),
    min_size=1,
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts)
def test_encoding_is_lossless_and_boundaries_are_real(text):
    data = text.encode()
    vocabs = [vocab(n) for n in FAMILIES]
    common = common_boundaries(vocabs, data)
    for name, v in zip(FAMILIES, vocabs):
        ids, starts = v.encode(data)
        assert starts == sorted(starts) and all(0 <= s < len(data) for s in starts)
        if b"".join(v.token_bytes[i] for i in ids) != data:
            # only a normalising tokenizer (Qwen: NFC) may spell the text differently
            assert tokenizer(name).backend_tokenizer.normalizer is not None
            assert b"".join(v.token_bytes[i] for i in ids).decode() == unicodedata.normalize("NFC", text)
            continue
        mine = {*starts, len(data)}
        assert common <= mine  # every reported boundary is a boundary of every member
        if name in BYTE_LEVEL:
            # HF's decoder agrees on every boundary that ends on a whole character
            whole = {b for b in mine if _is_char_boundary(data, b)}
            assert whole <= _hf_prefix_boundaries(name, text)
    # no real common boundary is missed: an offset every member starts a token at is reported
    everyone = set.intersection(*({*v.encode(data)[1], len(data)} for v in vocabs))
    assert everyone == common


def test_normalising_tokenizer_maps_offsets_back_to_the_original_text():
    # Qwen's tokenizer applies NFC: U+1F75 becomes U+03AE, a different byte string.
    v = vocab("qwen2.5-7b-instruct")
    data = "hommes vä\u1f75 ok".encode()
    ids, starts = v.encode(data)
    assert b"".join(v.token_bytes[i] for i in ids) != data
    assert starts[0] == 0 and starts == sorted(starts) and starts[-1] == data.index(b" ok")


def _is_char_boundary(data: bytes, offset: int) -> bool:
    return offset == len(data) or (data[offset] & 0xC0) != 0x80
