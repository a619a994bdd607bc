"""Per-member chat templates.

Each member renders the conversation with its *own* template, so every model sees the control tokens
it was trained on. Message contents are always tokenized as plain text: a user who types `<|im_end|>`
gets those characters, not a control token. To get there, the template is rendered with placeholders
for the contents; the template's own text is tokenized with control tokens recognised, the contents
with control tokens split. Tools and the history's tool calls are shaped for each template by
`tools.template_messages`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ChatTemplateError, InputError, InputTypeError
from ..runtime.members import Member
from ..runtime.vocab import tokenizer_lock
from .tools import template_messages

_PLACEHOLDER = "\x00safe-content-{}\x00"
_PLACEHOLDER_RE = re.compile("\x00safe-content-(\\d+)\x00")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the OpenAI-style message list early, with messages that say what is wrong."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise InputTypeError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise InputError("messages is empty; pass at least one {'role': 'user', 'content': ...} message")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise InputTypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {message!r:.80}")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise InputTypeError(f"messages[{i}]['content'] must be a string, got {type(content).__name__}")
        if content:
            check_text(content, f"messages[{i}]['content']")
        checked.append(dict(message))
    return checked


def check_text(text: str, what: str) -> None:
    """Refuse a str that is not valid Unicode (a lone surrogate such as "\\ud800", e.g. from bytes decoded
    with errors="surrogateescape"): tokenizers would fail on it with an unrelated TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InputError(
            f"{what} contains an unpaired surrogate {text[err.start]!r} at index {err.start}, which is not valid "
            "Unicode text; decode the source bytes with errors='replace' or remove it"
        ) from None


def chat_prompt_ids(
    member: Member, messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> list[int]:
    """Token ids of the conversation rendered by the member's template, ready for the assistant's turn."""
    if not member.chat_template:
        raise ChatTemplateError(
            f"member {member.name!r} has no chat template; pass a plain-text prompt instead, or give it one "
            "with ModelSpec(chat_template=...) / Member(..., chat_template=...)"
        )
    messages, tools = template_messages(messages, tools, member.chat_template)  # tools=None: in the messages
    contents = [m.get("content") or "" for m in messages]
    masked = [{**m, "content": _PLACEHOLDER.format(i)} if m.get("content") else m for i, m in enumerate(messages)]
    rendered = member.tokenizer.apply_chat_template(
        masked, tools=tools or None, chat_template=member.chat_template, tokenize=False, add_generation_prompt=True
    )
    # The first piece is encoded as the start of a sequence (SentencePiece dummy prefix included, as when
    # the whole string is encoded); later pieces continue it.
    pieces = _PLACEHOLDER_RE.split(rendered)  # template, content index, template, content index, ...
    with tokenizer_lock(member.tokenizer):
        ids: list[int] = list(member.tokenizer(pieces[0], add_special_tokens=False)["input_ids"])
    for i in range(1, len(pieces), 2):
        ids += member.vocab.encode_text(contents[int(pieces[i])])
        ids += member.vocab.encode_text(pieces[i + 1], control_tokens=True)
    return ids
