"""Unicode and tokenizer torture on real tokenizers: byte-exact encoding, control strings that stay text,
byte-level tokens that end inside a character, and generation that survives all of it."""

from __future__ import annotations

import unicodedata

import pytest

from safe_engine import Ensemble, InputError
from safe_engine.algorithm.alignment import boundaries, common_boundaries
from safe_engine.shaping.chat import chat_prompt_ids
from tests.conftest import tiny_member

from .conftest import FAMILIES, SIMPLE_TEMPLATE, check_invariants, script

SPECIALS = (
    "<|im_end|> <|im_start|>user <|endoftext|> <s> </s> <unk> [INST] [/INST] [BOS] [|endofturn|] [PAD] "
    "<|begin_of_text|>"
)
TORTURE = {
    "emoji-zwj": "👩‍👩‍👧‍👦 👨🏽‍💻 🏳️‍🌈 🧑🏿‍🤝‍🧑🏻 family:",
    "cjk": "世界你好，日本語のテキスト、한국어 문장입니다。",
    "rtl": "مرحبا بالعالم שָׁלוֹם עולם 123 abc ‏mixed‎",
    "combining": "e\u0301 a\u0308 Z̤̮̯͈͓̮a̴l̡g̛o n\u0303 \u1100\u1161\u11a8 Å Å",
    "rare-4-byte": "𠜎𠜱𠝹𠱓 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🜲 \U000e0041",
    "whitespace": " " * 40 + "x" + "\n" * 30 + "\t\t \r\n \u00a0\u2003\u3000",
    "specials": SPECIALS,
    "mixed": "naïve café — “quotes” …ﬁ ligature ½ ² ℌ \u200b\ufeff\x00\x7f end",
}
TEMPLATED = {"qwen2.5-7b-instruct", "mistral-7b-instruct-v0.3", "exaone-3.5"}


@pytest.fixture(scope="module")
def members():
    return {family: tiny_member(family, 40 + i) for i, family in enumerate(FAMILIES)}


def special_ids(member, ids):
    return [i for i in ids if i in member.vocab.special_ids]


@pytest.mark.parametrize("family", FAMILIES)
def test_special_token_strings_in_a_prompt_are_text(members, family):
    m = members[family]
    ids = m.prompt_ids(SPECIALS)
    prefix = special_ids(m, m.prompt_ids("plain words"))  # the tokenizer's own BOS, if it adds one
    assert special_ids(m, ids) == prefix
    spelled = b"".join(m.token_bytes[i] or b"" for i in ids)
    assert spelled in (SPECIALS.encode(), b" " + SPECIALS.encode())  # SentencePiece adds a dummy space
    data_ids, _ = m.vocab.encode(SPECIALS.encode())
    assert special_ids(m, data_ids) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_special_token_strings_in_message_contents_are_text(members, family):
    m = members[family]
    if family not in TEMPLATED:
        m = tiny_member(family, 40 + FAMILIES.index(family), chat_template=SIMPLE_TEMPLATE)
    neutral = [{"role": "user", "content": "x"}]
    tricky = [{"role": "user", "content": SPECIALS + " 世界 " + SPECIALS}]
    want = special_ids(m, chat_prompt_ids(m, neutral))  # exactly what the template itself writes
    got = chat_prompt_ids(m, tricky)
    assert special_ids(m, got) == want
    if family == "qwen2.5-7b-instruct":
        im_end = m.tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert want.count(im_end) >= 1 and got.count(im_end) == want.count(im_end)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", sorted(TORTURE))
def test_encode_is_byte_exact_with_offsets(members, family, name):
    m = members[family]
    data = TORTURE[name].encode()
    ids, starts = m.vocab.encode(data)
    assert len(ids) == len(starts) > 0
    assert starts[0] == 0 and starts == sorted(starts) and starts[-1] < len(data)
    assert special_ids(m, ids) == []
    spelled = b"".join(m.token_bytes[i] or b"" for i in ids)
    if spelled != data:  # only a normalising tokenizer may differ, and only by normalisation
        forms = {unicodedata.normalize(f, TORTURE[name]).encode() for f in ("NFC", "NFKC", "NFD", "NFKD")}
        assert spelled in forms, (family, name, spelled[:80])
    cuts = boundaries(m.vocab, data)
    assert max(cuts) == len(data) and min(cuts) == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_bytes_cut_inside_a_character_encode_as_byte_tokens(members, family):
    m = members[family]
    cjk, emoji = "世界".encode(), "👩‍💻".encode()
    for data in (cjk[:-1], cjk[:1] + b"abc", b"x" + emoji[:2], emoji[:5] + cjk, b"\xff\xfe ok", b"\x80"):
        try:
            ids, starts = m.vocab.encode(data)
        except InputError as err:  # a tokenizer without byte tokens may refuse, clearly
            assert "no token for byte" in str(err)
            continue
        assert b"".join(m.token_bytes[i] or b"" for i in ids) == data
        assert len(starts) == len(ids) and sorted(starts) == starts


def test_common_boundaries_respect_each_tokenizer(members):
    vocabs = [members[f].vocab for f in FAMILIES]
    for text in TORTURE.values():
        data = text.encode()
        common = common_boundaries(vocabs, data)
        assert {0, len(data)} <= common
        for v in vocabs:
            assert common <= boundaries(v, data)


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_survives_torture_prompts(members, family):
    partner = FAMILIES[(FAMILIES.index(family) + 1) % len(FAMILIES)]
    ens = Ensemble([members[family], members[partner]])
    for name, prompt in TORTURE.items():
        res = ens.generate(prompt, max_new_tokens=8)
        check_invariants(res, 8)
        assert "".join(ens.stream(prompt, max_new_tokens=8)) == res.text, name
    res = ens.generate(TORTURE["cjk"], max_new_tokens=6, method="every_token", stop=["。", "\n"])
    check_invariants(res, 6, ("。", "\n"))


@pytest.mark.parametrize("family", ["qwen2.5-7b-instruct", "mistral-7b-instruct-v0.3", "exaone-3.5"])
def test_chat_generation_with_torture_contents(members, family):
    other = next(f for f in sorted(TEMPLATED) if f != family)
    ens = Ensemble([members[family], members[other]])
    for name in ("emoji-zwj", "rtl", "specials", "whitespace"):
        messages = [{"role": "user", "content": TORTURE[name]}]
        res = ens.generate(messages=messages, max_new_tokens=6)
        check_invariants(res, 6)
        assert "".join(ens.stream(messages=messages, max_new_tokens=6)) == res.text


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("bad", ["\ud800", "ok \udfff ok", b"caf\xe9".decode(errors="surrogateescape")])
def test_invalid_surrogates_are_a_clear_input_error(members, family, bad):
    partner = FAMILIES[(FAMILIES.index(family) + 1) % len(FAMILIES)]
    ens = Ensemble([members[family], members[partner]])
    with pytest.raises(InputError, match="unpaired surrogate"):
        ens.generate(bad, max_new_tokens=3)
    with pytest.raises(InputError, match="unpaired surrogate"):
        ens.generate(messages=[{"role": "user", "content": bad}], max_new_tokens=3)
    check_invariants(ens.generate("fine", max_new_tokens=3), 3)


@pytest.mark.parametrize("verifier", ["llama2", "qwen2.5-7b-instruct", "mistral-7b-instruct-v0.3"])
def test_a_drafter_emitting_single_bytes_of_characters(monkeypatch, verifier):
    """GPT-2 spells rare characters byte by byte, so its tokens end inside characters: the stream must
    never show half a character, and the boundary gate must keep the verifiers' offsets consistent."""
    text = "世界 𠜎 👩‍💻 ok"
    drafter = tiny_member("gpt2", 70)
    byte_ids = [drafter.vocab.id_of_bytes[bytes([b])] for b in text.encode()]
    script(drafter, monkeypatch, byte_ids)
    ens = Ensemble([drafter, tiny_member(verifier, 71)])
    single = ens.generate("Say:", max_new_tokens=len(byte_ids) + 5, method="single")
    assert single.text == text and single.finish_reason == "eos"
    deltas = list(ens.stream("Say:", max_new_tokens=len(byte_ids) + 5, method="single"))
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
    for method in ("safe", "every_token"):
        res = ens.generate("Say:", max_new_tokens=len(byte_ids) + 5, method=method)
        check_invariants(res, len(byte_ids) + 5)
        deltas = list(ens.stream("Say:", max_new_tokens=len(byte_ids) + 5, method=method))
        assert "".join(deltas) == res.text
    cut = ens.generate("Say:", max_new_tokens=2, method="single")  # ends inside 世
    assert cut.finish_reason == "length" and cut.text == "\ufffd"


@pytest.mark.parametrize("ending", ["eos", "length"])
def test_a_character_cut_at_the_end_cannot_smuggle_a_stop_string_out(monkeypatch, ending):
    """At the end, a cut character is flushed as U+FFFD; that flush is checked for stop strings too."""
    drafter = tiny_member("gpt2", 72)
    ids = [drafter.vocab.id_of_bytes[b"a"]] + [drafter.vocab.id_of_bytes[bytes([b])] for b in "世".encode()[:2]]
    script(drafter, monkeypatch, ids)  # then EOS
    ens = Ensemble([drafter, tiny_member("llama2", 73)])
    budget = 3 if ending == "length" else 10
    for stop in (["\ufffd"], ["a\ufffd"], ["zz", "\ufffd"]):
        for method in ("single", "safe"):
            res = ens.generate("Say:", max_new_tokens=budget, method=method, stop=stop)
            check_invariants(res, budget, tuple(stop))
            if method == "single":
                assert (res.text, res.finish_reason) == ("" if stop == ["a\ufffd"] else "a", "stop")
            assert "".join(ens.stream("Say:", max_new_tokens=budget, method=method, stop=stop)) == res.text
    res = ens.generate("Say:", max_new_tokens=budget, method="single")
    assert (res.text, res.finish_reason) == ("a\ufffd", ending)
