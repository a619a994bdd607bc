"""Property tests: random prompts, stop strings and configs over real tokenizers never crash, stream
equals generate, and the stats invariants hold."""

from __future__ import annotations

import os
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from safe_engine import Ensemble, GenerationConfig, InputError
from safe_engine.config import AGGREGATIONS, METHODS, SHARPENINGS
from tests.conftest import tiny_member

from .conftest import FAMILIES, check_invariants

FRAGMENTS = [
    "The ",
    "quick ",
    "世界",
    "👩‍👩‍👧",
    "e\u0301",
    "مرحبا ",
    "שלום",
    "  ",
    "\n\n",
    "\t",
    "<|im_end|>",
    "<s>",
    "</s>",
    "[INST]",
    "𠜎",
    "ﬁ",
    "Å",
    "0.5",
    "def f():",
    "ok",
    "\u200b",
    "\x00",
]
EXAMPLES = int(os.environ.get("SAFE_FUZZ_EXAMPLES", "45"))  # raise it for a deeper hunt
NORMALISING = {"qwen2.5-7b-instruct", "gpt-neox-20b"}  # NFC normalizers

text_chars = st.characters(codec="utf-8")  # every code point but surrogates
prompts = st.one_of(
    st.text(text_chars, min_size=1, max_size=24),
    st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=5).map("".join),
)
stops = st.lists(
    st.one_of(
        st.text(text_chars, min_size=1, max_size=3), st.sampled_from([" ", "e", "\n", "the", "a", "\ufffd", "."])
    ),
    max_size=3,
)
configs = st.builds(
    GenerationConfig,
    method=st.sampled_from(METHODS),
    aggregation=st.sampled_from(AGGREGATIONS),
    draft_length=st.integers(1, 6),
    top_k=st.integers(1, 12),
    sharpening=st.sampled_from(SHARPENINGS),
    sharpen_threshold=st.floats(0.0, 0.9),
    max_new_tokens=st.integers(1, 10),
    stop=stops.map(tuple),
    do_sample=st.booleans(),
    temperature=st.floats(0.3, 2.0),
    top_p=st.floats(0.5, 1.0),
    seed=st.integers(0, 2**32),
)


@pytest.fixture(scope="module")
def ensembles() -> list[Ensemble]:
    return [
        Ensemble([tiny_member("qwen2.5-7b-instruct", 1), tiny_member("llama2", 2), tiny_member("gpt2", 3)]),
        Ensemble([tiny_member("gpt2", 3), tiny_member("gpt2", 3)]),  # same vocabulary: the drafter-ids path
        Ensemble([tiny_member("mistral-7b-instruct-v0.3", 4), tiny_member("gpt-neox-20b", 5)]),
        Ensemble([tiny_member("exaone-3.5", 6), tiny_member("llama2", 7)], weights=[0.7, 0.3]),
        Ensemble([tiny_member("llama2", 8)]),
        Ensemble([tiny_member("qwen2.5-7b-instruct", 9), tiny_member("mistral-7b-instruct-v0.3", 10)]),  # both chat
    ]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), prompt=prompts, config=configs)
def test_random_requests_hold_the_invariants(ensembles, data, prompt, config):
    ens = data.draw(st.sampled_from(ensembles), label="ensemble")
    drafter = data.draw(st.integers(0, len(ens.members) - 1), label="drafter")
    if drafter != ens.drafter_index:
        ens = Ensemble(ens.members, drafter=drafter, weights=ens.weights.tolist())
    chat = all(m.chat_template for m in ens.members) and data.draw(st.booleans(), label="chat")
    request = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    try:
        res = ens.generate(**request, config=config)
    except InputError as err:  # the only acceptable refusal for a non-empty, valid prompt
        assert "encodes to no tokens" in str(err)
        return
    check_invariants(res, config.max_new_tokens, config.stop)
    if len(ens.members) == 1:
        assert res.stats.method == "single"
    stream = ens.stream(**request, config=config)
    deltas = list(stream)
    assert "".join(deltas) == stream.result.text == res.text
    assert (stream.result.finish_reason, stream.result.stats.tokens) == (res.finish_reason, res.stats.tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_random_bytes_encode_with_consistent_offsets(family):
    vocab = tiny_member(family, 50).vocab

    @settings(max_examples=EXAMPLES, deadline=None)
    @given(st.one_of(st.binary(min_size=1, max_size=40), st.text(text_chars, min_size=1, max_size=20).map(str.encode)))
    def check(data: bytes) -> None:
        try:
            ids, starts = vocab.encode(data)
        except InputError as err:
            assert "no token for byte" in str(err)
            return
        assert len(ids) == len(starts) > 0
        assert starts[0] == 0 and starts == sorted(starts) and starts[-1] < len(data)
        assert not set(ids) & vocab.special_ids
        spelled = b"".join(vocab.token_bytes[i] or b"" for i in ids)
        if family in NORMALISING:
            norm = lambda b: unicodedata.normalize("NFC", b.decode(errors="replace"))  # noqa: E731
            assert norm(spelled) == norm(data)
        else:
            assert spelled == data

    check()
