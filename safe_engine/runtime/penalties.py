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
) -> torch.Tensor:
    """[rows, vocab] counts of the ids of `history[start:]` before each row's position: row r sees the ids
    `history[start : first + r]` (ids outside the vocabulary are not counted)."""
    ids = torch.tensor(list(history[start:]), dtype=torch.long, device=device)
    valid = ids < vocab
    base_n = max(0, first - start)
    base = torch.bincount(ids[:base_n][valid[:base_n]], minlength=vocab)[:vocab].to(torch.float32)
    counts = base.unsqueeze(0).repeat(rows, 1)
    steps = ids[base_n:]  # the ids from row 0's position on: row r sees those before it
    if steps.numel():
        increments = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        r = torch.arange(1, steps.numel() + 1, device=device) + max(0, start - first)
        keep = valid[base_n:] & (r < rows)
        increments[r[keep], steps[keep]] = 1.0
        counts += torch.cumsum(increments, dim=0)
    return counts


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
    if repetition != 1.0:
        seen = _counts(history, 0, first, rows, vocab, out.device) > 0
        out = torch.where(seen, torch.where(out > 0, out / repetition, out * repetition), out)
    if frequency != 0.0 or presence != 0.0:
        counts = _counts(history, prompt_len, first, rows, vocab, out.device)
        out = out - counts * frequency - (counts > 0).to(out.dtype) * presence
    if bias:
        ids = [i for i in bias if i < vocab]
        if ids:
            index = torch.tensor(ids, dtype=torch.long, device=out.device)
            values = torch.tensor([bias[i] for i in ids], dtype=out.dtype, device=out.device)
            out = out.clone() if out is logits else out
            out[:, index] += values
    return out
