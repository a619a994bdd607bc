"""Next-token distributions as the decoder reads them.

The decoder never needs a whole vocabulary-sized tensor by itself: it asks a distribution for its best
tokens, for the log-probability of a few ids, or for a sample. `Row` is that interface; `LocalRow` answers
from a tensor in this process. A member living elsewhere (a Ray actor) answers the same questions
remotely, so only top-k lists and a handful of probabilities cross the wire.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Row(Protocol):
    """One member's next-token distribution (log-probabilities after temperature / top-p)."""

    def logprob(self, ids: Sequence[int]) -> torch.Tensor: ...

    def argmax(self) -> int: ...

    def top(self, k: int) -> list[int]: ...

    def sample(self, generator: torch.Generator) -> int: ...

    def full(self) -> torch.Tensor: ...


def next_token_logprobs(
    logits: torch.Tensor, do_sample: bool, temperature: float = 1.0, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probabilities per row of `logits`; temperature and top-p apply to every member alike."""
    if not do_sample:
        return torch.log_softmax(logits, dim=-1)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
        outside = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp() >= top_p
        logprobs = logprobs.scatter(-1, order, sorted_lp.masked_fill(outside, float("-inf")))
        logprobs = torch.log_softmax(logprobs, dim=-1)
    return logprobs


class LocalRow:
    """A distribution held as a full log-probability tensor in this process."""

    def __init__(self, logprobs: torch.Tensor) -> None:
        self.values = logprobs

    def logprob(self, ids: Sequence[int]) -> torch.Tensor:
        return self.values[list(ids)]

    def argmax(self) -> int:
        return int(torch.argmax(self.values))

    def top(self, k: int) -> list[int]:
        return torch.topk(self.values, min(k, self.values.shape[0])).indices.tolist()

    def sample(self, generator: torch.Generator) -> int:
        return int(torch.multinomial(self.values.exp(), 1, generator=generator))

    def full(self) -> torch.Tensor:
        return self.values
