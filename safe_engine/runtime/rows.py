"""Next-token distributions as the decoder reads them.

The decoder never needs a whole vocabulary-sized tensor by itself: it asks a distribution for its best
tokens, for the log-probability of a few ids, or for a sample. `Row` is that interface; `LocalRow` answers
from logits that stay on the member's device, normalised only when first asked (most verifier rows of a
round are never read). A member living elsewhere (a Ray actor) answers the same questions remotely, so only
top-k lists and a handful of probabilities cross the wire.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..config import GREEDY, SamplingParams

TOP_P_PROBE = 1024  # top-p first looks for its cut among this many best tokens (a full sort is the fallback)


class Row(Protocol):
    """One member's next-token distribution (log-probabilities after temperature / top-p)."""

    def logprob(self, ids: Sequence[int]) -> torch.Tensor: ...

    def argmax(self) -> int: ...

    def top(self, k: int) -> list[int]: ...

    def sample(self, seed: int) -> int: ...

    def full(self) -> torch.Tensor: ...


def next_token_logprobs(
    logits: torch.Tensor, do_sample: bool, temperature: float = 1.0, top_p: float = 1.0
) -> torch.Tensor:
    """Log-probabilities of one row of `logits`; temperature and top-p apply to every member alike.

    Top-p keeps the smallest set of best tokens whose mass reaches `top_p` (ties at the cut are kept).
    It looks for the cut among the best `TOP_P_PROBE` tokens first: a full sort of a 152k vocabulary
    costs tens of milliseconds on a CPU, a top-1024 a fraction of that.
    """
    if not do_sample:
        return torch.log_softmax(logits.float(), dim=-1)
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return logprobs
    k = min(TOP_P_PROBE, logprobs.shape[-1])
    values = torch.topk(logprobs, k).values
    mass = torch.cumsum(values.double().exp(), dim=-1)
    if float(mass[-1]) < top_p and k < logprobs.shape[-1]:
        values = torch.sort(logprobs, descending=True).values
        mass = torch.cumsum(values.double().exp(), dim=-1)
    target = torch.tensor(top_p, dtype=torch.float64, device=mass.device)
    cut = min(int(torch.searchsorted(mass, target)), values.shape[-1] - 1)
    kept = logprobs.masked_fill(logprobs < values[cut], float("-inf"))
    return torch.log_softmax(kept, dim=-1)


def race_sample(logprobs: torch.Tensor, seed: int) -> int:
    """A token drawn from `logprobs` by the exponential race (Gumbel-max): argmax of p_i / E_i, E_i ~ Exp(1).

    Why not an inverse CDF: over a 152k vocabulary, float noise of 1e-7 in each probability moves the CDF's
    boundaries by amounts that add up to a percent of the draws, so the same seed could pick another token
    in a batch than alone. The race flips only where two perturbed maxima nearly tie. The noise comes from
    `seed` on the CPU, so every device (and a Ray actor) draws the same token.
    """
    noise = torch.empty(logprobs.shape[-1], dtype=torch.float64).exponential_(
        generator=torch.Generator().manual_seed(seed)
    )
    return int(torch.argmax(logprobs.double() - noise.log().to(logprobs.device)))


class Draws:
    """A request's random numbers, each keyed by what it decides and at which generated position.

    Why not one generator drawn in sequence: rounds, the overlap schedule and batches interleave drafting
    and judging differently, so a sequence would hand the same seed different numbers depending on the
    schedule. Keyed, a seeded request samples the same text alone, batched or overlapped. Reusing a key
    when a position is drafted again after a replacement keeps sampling exact: that draw never influenced
    the decision that discarded it.
    """

    def __init__(self, seed: int | None) -> None:
        self.seed = int(torch.randint(0, 2**62, ()).item()) if seed is None else seed

    def key(self, purpose: str, position: int) -> int:
        digest = hashlib.blake2b(f"{self.seed}:{purpose}:{position}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 2

    def uniform(self, purpose: str, position: int) -> float:
        generator = torch.Generator().manual_seed(self.key(purpose, position))
        return float(torch.rand((), generator=generator, dtype=torch.float64))


class LocalRow:
    """A distribution over this process's logits: normalised on the member's device on first use."""

    __slots__ = ("_logits", "_sampling", "_values")

    def __init__(self, logits: torch.Tensor, sampling: SamplingParams = GREEDY) -> None:
        self._logits = logits
        self._sampling = sampling
        self._values: torch.Tensor | None = None

    def masked(self, mask: Callable[[torch.Tensor], torch.Tensor]) -> LocalRow:
        """The same distribution with `mask` applied to its raw logits (a grammar's -inf for forbidden ids),
        before temperature and top-p."""
        return LocalRow(mask(self._logits), self._sampling)

    @property
    def values(self) -> torch.Tensor:
        """Log-probabilities of the whole vocabulary (on the member's device)."""
        if self._values is None:
            s = self._sampling
            self._values = next_token_logprobs(self._logits, s.do_sample, s.temperature, s.top_p)
        return self._values

    def logprob(self, ids: Sequence[int]) -> torch.Tensor:
        values = self.values
        return values[torch.tensor(list(ids), dtype=torch.long, device=values.device)].cpu()

    def argmax(self) -> int:
        # normalising preserves the order, so the raw logits answer without computing the softmax
        return int(torch.argmax(self._logits))

    def top(self, k: int) -> list[int]:
        return torch.topk(self.values, min(k, self.values.shape[0])).indices.tolist()

    def sample(self, seed: int) -> int:
        return race_sample(self.values, seed)

    def full(self) -> torch.Tensor:
        return self.values
