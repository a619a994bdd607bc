"""Constrained decoding across the ensemble, end to end on tiny random models (whose free text is noise,
which makes the constraint visible): every output follows the schema or the tool-call grammar whichever
member proposed it, for every method and aggregation, greedy and sampled; sampling stays exact."""

from __future__ import annotations

import json
from collections import Counter

import jsonschema
import pytest

from safe_engine import ConfigError, Ensemble
from safe_engine.shaping.constrained import Constraint, Grammar
from tests.conftest import tiny_member
from tests.unit.test_sampling import (
    DRAWS,
    PROMPT,
    TEMPERATURE,
    by_text,
    chi_square_p,
    decided,
    draws,
    next_token_probs,
    unite_target,
)

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "note": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "maximum": 999}, "b": {"type": "integer", "maximum": 999}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
ADD = {**MULTIPLY, "function": {**MULTIPLY["function"], "name": "add", "description": "Add two integers."}}
VARIANTS = [
    (method, aggregation, sample)
    for method in ("safe", "every_token", "single")
    for aggregation in ("unite", "gac")
    for sample in (False, True)
]  # 12, times 2 member sets times 3 prompts: 72 generations per grammar


@pytest.fixture(scope="module")
def ensembles() -> list[Ensemble]:
    qwen = tiny_member("qwen2.5-7b-instruct", 1)
    llama = tiny_member("llama2", 2, chat_template=TEMPLATE)
    gpt2 = tiny_member("gpt2", 3, chat_template=TEMPLATE)
    return [Ensemble([qwen, llama]), Ensemble([qwen, llama, gpt2])]


def generations(ensembles, **request):
    """Each ensemble's 36 requests (3 prompts x VARIANTS), decoded together: each under its own grammar."""
    for ens in ensembles:
        yield from ens.generate_batch(
            [
                ens.request(
                    messages=[{"role": "user", "content": prompt}],
                    method=method,
                    aggregation=aggregation,
                    do_sample=sample,
                    seed=k,
                    max_new_tokens=400,
                    **request,
                )
                for k, prompt in enumerate(("Give me a person.", "Who are you?", "Pick one."))
                for method, aggregation, sample in VARIANTS
            ]
        )


def test_every_output_under_a_json_schema_is_valid_json_of_it(ensembles):
    count = 0
    for res in generations(ensembles, json_schema=SCHEMA):
        assert res.finish_reason == "eos", res.text  # the grammar ends it once the object is complete
        jsonschema.validate(json.loads(res.text), SCHEMA)
        count += 1
    assert count == 72


def test_required_tool_calls_always_parse_and_fit_the_tools(ensembles):
    count = 0
    for res in generations(ensembles, tools=[MULTIPLY, ADD], tool_choice="required", parallel_tool_calls=False):
        assert res.finish_reason == "eos" and len(res.tool_calls) == 1 and not res.invalid_tool_calls, res.text
        (call,) = res.tool_calls
        assert call["name"] in ("multiply", "add") and call["id"].startswith("call_")
        jsonschema.validate(call["arguments"], MULTIPLY["function"]["parameters"])
        assert res.content == ""
        count += 1
    assert count == 72


def test_a_named_tool_is_the_one_called_and_none_never_calls(ensembles):
    ens = ensembles[1]
    messages = [{"role": "user", "content": "Compute something."}]
    for sample in (False, True):
        named = ens.generate(messages=messages, tools=[MULTIPLY, ADD], tool_choice="add", do_sample=sample, seed=3)
        assert [c["name"] for c in named.tool_calls] == ["add"] and not named.invalid_tool_calls
        none = ens.generate(messages=messages, tools=[MULTIPLY, ADD], tool_choice="none", do_sample=sample, seed=3)
        assert none.tool_calls is None and "<tool_call>" not in none.text  # the tools are not even shown
    auto = ens.generate(messages=messages, tools=[MULTIPLY], max_new_tokens=60)
    assert auto.tool_calls is not None and not auto.invalid_tool_calls  # free text or valid calls


def test_streaming_under_a_grammar_equals_generate(ensembles):
    ens = ensembles[0]
    options = {"messages": [{"role": "user", "content": "Hi"}], "json_schema": SCHEMA, "max_new_tokens": 400}
    stream = ens.stream(**options)
    assert "".join(stream) == ens.generate(**options).text == stream.result.text


def test_bad_constraint_requests_are_clear_errors(ensembles):
    ens = ensembles[0]
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ConfigError, match="cannot be combined"):
        ens.generate(messages=messages, tools=[MULTIPLY], tool_choice="required", json_schema=SCHEMA)
    with pytest.raises(ConfigError, match="not a bound tool"):
        ens.generate(messages=messages, tools=[MULTIPLY], tool_choice="divide")
    with pytest.raises(ConfigError, match="parallel_tool_calls"):
        ens.generate(messages=messages, tools=[MULTIPLY], parallel_tool_calls="no")


# -- sampling stays exact under the mask ---------------------------------------------------------------------
WORDS = Grammar.lark("start: /[ a-z]+/")  # lower-case words: tiny models' tokens are partly allowed, partly not


@pytest.fixture(scope="module")
def pair():
    return tiny_member("gpt2", 5), tiny_member("llama2", 6)


def masked_run(ens, **options) -> Counter:
    return Counter(r.text for r in draws(ens, range(DRAWS), grammar=WORDS, **options))


def test_safe_sampling_under_a_grammar_emits_the_masked_ensemble_distribution(pair):
    """The decided string follows the masked P_ens (the drafter then spells it its own way, within the
    grammar: token healing, see test_sampling)."""
    drafter, _ = pair
    allowed = Constraint(WORDS, drafter)
    target = {s: p for s, p in unite_target(pair, PROMPT).items() if s and allowed.allows_text(s)}
    total = sum(target.values())
    ens = Ensemble(list(pair))
    counts: Counter = Counter()
    for res in draws(ens, range(DRAWS), grammar=WORDS, temperature=TEMPERATURE, trace=True):
        pick = decided(res)
        assert res.text.startswith(pick) or pick.startswith(res.text)
        assert allowed.allows_text(res.text.encode())  # the healed token is within the grammar too
        counts[pick] += 1
    assert chi_square_p(counts, by_text({s: p / total for s, p in target.items()}), DRAWS) > 0.01


def test_single_sampling_under_a_grammar_follows_the_masked_drafter(pair):
    drafter, _ = pair
    allowed = Constraint(WORDS, drafter).allowed()
    probs = next_token_probs(drafter, PROMPT, 1.0)
    expected: Counter = Counter()
    for tid in range(len(allowed)):
        if allowed[tid] and probs[tid] > 0:
            expected[drafter.token_bytes[tid].decode(errors="replace")] += float(probs[tid])
    total = sum(expected.values())
    counts = masked_run(Ensemble(list(pair)), method="single")
    assert chi_square_p(counts, {k: v / total for k, v in expected.items()}, DRAWS) > 0.01
