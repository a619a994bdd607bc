"""safe_engine.shaping.tools: tools shown to each member's template, tool calls read back from the verified text,
and the streaming hold-back. Pure functions, plus real templates from ../shared/tokenizers."""

from __future__ import annotations

import json

import pytest

from safe_engine.errors import ConfigError, InputError, InputTypeError
from safe_engine.shaping.chat import chat_prompt_ids
from safe_engine.shaping.tools import (
    ToolCallHoldback,
    new_tool_call_id,
    normalize_tool_choice,
    parse_tool_calls,
    template_messages,
    template_renders_tools,
    with_tool_choice,
)
from tests.conftest import tiny_member, tokenizer


def _schema(name: str, description: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }


TOOLS = [_schema("multiply", "Multiply two integers a and b."), _schema("add", "Add two integers a and b.")]


# -- parsing ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (
            '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
            "",
            [("multiply", {"a": 2, "b": 3})],
        ),
        (  # several calls, text before them, arguments as a JSON string
            'Let me compute.\n<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}</tool_call>',
            "Let me compute.\n",
            [("multiply", {"a": 2, "b": 3}), ("add", {"a": 1, "b": 1})],
        ),
        ('{"name": "multiply", "arguments": {"a": 2, "b": 3}}', "", [("multiply", {"a": 2, "b": 3})]),
        ('```json\n{"name": "add", "parameters": {"a": 1, "b": 2}}\n```', "", [("add", {"a": 1, "b": 2})]),
        (
            '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "multiply", "arguments": {"a": 3, "b": 4}}]',
            "",
            [("add", {"a": 1, "b": 2}), ("multiply", {"a": 3, "b": 4})],
        ),
        ('<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}', "", [("multiply", {"a": 2, "b": 3})]),
        (  # text around an untagged call
            'The value of multiply(2, 3) is {"name": "multiply", "arguments": {"a": 2, "b": 3}}.',
            "The value of multiply(2, 3) is .",
            [("multiply", {"a": 2, "b": 3})],
        ),
        (
            'Here:\n```json\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n```\nDone.',
            "Here:\n\nDone.",
            [("multiply", {"a": 2, "b": 3})],
        ),
        (
            '{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}',
            "",
            [("add", {"a": 1, "b": 2})],
        ),
        # cut off by the token limit: closing the brackets completes it
        ('{"name": "multiply", "arguments": {"a": 2, "b": 3}', "", [("multiply", {"a": 2, "b": 3})]),
        ('<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3},', "", [("multiply", {"a": 2, "b": 3})]),
        ('Data: {"name": "multiply", "colour": "red"}', 'Data: {"name": "multiply", "colour": "red"}', []),
        ("The answer is {a: 1}.", "The answer is {a: 1}.", []),
    ],
)
def test_parse_tool_calls(text, content, calls):
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.content == content
    assert [(c["name"], c["arguments"]) for c in parsed.tool_calls] == calls
    assert not parsed.invalid
    assert all(set(c) == {"id", "name", "arguments"} and c["id"].startswith("call_") for c in parsed.tool_calls)


def test_without_tools_or_with_tool_choice_none_it_is_all_content():
    text = '<tool_call>{"name": "multiply", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, None).content == text
    assert parse_tool_calls(text, []).tool_calls == []
    assert parse_tool_calls(text, TOOLS, "none").content == text


@pytest.mark.parametrize(
    ("text", "name", "error"),
    [
        ("<tool_call>{not json}</tool_call>", None, "invalid JSON"),
        ('<tool_call>{"name": "multiply", "arguments": {"a": 2,</tool_call>', "multiply", "invalid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', None, "name"),
        ('<tool_call>{"name": "multiply", "arguments": [1, 2]}</tool_call>', "multiply", "JSON object"),
        ('<tool_call>{"name": "multiply", "arguments": "{oops"}</tool_call>', "multiply", "not valid JSON"),
        ('<tool_call>["multiply"]</tool_call>', None, "JSON object"),
        ('{"name": "multiply", "arguments": {"a": "tw', "multiply", "invalid JSON"),  # cut inside a string
        # a copy of the schema, cut inside a string: the whole wrapper goes, not just the inner object
        ('{"type": "function", "function": {"name": "multiply", "parameters": {"a": "tw', "multiply", "invalid JSON"),
        ('{"name": "hello", "arguments": {"message": "Hi"}}', "hello", "unknown tool 'hello'"),  # untagged, unbound
    ],
)
def test_malformed_calls_are_invalid_calls_with_the_reason(text, name, error):
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.tool_calls == [] and parsed.content == ""
    (bad,) = parsed.invalid
    assert set(bad) == {"id", "name", "arguments", "error"}
    assert bad["name"] == name and error in bad["error"] and bad["arguments"]


def test_a_stray_brace_after_a_valid_call_stays_text():
    parsed = parse_tool_calls('{"name": "multiply", "arguments": {"a": 2}} }', TOOLS)
    assert [c["name"] for c in parsed.tool_calls] == ["multiply"] and parsed.content == " }"


def test_one_required_tool_accepts_bare_arguments():
    one = TOOLS[:1]
    parsed = parse_tool_calls('{"a": 2, "b": 3}', one, "multiply")
    assert [(c["name"], c["arguments"]) for c in parsed.tool_calls] == [("multiply", {"a": 2, "b": 3})]
    assert parse_tool_calls('{"a": 2, "b": 3}', one, "required").tool_calls[0]["name"] == "multiply"
    assert parse_tool_calls('{"a": 2}', one, "multiply").tool_calls == []  # "b" is required
    assert parse_tool_calls('{"a": 2, "b": 3}', one).tool_calls == []  # not required: just text
    assert parse_tool_calls('{"a": 2, "b": 3}', TOOLS, "required").tool_calls == []  # which tool? unknown
    # a value where the tool name belongs, arguments that fit the required tool
    misnamed = '{"name": "Acme", "arguments": {"a": 2, "b": 3}}'
    parsed = parse_tool_calls(misnamed, one, "multiply")
    assert [(c["name"], c["arguments"]) for c in parsed.tool_calls] == [("multiply", {"a": 2, "b": 3})]
    assert parse_tool_calls(misnamed, one).invalid[0]["error"].startswith("unknown tool 'Acme'")


def test_ids_are_unique_and_first_call_only():
    text = "".join(f'<tool_call>{{"name": "add", "arguments": {{"a": {i}, "b": 1}}}}</tool_call>' for i in range(50))
    parsed = parse_tool_calls(text + "<tool_call>{bad}</tool_call>", TOOLS)
    ids = [c["id"] for c in parsed.tool_calls + parsed.invalid]
    assert len(parsed.tool_calls) == 50 and len(set(ids)) == 51
    assert len({new_tool_call_id() for _ in range(1000)}) == 1000
    first = parsed.first_call_only()
    assert first.tool_calls == parsed.tool_calls[:1] and first.invalid == []


# -- streaming hold-back ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    [
        "Plain answer with no call.",
        'Sure.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
        '\n\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
        '{"name": "multiply", "arguments": {"a": 2, "b": 3}}',
        "Text with a < sign and <tool_c but no call",
        "<tool_call>{broken</tool_call> trailing words",
        'The value is {"name": "multiply", "arguments": {"a": 2, "b": 3}}. Done.',
        'Code:\n```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```',
        'A list: [{"name": "add", "arguments": {"a": 1, "b": 2}}]',
        "Braces {like this} in prose",
        "Ends in a partial tag <tool_",
    ],
)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_holdback_never_shows_a_call_and_shows_a_prefix_of_the_content(text, step):
    holdback = ToolCallHoldback(TOOLS)
    out = "".join(holdback.feed(text[i : i + step]) for i in range(0, len(text), step))
    assert "<tool_call" not in out and "{" not in out and "[" not in out and "`" not in out
    tail = holdback.flush()
    assert out + tail == holdback.parsed.content == parse_tool_calls(text, TOOLS).content


def test_holdback_never_shows_any_prefix_of_the_tag():
    text = 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    holdback = ToolCallHoldback(TOOLS)
    shown = "".join(holdback.feed(ch) for ch in text)
    assert shown == "Sure. "  # not even "<" or "<tool" reached the stream
    assert holdback.flush() == "" and holdback.parsed.tool_calls[0]["arguments"] == {"a": 1, "b": 2}


def test_holdback_passes_everything_without_tools():
    for tools, choice in ((None, "auto"), (TOOLS, "none")):
        holdback = ToolCallHoldback(tools, choice)
        assert holdback.feed("<tool_call>{") == "<tool_call>{"
        assert holdback.flush() == "" and holdback.parsed.tool_calls == []


# -- tool choice -----------------------------------------------------------------------------------------
def test_normalize_tool_choice():
    assert [normalize_tool_choice(c, TOOLS) for c in (None, False, "auto", "none")] == ["auto", "auto", "auto", "none"]
    assert [normalize_tool_choice(c, TOOLS) for c in (True, "any", "required")] == ["required"] * 3
    assert normalize_tool_choice({"type": "function", "function": {"name": "add"}}, TOOLS) == "add"
    assert normalize_tool_choice({"name": "multiply"}, TOOLS) == "multiply"
    with pytest.raises(ConfigError, match=r"not a bound tool; bound tools: \['multiply', 'add'\]"):
        normalize_tool_choice("divide", TOOLS)
    with pytest.raises(ConfigError, match="names no tool"):
        normalize_tool_choice({"type": "function"}, TOOLS)


def test_with_tool_choice():
    messages = [{"role": "user", "content": "2*3?"}]
    assert with_tool_choice(messages, TOOLS, "auto") == (messages, TOOLS)
    assert with_tool_choice(messages, TOOLS, "none") == (messages, None)
    forced, tools = with_tool_choice([{"role": "system", "content": "Be exact."}, *messages], TOOLS, "multiply")
    assert tools == TOOLS and forced[0] == {
        "role": "system",
        "content": 'Be exact.\n\nYou must call the tool "multiply". Reply with only the tool call, no other text.',
    }
    anyone, _ = with_tool_choice(messages, TOOLS, "required")
    assert anyone[0]["content"].startswith("You must call one of the tools.") and anyone[1:] == messages
    single, _ = with_tool_choice(messages, TOOLS[:1], "required")
    assert 'call the tool "multiply"' in single[0]["content"]


def test_bad_tools_say_what_to_do():
    with pytest.raises(InputTypeError, match="tools must be a list"):
        parse_tool_calls("x", {"name": "add"})
    with pytest.raises(InputTypeError, match=r"tools\[0\] must be a JSON schema with a name"):
        parse_tool_calls("x", [{"description": "no name"}])


# -- each member's template ------------------------------------------------------------------------------
def test_template_support_is_read_from_the_variables_it_uses():
    assert template_renders_tools(tokenizer("qwen2.5-7b-instruct").chat_template)
    assert template_renders_tools(tokenizer("mistral-7b-instruct-v0.3").chat_template)
    assert not template_renders_tools(tokenizer("exaone-3.5").chat_template)
    commented = "{# tools are not supported #}{% for m in messages %}{{ m.content }} tools{% endfor %}"
    assert not template_renders_tools(commented)  # the old \btools\b regex said yes
    own = (
        "{% set tools = [] %}{% for t in tools %}{{ t }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    assert not template_renders_tools(own)  # it defines `tools` itself: ours would be ignored
    tracked = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}{{ tools }}"
    assert template_renders_tools(tracked)  # transformers' {% generation %} tag parses


def test_template_messages_shape_the_history_for_each_template():
    call_id = new_tool_call_id()
    history = [
        {"role": "user", "content": "2*3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "multiply", "arguments": '{"a": 2}'}}
            ],
        },
        {"role": "tool", "content": "6", "tool_call_id": call_id},
    ]
    qwen = tokenizer("qwen2.5-7b-instruct").chat_template
    messages, tools = template_messages(history, TOOLS, qwen)
    assert tools == TOOLS and messages[0] == history[0]
    (call,) = messages[1]["tool_calls"]
    assert call["function"]["arguments"] == {"a": 2}  # a dict, as templates read it
    assert call["id"] == messages[2]["tool_call_id"] and len(call["id"]) == 9 and call["id"].isalnum()
    # The engine's own result shape ({"id", "name", "arguments"}) goes back into the history as it is.
    flat = [{**history[1], "tool_calls": [{"id": call_id, "name": "multiply", "arguments": {"a": 2}}]}]
    assert template_messages(flat, None, qwen)[0][0]["tool_calls"] == [call]

    exaone = tokenizer("exaone-3.5").chat_template
    messages, tools = template_messages(history, TOOLS, exaone)
    assert tools is None and messages[0]["role"] == "system" and '"multiply"' in messages[0]["content"]
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>{"name": "multiply", "arguments": {"a": 2}}</tool_call>',
    }
    with pytest.raises(InputError, match=r"messages\[0\]\['tool_calls'\]\[0\]: arguments are not valid JSON"):
        template_messages(
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}], None, qwen
        )


def test_tools_reach_each_members_prompt():
    """Qwen renders the schemas itself; EXAONE's template ignores tools, so they go in its system message."""
    msgs = [{"role": "user", "content": "What is 2*3?"}]
    qwen = tokenizer("qwen2.5-7b-instruct").decode(chat_prompt_ids(tiny_member("qwen2.5-7b-instruct", 1), msgs, TOOLS))
    exaone = tokenizer("exaone-3.5").decode(chat_prompt_ids(tiny_member("exaone-3.5", 2), msgs, TOOLS))
    assert "<tools>" in qwen and '"multiply"' in qwen
    assert '"multiply"' in exaone and "<tool_call>" in exaone
    assert exaone.index('"multiply"') < exaone.index("What is 2*3?")
    json.dumps(TOOLS)  # the schemas are plain JSON
