"""Penalties and a logit bias on one member's logits, position by position, in its own token space.

Why here, below the decoder: every row any member scores (the drafter's drafting rows, a verifier's rows
over several drafted positions in one forward) passes through `Member.score_many`, so penalising there
makes SAFE an ensemble of members that each decode with the penalty. A forward that keeps K rows scores K
positions, and the row at each position is penalised with the counts of the tokens *before* it, as a model
generating alone would see them.

Definitions (as the APIs that named them):
- frequency / presence penalty (OpenAI): over the generated tokens, logit[t] -= c[t] * frequency + (c[t] > 0)
  * presence, c[t] being t's count among the member's own tokens of the generated text;
- repetition penalty (transformers, vLLM): over prompt + generated tokens, a seen token's logit is divided
  by the penalty when positive, multiplied by it otherwise;
- logit bias (OpenAI): a number added to a token's logit (the drafter's, see `Generation`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def _counts(
    history: Sequence[int], start: int, first: int, rows: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The distinct ids of `history[start:]` (inside the vocabulary) and [rows, len(ids)] their counts before
    each row's position: row r sees `history[start : first + r]`. Only ids that occur are counted, so the cost
    follows the text's length, not the vocabulary's (a dense [rows, 152k] count cost 25 ms for 6 rows)."""
    ids = torch.tensor(list(history[start:]), dtype=torch.long)
    positions = torch.arange(start, len(history))
    inside = ids < vocab
    ids, positions = ids[inside], positions[inside]
    if ids.numel() == 0:
        return None
    distinct, which = torch.unique(ids, return_inverse=True)
    before = positions < first
    counts = torch.bincount(which[before], minlength=distinct.numel()).to(torch.float32).repeat(rows, 1)
    later = ~before
    from_row = positions[later] - first + 1  # a token at position p counts for the rows after it
    shown = from_row < rows
    if bool(shown.any()):
        steps = torch.zeros(rows, distinct.numel())
        steps.index_put_((from_row[shown], which[later][shown]), torch.ones(int(shown.sum())), accumulate=True)
        counts += torch.cumsum(steps, dim=0)
    return distinct.to(device), counts.to(device)


def penalize(
    logits: torch.Tensor,
    history: Sequence[int],
    prompt_len: int,
    frequency: float = 0.0,
    presence: float = 0.0,
    repetition: float = 1.0,
    bias: Mapping[int, float] | None = None,
) -> torch.Tensor:
    """`logits` [K, V] of the last K positions of `history` (prompt + generated ids, `prompt_len` of them the
    prompt), each penalised with the counts before its position, then biased."""
    rows, vocab = logits.shape
    first = len(history) - rows + 1  # ids the first row has seen
    out = logits.float()
    if repetition != 1.0 and (seen := _counts(history, 0, first, rows, vocab, out.device)) is not None:
        ids, counts = seen
        out = out.clone() if out is logits else out
        part = out[:, ids]
        penalised = torch.where(part > 0, part / repetition, part * repetition)
        out[:, ids] = torch.where(counts > 0, penalised, part)
    if (frequency != 0.0 or presence != 0.0) and (
        generated := _counts(history, prompt_len, first, rows, vocab, out.device)
    ) is not None:
        ids, counts = generated
        out = out.clone() if out is logits else out
        out[:, ids] -= counts * frequency + (counts > 0).to(out.dtype) * presence
    if bias:
        ids_in = [i for i in bias if i < vocab]
        if ids_in:
            index = torch.tensor(ids_in, dtype=torch.long, device=out.device)
            values = torch.tensor([bias[i] for i in ids_in], dtype=out.dtype, device=out.device)
            out = out.clone() if out is logits else out
            out[:, index] += values
    return out
