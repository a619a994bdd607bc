"""The drafter's side of a round: how many tokens it drafts, and each one drawn.

With `adaptive_draft`, a lone request's draft ends one token after an unsure drafter token at a shared boundary
(where replacements happen), and its length follows the request's replacement rate; a batch drafts the
configured length in lockstep, and the overlap schedule the gauge's chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from ..config import GenerationConfig
from ..runtime.members import Track
from ..runtime.rows import Draws, LocalRow, Row
from ..shaping.constrained import Constraint
from .aggregation import token_string
from .lineup import Gauge
from .round import Round
from .text import TextBuffer

UNSURE = 0.4  # a drafted token below this probability is a likely ensemble point (transformers' assistant default)


class Drafting:
    """The drafter's side of one request's rounds: how many tokens a round drafts (the configured length, or
    adapted round by round), and each token drawn from the drafter's distribution."""

    def __init__(
        self,
        config: GenerationConfig,
        tracks: Sequence[Track],
        gates: Sequence[str],
        buffer: TextBuffer,
        constraint: Constraint | None,
        draws: Draws,
    ) -> None:
        self.config, self.tracks, self.gates, self.buffer = config, tracks, gates, buffer
        self.constraint, self.draws = constraint, draws
        self.length = config.draft_length

    def take(self, rnd: Round, row: Row, accepted: int) -> None:
        """The drafter's next token from its distribution `row` (sampled, or its argmax), after `accepted`
        generated tokens."""
        drafter, draft = self.tracks[0], rnd.draft
        drafter.done()
        # Under a grammar the token is drawn from the masked row (speculative sampling's q); the ensemble
        # aggregates the unmasked one, like every verifier's, and restricts its candidates afterwards.
        # (a grammar needs a local drafter, checked by the lineup, so its rows are LocalRows)
        drawn: Row = row if self.constraint is None else cast(LocalRow, row).masked(self.constraint.mask_logits)
        position = accepted + len(draft)
        tok = drawn.sample(self.draws.key("draft", position)) if self.config.do_sample else drawn.argmax()
        if self.constraint is not None:
            self.constraint.consume([tok])
        drafter.ids.append(tok)
        piece = token_string(drafter.member, tok)
        draft.append(tok, row, piece or b"", drawn)
        rnd.to_draft -= 1
        if not piece or drafter.full:  # EOS or another control token ends the draft
            draft.final = True
        draft.final |= len(draft) >= rnd.budget
        if rnd.to_draft > 1 and rnd.verified is None and self.likely_point(rnd, tok, row):
            rnd.to_draft, rnd.cut_short = 1, True  # one token of look-ahead, then verify

    def for_round(self, overlap: bool, adaptive: bool, gauge: Gauge | None) -> int:
        """Tokens to draft this round: 1 without gates (every-token), the gauge's chunk when overlapped."""
        if not self.gates:
            return 1
        if overlap:
            return min(gauge.chunk, self.config.draft_length) if gauge is not None else 1
        return self.length if adaptive else self.config.draft_length

    def adapt(self, rnd: Round, replacement: list[int] | None) -> None:
        """One shorter after a replacement, one longer after a clean round."""
        if not rnd.adaptive or rnd.verified is not None:
            return
        if replacement is not None:
            self.length = max(2, self.length - 1)
        elif not rnd.cut_short:  # tokens carried into the next round are not a miss
            self.length = min(2 * self.config.draft_length, self.length + 1)

    def likely_point(self, rnd: Round, tok: int, row: Row) -> bool:
        """Whether drafting on past `tok` is likely wasted: the drafter is unsure of it and it starts where
        every tokenizer has a boundary (only there can the ensemble replace it)."""
        if not rnd.adaptive or float(row.logprob([tok]).exp()) >= UNSURE:
            return False
        if "boundary" not in self.gates:
            return True
        offset = len(self.buffer) + sum(len(p) for p in rnd.draft.pieces[:-1])
        text = bytes(self.buffer.data) + b"".join(rnd.draft.pieces)
        own = self.tracks[0].member.vocab.fingerprint
        for t in self.tracks[1:]:
            if t.member.vocab.fingerprint == own:
                continue
            _, starts = t.member.vocab.encode(text[t.frozen_bytes :])
            if offset - t.frozen_bytes not in starts:
                return False
        return True
