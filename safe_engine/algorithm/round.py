"""One round of one request, as a value: `Generation.begin_round` makes it, the draft and verify phases fill
it in, `Generation.end_round` consumes it (as vLLM's scheduler output is made, run and consumed).

Why a value: the phases of a round talk only through it, so nothing of a round outlives it on the request
(its rows of logits and its verifications' jobs go with it), and a batch is a list of (request, round).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..runtime.rows import Row
from .alignment import Verification
from .decision import Verdict


@dataclass
class Draft:
    """The drafter's tokens not yet accepted: carried over from the last round, then newly drafted."""

    ids: list[int] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)  # the drafter's distribution before each token
    pieces: list[bytes] = field(default_factory=list)  # the bytes each token spells (b"" for control tokens)
    final: bool = False  # no text can follow: EOS / control token drafted, budget or context reached
    drawn: list[Row] = field(default_factory=list)  # what each token was drawn from: the row under the grammar

    def cut(self, start: int, final: bool | None = None) -> Draft:
        """The tokens from `start` on (carried into the next round)."""
        return Draft(
            self.ids[start:], self.rows[start:], self.pieces[start:], self.final if final is None else final,
            self.drawn[start:],
        )  # fmt: skip

    def append(self, tok: int, row: Row, piece: bytes, drawn: Row) -> None:
        self.ids.append(tok)
        self.rows.append(row)
        self.drawn.append(drawn)
        self.pieces.append(piece)

    def __len__(self) -> int:
        return len(self.ids)


class Judged(NamedTuple):
    """An ensemble point of this round, committed when its token is accepted."""

    j: int  # its position in the draft
    offset: int  # byte offset of its token in the generated text
    verdict: Verdict
    replaced: bool
    handed: bytes | None  # the bytes handed to the drafter (None: its own token stands)
    steered: bool  # loop steering let the drafter's own token stand


@dataclass
class Round:
    """What a round drafts, verifies and decides. `verified` is None in the rounds schedule (the verifiers see
    the whole draft); in the overlap schedule it is how many drafted tokens they see (those carried in)."""

    draft: Draft  # the carried tokens, then this round's
    to_draft: int  # tokens still to draft
    budget: int  # tokens the request may still generate
    verified: int | None
    adaptive: bool  # the draft ends early at a likely ensemble point (a lone request only)
    cut_short: bool = False  # ... and it did
    checks: list[Verification] = field(default_factory=list)  # the verifiers' views of the draft
    points: list[Judged] = field(default_factory=list)
    # with logprobs: draft position -> (the candidates, their ensemble distribution, the chosen string), and the
    # draft positions that a GaC pick of several ids covers
    decided: dict[int, tuple[list[bytes], torch.Tensor, bytes]] = field(default_factory=dict)
    covered: set[int] = field(default_factory=set)
    carry: Draft = field(default_factory=Draft)  # the drafted tokens judged next round
    window: int | None = None  # where a verifier's context window ends the text: the drafted tokens it holds

    @property
    def seen(self) -> int:
        """The drafted tokens the verifiers see."""
        seen = len(self.draft) if self.verified is None else self.verified
        return seen if self.window is None else min(seen, self.window)

    @property
    def drafting(self) -> bool:
        return self.to_draft > 0 and not self.draft.final
