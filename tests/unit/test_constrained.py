"""The constraint engine (issue 16) on real tokenizers: masks, random walks, rollback, EOS, tool calls."""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from functools import cache
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from pydantic import BaseModel, Field

from safe_engine.cli.args import add_request_args, request_options
from safe_engine.errors import ConfigError
from safe_engine.runtime.vocab import Vocab
from safe_engine.shaping.constrained import (
    Candidates,
    Constraint,
    ConstraintError,
    Grammar,
    _bias_by_shifts,
    bias_of_bitmask,
    mask_distribution,
)
from safe_engine.shaping.request import build_request
from safe_engine.shaping.schemas import strict
from safe_engine.shaping.tools import parse_tool_calls
from tests.conftest import function_tool, tiny_member, tokenizer

try:
    import jsonschema
except ImportError:  # pragma: no cover - the test extra installs it
    jsonschema = None

QWEN, LLAMA = "qwen2.5-7b-instruct", "llama2"


GAP = 12  # white space between JSON tokens: at most 12 characters a gap (constrained.JSON_OPTIONS)


def ws(most: int = GAP) -> bytes:
    """A regex of the white space allowed in one gap."""
    return rb"[ \t\n\r]{0,%d}" % most


@cache
def drafter(name: str) -> SimpleNamespace:
    """What a Member gives the constraint, without a model: Qwen padded to its models' 152,064 logits."""
    tok = tokenizer(name)
    vocab = Vocab(tok)
    pad = 152064 - vocab.size if name == QWEN else 0
    eos = {tok.eos_token_id} | ({tok.convert_tokens_to_ids("<|endoftext|>")} if name == QWEN else set())
    return SimpleNamespace(vocab=vocab, token_bytes=vocab.token_bytes + [None] * pad, eos_ids=frozenset(eos))


def ids_of(name: str, text: str | bytes) -> list[int]:
    return drafter(name).vocab.encode(text.encode() if isinstance(text, str) else text)[0]


def spelled(name: str, ids: list[int]) -> bytes:
    return b"".join(drafter(name).token_bytes[i] or b"" for i in ids)


def exact_mask(constraint: Constraint, name: str, pattern: bytes) -> None:
    """The mask allows exactly the tokens whose whole spelling fullmatches `pattern` (no control token)."""
    rx = re.compile(pattern, re.S)
    want = np.array([b is not None and rx.fullmatch(b) is not None for b in drafter(name).token_bytes])
    got = constraint.allowed()
    wrong = [(int(i), drafter(name).token_bytes[i], bool(got[i])) for i in np.nonzero(got != want)[0][:5]]
    assert not wrong, f"mask differs from the valid continuations: {wrong}"


# -- schemas for the walks -------------------------------------------------------------------------------
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
STATUS = {
    "type": "object",
    "properties": {
        "status": {"enum": ["ok", "error", 3, None]},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "score": {"type": "number"},
        "flag": {"type": "boolean"},
    },
    "required": ["status", "note", "flag"],
    "additionalProperties": False,
}
ITEMS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "label": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["id", "label"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 3,
}
SCHEMAS = [PERSON, STATUS, ITEMS, {"type": "object"}]
ADD = function_tool("add", "Add two integers.")
SEARCH = {
    "name": "search",
    "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string", "maxLength": 12}, "top": {"enum": [1, 5, 10]}},
        "required": ["query"],
    },
}
TOOLS = [ADD, SEARCH]
CLOSERS = (b'"', b"}", b"]", b"0", b",", b"null")


def walk(constraint: Constraint, name: str, rng: random.Random, max_steps: int = 600) -> bytes:
    """Sample only allowed tokens until EOS: uniform at first (any token: multi-byte characters, tokens ending
    inside a character), then more and more often a short closing token, so the text ends; stop at the
    first place EOS is allowed."""
    d = drafter(name)
    closers = [d.vocab.id_of_bytes[c] for c in CLOSERS]
    for step in range(max_steps):
        allowed = constraint.allowed()
        if constraint.can_stop():
            constraint.consume([min(constraint.eos_ids)])
            return spelled(name, constraint.ids)
        choices = np.flatnonzero(allowed)
        assert len(choices), f"no token allowed after {spelled(name, constraint.ids)!r}"
        assert not allowed[sorted(constraint.eos_ids)].any(), "EOS before the grammar accepts"
        shut = [t for t in closers if allowed[t]]
        tid = rng.choice(shut) if shut and rng.random() < min(0.95, step / 30) else int(rng.choice(choices))
        constraint.consume([tid])
    raise AssertionError(f"no EOS after {max_steps} steps: {spelled(name, constraint.ids)[:300]!r}")


def validate(value, schema) -> None:
    if jsonschema is not None:
        jsonschema.validate(value, schema)
    else:  # pragma: no cover
        assert isinstance(value, dict if schema.get("type") == "object" else list)


# -- masks -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [QWEN, LLAMA])
def test_masks_allow_exactly_the_valid_continuations(name):
    enum = Grammar.json_schema(
        {
            "type": "object",
            "properties": {"role": {"enum": ["admin", "editor"]}},
            "required": ["role"],
            "additionalProperties": False,
        }
    )
    c = Constraint(enum, drafter(name))
    exact_mask(c, name, rb"\{" + ws() + rb'("(r(o(l(e("' + ws() + rb"(:" + ws() + rb")?)?)?)?)?)?)?")  # {"role":
    c.consume(ids_of(name, '{"role": '))  # one character of the gap after ":" used
    values = rb'"|"a|"ad|"adm|"admi|"admin|"e|"ed|"edi|"edit|"edito|"editor'
    exact_mask(c, name, ws(GAP - 1) + rb"(" + values + rb")?|" + ws(GAP - 1) + rb'"(admin|editor)"' + ws() + rb"\}?")

    integer = Grammar.json_schema(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    )
    c = Constraint(integer, drafter(name))
    c.consume(ids_of(name, '{"n": '))
    exact_mask(c, name, ws(GAP - 1) + rb"(-|-?(0|[1-9][0-9]*)(" + ws() + rb"\}?)?)?")
    c.consume(ids_of(name, "1"))
    exact_mask(c, name, rb"[0-9]*(" + ws() + rb"\}?)?")


@pytest.mark.parametrize("name", [QWEN, LLAMA])
def test_strings_bytes_and_characters_cut_by_tokens(name):
    d = drafter(name)
    c = Constraint(Grammar.json_schema({"type": "object", "properties": {"s": {"type": "string"}}}), d)
    assert not c.allows(ids_of(name, ' {"s": "x"}')), "no text before the value (a SentencePiece ▁{ is a space)"
    c.consume(ids_of(name, '{"s": "'))
    allowed = c.allowed()
    one = d.vocab.id_of_bytes
    assert allowed[one[b"a"]] and allowed[one[b'"']] and allowed[one[b"\\"]]
    assert not allowed[one[b"\n"]], "raw control characters are not JSON"
    assert not allowed[one[b"\x80"]], "a continuation byte cannot start a character"
    lead = one[b"\xe6"]  # first byte of 日 (e6 97 a5): byte-level and byte-fallback vocabularies both have it
    assert allowed[lead]
    c.consume([lead])
    after = np.flatnonzero(c.allowed())
    assert after.size and all(0x80 <= d.token_bytes[i][0] <= 0xBF for i in after), "only continuation bytes"
    c.consume(ids_of(name, b'\x97\xa5"}'))
    assert c.must_stop() and json.loads(spelled(name, c.ids)) == {"s": "日"}


def test_qwen_tokens_that_end_inside_a_character():
    d = drafter(QWEN)
    c = Constraint(Grammar.json_schema({"type": "string"}), d)
    cut = [i for i, b in enumerate(d.token_bytes[:151643]) if b and len(b) > 1 and _ends_inside_a_character(b)]
    assert len(cut) > 100
    c.consume(ids_of(QWEN, '"'))
    assert all(c.allowed()[i] == _valid_start(d.token_bytes[i]) for i in cut[:2000])


def _ends_inside_a_character(b: bytes) -> bool:
    try:
        b.decode()
        return False
    except UnicodeDecodeError as err:
        return err.reason == "unexpected end of data"  # the bytes so far are a valid start of a character


def _valid_start(b: bytes) -> bool:
    """A token cut inside its last character may start a JSON string iff its complete characters may."""
    complete = b[: len(b.decode(errors="ignore").encode())].decode()
    try:
        return json.loads('"' + complete + '"') == complete
    except json.JSONDecodeError:
        return False


@pytest.mark.parametrize("name", [QWEN, LLAMA])
def test_mask_logits_sets_exactly_the_disallowed_ids_to_minus_inf(name):
    d = drafter(name)
    c = Constraint(Grammar.json_object(), d)
    c.consume(ids_of(name, '{"a": [1, 2'))
    logits = torch.randn(2, len(d.token_bytes) + 7)  # a batch, and model columns past the vocabulary
    masked = c.mask_logits(logits)
    allowed = torch.from_numpy(c.allowed().copy())
    assert torch.equal(masked[:, : len(allowed)][:, allowed], logits[:, : len(allowed)][:, allowed])
    assert bool(torch.isneginf(masked[:, : len(allowed)][:, ~allowed]).all())
    assert bool(torch.isneginf(masked[:, len(allowed) :]).all())
    assert c.mask_logits(logits.bfloat16()).dtype == torch.bfloat16
    bitmask = c.bitmask()
    assert all(bool((int(bitmask[i // 32]) >> (i % 32)) & 1) == bool(allowed[i]) for i in range(0, len(allowed), 97))
    # the accelerator's way (shifts on the device) builds the same bias as the CPU's (numpy)
    assert torch.equal(_bias_by_shifts(bitmask), bias_of_bitmask(bitmask))
    words = torch.tensor([0, -1, 1, -(2**31), 0x55555555], dtype=torch.int32)
    expected = [bool((int(w) >> i) & 1) for w in words.tolist() for i in range(32)]
    assert (bias_of_bitmask(words) == 0).tolist() == expected and torch.equal(
        _bias_by_shifts(words), bias_of_bitmask(words)
    )


# -- random walks ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [QWEN, LLAMA])
def test_random_walks_over_allowed_tokens_give_valid_json(name):
    grammars = [Grammar.json_schema(s) for s in SCHEMAS]
    rng = random.Random(16)
    seen = set()
    for i in range(50):
        schema = SCHEMAS[i % len(SCHEMAS)]
        value = json.loads(walk(Constraint(grammars[i % len(SCHEMAS)], drafter(name)), name, rng).decode())
        validate(value, schema)  # strict UTF-8, then JSON, then the schema
        if schema is PERSON:
            seen |= {("tags", "tags" in value), ("zip", "zip" in value["address"])}
        elif schema is STATUS:
            seen.add(("note", type(value["note"]).__name__))
        elif schema is ITEMS:
            seen |= {("label", type(item["label"]).__name__) for item in value}
    # the walks went down every branch: optional fields present and absent, both sides of each anyOf
    branches = {(f, b) for f in ("tags", "zip") for b in (True, False)}
    assert seen >= branches | {(f, t) for f in ("note", "label") for t in ("str", "NoneType")}


@pytest.mark.parametrize("name", [QWEN, LLAMA])
def test_random_tool_call_walks_parse_as_valid_calls(name):
    rng = random.Random(7)
    for choice, prefix in [("required", ""), ("search", ""), ("auto", "Let me check.\n<tool_call>")]:
        grammar = Grammar.tool_calls(TOOLS, choice)
        for _ in range(8):
            c = Constraint(grammar, drafter(name))
            c.consume(ids_of(name, prefix))
            text = walk(c, name, rng).decode()
            parsed = parse_tool_calls(text, TOOLS, choice)
            assert parsed.tool_calls and not parsed.invalid, text
            for call in parsed.tool_calls:
                tool = ADD["function"] if call["name"] == "add" else SEARCH
                assert choice in ("required", "auto", call["name"])
                validate(call["arguments"], tool["parameters"])
            assert parsed.content == ("Let me check.\n" if prefix else "")


# -- state: rollback, checks without consuming, EOS ------------------------------------------------------
@pytest.mark.parametrize("name", [QWEN, LLAMA])
def test_rollback_then_consume_again_gives_the_same_state(name):
    doc = json.dumps({"name": "Zoë", "age": 7, "address": {"city": "Köln", "zip": "5"}, "tags": ["a"]})
    ids = ids_of(name, doc)
    c = Constraint(Grammar.json_schema(PERSON), drafter(name))
    masks = []
    for tid in ids:
        masks.append(c.bitmask().clone())
        c.consume([tid])
    masks.append(c.bitmask().clone())
    rng = random.Random(3)
    for _ in range(20):
        back = rng.randint(1, min(8, len(c.ids)))  # a discarded draft tail
        c.rollback(back)
        assert torch.equal(c.bitmask(), masks[len(c.ids)])
        c.consume(ids[len(c.ids) : len(c.ids) + back])
        assert torch.equal(c.bitmask(), masks[len(c.ids)])
    c.consume([min(c.eos_ids)])
    c.rollback(3)
    assert c.ids == ids[:-2] and not c.is_finished() and torch.equal(c.bitmask(), masks[-3])
    c.reset()
    assert c.ids == [] and torch.equal(c.bitmask(), masks[0])


@pytest.mark.parametrize("name", [QWEN, LLAMA])
def test_allows_agrees_with_consuming_and_changes_nothing(name):
    d = drafter(name)
    c = Constraint(Grammar.json_schema(STATUS), d)
    c.consume(ids_of(name, '{"status": "ok", "note": '))
    before = c.bitmask().clone()
    rng = random.Random(5)
    ids = ids_of(name, 'null, "flag": true}')
    for _ in range(40):
        seq = ids[: rng.randint(0, len(ids))] + [rng.randrange(len(d.token_bytes)) for _ in range(rng.randint(0, 3))]
        n = c.valid_prefix(seq)
        assert c.allows(seq) == (n == len(seq))
        assert torch.equal(c.bitmask(), before), "checking must not consume"
        twin = c.fork()
        twin.consume(seq[:n])
        if n < len(seq):
            with pytest.raises(ConstraintError):
                twin.consume(seq[n : n + 1])
            assert twin.ids == c.ids + seq[:n], "a refused consume changes nothing"
        assert c.allows_text(spelled(name, seq[:n]))
    assert c.allows([*ids, min(c.eos_ids)]) and not c.allows([*ids, min(c.eos_ids), ids[0]])


@pytest.mark.parametrize("name", [QWEN, LLAMA])
def test_eos_only_where_the_grammar_accepts_and_forced_when_complete(name):
    d = drafter(name)
    c = Constraint(Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}), d)
    eos = sorted(c.eos_ids)
    ids = ids_of(name, '{"a": 12}')
    for tid in ids:
        assert not c.can_stop() and not any(c.allowed()[e] for e in eos)
        assert not c.allows([eos[0]])
        c.consume([tid])
    assert c.can_stop() and c.must_stop()
    assert sorted(np.flatnonzero(c.allowed()).tolist()) == eos, "complete: every EOS id, nothing else"
    for e in eos:
        assert c.allows([e])
    c.consume([eos[-1]])
    assert c.is_finished() and not c.can_stop() and not c.allowed().any()
    with pytest.raises(ConstraintError):
        c.consume(ids_of(name, " "))
    # other control tokens are never allowed
    control = [i for i, b in enumerate(d.token_bytes[: d.vocab.size]) if b is None and i not in c.eos_ids]
    fresh = Constraint(Grammar.tool_calls(TOOLS, "auto"), d)
    assert fresh.can_stop() and not any(fresh.allowed()[i] for i in control)


# -- tool-call grammars ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [QWEN, LLAMA])
def test_tool_choice_auto_required_and_named(name):
    d = drafter(name)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    search = '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'  # compact form too
    auto = Constraint(Grammar.tool_calls(TOOLS, "auto"), d)
    for text, ok in [
        ("The sum is 3.", True),
        ("Using < and > is fine, <tool> too", True),
        (call, True),
        (f"I'll add them.\n{call}\n{search}", True),
        ("text <tool_call> more text", False),  # once the tag is written, a call must follow
        ('<tool_call>\n{"name": "multiply", "arguments": {}}\n</tool_call>', False),
        ('<tool_call>\n{"name": "add", "arguments": {"a": "1", "b": 2}}\n</tool_call>', False),
        # only declared parameters (a function takes what it declares; the schema did not say otherwise)
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}\n</tool_call>', False),
        (f"{call} and some text after", False),
    ]:
        assert auto.allows_text(text.encode()) == ok, text
        assert auto.allows([*ids_of(name, text), min(auto.eos_ids)]) == ok, text
    assert auto.can_stop(), "an empty reply is free text too"

    required = Constraint(Grammar.tool_calls(TOOLS, "required"), d)
    assert not required.can_stop() and not required.allows_text(b"The sum")
    assert all(b"<tool_call>".startswith(d.token_bytes[i][:11]) for i in np.flatnonzero(required.allowed())), (
        "only the opening tag can start the reply"
    )
    assert required.allows_text(f"{call}\n{search}".encode())
    if name == QWEN:
        assert required.allowed()[d.vocab.id_of_bytes[b"<tool_call>"]], "Qwen's single <tool_call> token"

    named = Constraint(Grammar.tool_calls(TOOLS, "search"), d)
    assert not named.allows_text(call.encode()) and named.allows_text(search.encode())
    assert not named.allows_text(f"{search}\n{search}".encode()), "a named tool: exactly one call"
    named.consume(ids_of(name, '<tool_call>\n{"name": "'))
    assert named.forced_text().startswith(b'search"')
    assert Grammar.tool_calls(TOOLS, "none") is None


def test_grammar_for_request_and_errors():
    assert Grammar.for_request() is None
    assert Grammar.for_request(tools=TOOLS, tool_choice="none") is None
    assert Grammar.for_request(tools=TOOLS).kind == "tool_calls"
    assert Grammar.for_request(json_schema=json.dumps(PERSON)) == Grammar.json_schema(PERSON)
    with pytest.raises(ConfigError, match="cannot be combined"):
        Grammar.for_request(json_schema=PERSON, tools=TOOLS, tool_choice="required")
    with pytest.raises(ConfigError):
        Grammar.json_schema("{not json")
    with pytest.raises(ConfigError):
        Grammar.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})
    with pytest.raises(ConfigError):
        Grammar.tool_calls(TOOLS, "multiply")
    loose = Grammar.json_schema({"type": "object", "if": {"required": ["a"]}, "then": {}})
    assert loose.warnings, "unimplemented keywords are reported, not silently dropped"


# -- ensemble points -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [QWEN, LLAMA])
def test_mask_distribution_zeroes_forbidden_candidates_and_renormalises(name):
    d = drafter(name)
    c = Constraint(Grammar.json_schema(STATUS), d)
    c.consume(ids_of(name, '{"status": '))
    strings = [b'"ok"', b' "', b"3", b"null", b"hello", b"", b'"error", "note": null', b'"err', b"4"]
    probs = torch.tensor([0.2, 0.1, 0.1, 0.1, 0.2, 0.1, 0.1, 0.0, 0.1], dtype=torch.float64)
    out = mask_distribution(strings, probs, c)
    keep = torch.tensor([1, 1, 1, 1, 0, 0, 1, 0, 0], dtype=torch.float64)  # '"err' is valid but has p = 0
    assert torch.allclose(out, probs * keep / (probs * keep).sum()) and out.dtype == probs.dtype
    assert c.allows_strings(strings).tolist() == [True, True, True, True, False, False, True, True, False]
    assert mask_distribution([b"hello", b""], torch.tensor([0.5, 0.5]), c) is None  # nothing allowed: keep draft
    # a single-token candidate is read off the mask: the two checks agree
    allowed = c.allowed()
    sample = [d.token_bytes[i] for i in range(0, d.vocab.size, 211) if d.token_bytes[i]]
    assert c.allows_strings(sample).tolist() == [bool(allowed[d.vocab.id_of_bytes[s]]) for s in sample]
    assert [c.allows_text(s) for s in sample[:300]] == c.allows_strings(sample[:300]).tolist()


def test_a_candidates_table_checks_the_whole_gac_union_like_a_list():
    qwen, llama = drafter(QWEN), drafter(LLAMA)
    union = list(dict.fromkeys([b"", *(b for d in (qwen, llama) for b in d.token_bytes if b)]))  # as UnionVocab
    table = Candidates(union, qwen)
    assert len(table.multi_at) > 1000, "Llama-2 pieces that are not one Qwen token"
    rng = np.random.default_rng(0)
    for prefix in ['{"name": "', '{"name": "x", "age": ', '{"name": "x", "age": 3, "address": {"city": "K"}}']:
        c = Constraint(Grammar.json_schema(PERSON), qwen)
        c.consume(ids_of(QWEN, prefix))
        probs = torch.from_numpy(rng.random(len(union)) * (rng.random(len(union)) < 0.8))
        fast = mask_distribution(table, probs, c)
        sample = rng.choice(len(union), 400, replace=False).tolist() + table.multi_at[:200].tolist() + [0]
        slow = c.allows_strings([union[i] for i in sample])
        assert slow.tolist() == [c.can_stop() if i == 0 else c.allows_text(union[i]) for i in sample]
        assert ((fast[sample] > 0).numpy() == (slow & (probs[sample] > 0).numpy())).all()
        assert abs(float(fast.sum()) - 1) < 1e-9


@pytest.mark.parametrize("name", ["gpt2", "mistral-7b-instruct-v0.3", "gpt-neox-20b", "exaone-3.5"])
def test_other_tokenizer_families(name):
    tok = tokenizer(name)
    vocab = Vocab(tok)
    d = SimpleNamespace(vocab=vocab, token_bytes=vocab.token_bytes, eos_ids=frozenset({tok.eos_token_id}))
    rng = random.Random(11)
    for schema in (PERSON, STATUS, ITEMS):
        c = Constraint(Grammar.json_schema(schema), d)
        for _ in range(200):
            if c.can_stop():
                break
            allowed = np.flatnonzero(c.allowed())
            shut = [t for t in (vocab.id_of_bytes.get(x) for x in CLOSERS) if t is not None and c.allowed()[t]]
            c.consume([rng.choice(shut) if shut and rng.random() < len(c.ids) / 30 else int(rng.choice(allowed))])
        validate(json.loads(b"".join(d.token_bytes[i] for i in c.ids).decode()), schema)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert Constraint(Grammar.tool_calls(TOOLS, "required"), d).allows(vocab.encode(call.encode())[0])


# -- sharing, speed, a real Member -----------------------------------------------------------------------
def test_compiled_once_forked_cheaply_and_independent():
    d = drafter(QWEN)
    grammar = Grammar.json_schema(ITEMS)
    Constraint(grammar, d)
    start = time.perf_counter()
    many = [Constraint(grammar, d) for _ in range(20)]
    assert time.perf_counter() - start < 1.0, "per-request constraints copy one compiled grammar"
    many[0].consume(ids_of(QWEN, '[{"id": 1'))
    twin = many[0].fork()
    twin.consume(ids_of(QWEN, ', "label": null}]'))
    assert twin.must_stop() and not many[0].can_stop() and many[1].ids == []
    assert many[0].ids == ids_of(QWEN, '[{"id": 1')


def test_a_real_member_is_a_drafter_vocabulary():
    member = tiny_member(LLAMA, 4)
    c = Constraint(Grammar.json_object(), member)
    ids = member.prompt_ids("Answer in JSON:")
    logits = member.forward(ids, member.new_cache())[-1]
    masked = c.mask_logits(logits)
    tid = int(torch.argmax(masked))
    assert member.token_bytes[tid].startswith(b"{")
    c.consume([tid])
    assert c.ids == [tid]


# -- strict structured output ----------------------------------------------------------------------------
def cli_options(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser()
    add_request_args(parser)
    return request_options(parser.parse_args(argv))


def test_strict_closes_every_object_that_does_not_say_otherwise():
    point = {"properties": {"x": {"type": "integer"}}}  # an object by its properties, no "type"
    schema = {
        "type": "object",
        "properties": {
            "address": {"type": "object", "properties": {"zip": {"type": "string"}}},
            "rows": {"type": "array", "items": {"type": ["object", "null"], "properties": {"n": {"type": "integer"}}}},
            "either": {"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}]},
            "open": {"type": "object", "additionalProperties": True},
            "typed": {"type": "object", "additionalProperties": {"type": "object"}},
            "label": {"type": "string"},
        },
        "$defs": {"Point": point},
        "not": {"type": "object", "properties": {"forbidden": {}}, "required": ["forbidden"]},
        "allOf": [{"type": "object", "properties": {"extra": {"type": "integer"}}}],
        "if": {"properties": {"label": {"const": "zip"}}},
        "then": {"properties": {"address": {"required": ["zip"]}}},
        "else": {"properties": {"rows": {"minItems": 1}}},
    }
    closed = strict(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["address"]["additionalProperties"] is False
    assert props["rows"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["Point"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True  # said by the schema: kept
    assert props["typed"]["additionalProperties"] == {"type": "object", "additionalProperties": False}
    assert "additionalProperties" not in props["label"]
    # `not`, `allOf`, `if`, `then` and `else` describe the same object: closing them would change what matches
    # (a closed `then` would refuse the parent's "label" whenever the `if` holds)
    assert all(closed[key] == schema[key] for key in ("not", "allOf", "if", "then", "else"))
    assert "additionalProperties" not in schema and "additionalProperties" not in point  # a copy


@pytest.mark.parametrize("name", [QWEN])
def test_structured_output_refuses_keys_the_schema_does_not_name_unless_strict_is_false(name):
    class City(BaseModel):
        name: str = Field(max_length=12)

    user = [{"role": "user", "content": "A city?"}]
    spec = {"name": "city", "schema": City.model_json_schema()}
    cases = [
        ({"json_schema": City}, False),
        ({"json_schema": City.model_json_schema()}, False),
        ({"response_format": {"type": "json_schema", "json_schema": spec}}, False),
        ({"response_format": {"type": "json_schema", "json_schema": {**spec, "strict": True}}}, False),
        ({"response_format": {"type": "json_schema", "json_schema": {**spec, "strict": False}}}, True),
        (cli_options(["--json-schema", json.dumps(City.model_json_schema())]), False),  # the CLI's door
    ]
    for kwargs, extra_keys in cases:
        request = build_request(messages=user, **kwargs)
        assert request.json_schema is not None
        assert request.json_schema.get("additionalProperties", True) is extra_keys, kwargs
        constraint = Constraint(request.grammar, drafter(name))
        assert constraint.allows_text(b'{"name": "Oslo"}'), kwargs
        assert constraint.allows_text(b'{"name": "Oslo", "country"') is extra_keys, kwargs
    with pytest.raises(ConfigError, match="strict must be true or false"):
        build_request(messages=user, response_format={"type": "json_schema", "json_schema": {**spec, "strict": "yes"}})
