"""OpenAI's (legacy) Completions API (`POST /v1/completions`): its prompts read into the engine's text.

Why a module of its own: a completions request may send several prompts, or token ids in place of text;
each prompt becomes text here (ids decoded with the drafter's tokenizer), and each is one engine request.
"""

from __future__ import annotations

from typing import Any

from ..engine.ensemble import Ensemble
from ..runtime.vocab import tokenizer_lock
from .schemas import CompletionRequest, RequestError, parse_request
from .state import drafter_name


def parse(body: dict[str, Any]) -> CompletionRequest:
    """The request, validated (a field the server cannot honour is a 400 naming it)."""
    req = parse_request(CompletionRequest, body)
    assert isinstance(req, CompletionRequest)
    return req


def prompts(prompt: str | list[str] | list[int] | list[list[int]], ens: Ensemble) -> list[str]:
    """A completions request's prompts as text: token ids are the drafter's, decoded with its tokenizer."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError(400, "prompt is an empty list; send a string or a list of strings", param="prompt")
    if isinstance(prompt[0], int):
        return [_decode(prompt, ens, "prompt")]
    if isinstance(prompt[0], list):
        return [_decode(ids, ens, f"prompt[{i}]") for i, ids in enumerate(prompt)]
    return prompt


def _decode(ids: list[int], ens: Ensemble, param: str) -> str:
    tokenizer = ens.drafter.tokenizer
    size = len(tokenizer)
    bad = next((t for t in ids if not 0 <= t < size), None)
    if bad is not None:
        raise RequestError(
            400,
            f"{param} holds token id {bad}, outside the drafter's vocabulary (0..{size - 1}); token-id prompts are "
            f"in the drafter's ({drafter_name(ens)}) tokenization",
            param=param,
            code="invalid_value",
        )
    with tokenizer_lock(tokenizer):
        text = tokenizer.decode(ids, skip_special_tokens=True)  # each member adds its own BOS when it encodes
    if not text:
        raise RequestError(400, f"{param} decodes to no text", param=param, code="invalid_value")
    return str(text)
