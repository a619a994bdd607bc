"""The scan of a round: the drafted positions judged in order, until the first pick that changes the text.

With the boundary gate, only positions where every tokenizer has a token boundary at the byte offset count
(`alignment`); the remaining gates and the pick are `decision.Judge`'s. At the first pick that changes the
drafter's text, the rest of the draft is dropped. A position whose view may still change with more text (a
verifier's last token, " Inc" of " Incorrect") is judged next round instead, with its drafted tokens carried.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..config import GenerationConfig
from ..runtime.rows import Row
from ..shaping.constrained import Constraint
from ..stats import EnsembleStats
from .alignment import Verification
from .decision import Judge
from .handover import Handover
from .round import Draft, Judged, Round
from .steering import LoopSteering

CARRY_LIMIT = 3  # judge anyway once the carried-over tokens exceed this many drafts (a verifier token that
# keeps growing, like a long run of "=", must not postpone the decision forever)

Views = tuple[list[Row], list[list[int]], list[bool], bool]


def grammar_at(constraint: Constraint | None, accepted: int, draft: Draft, j: int) -> Constraint | None:
    """The grammar at drafted position j (rolled back, or caught up with the draft's ids); `accepted`: the
    tokens accepted before the draft."""
    if constraint is None:
        return None
    consumed = len(constraint.ids) - accepted
    if consumed > j:
        constraint.rollback(consumed - j)
    elif consumed < j:
        constraint.consume(draft.ids[consumed:j])
    return constraint


class Scanner:
    """Judges a round's drafted positions for one request (its judge, handover, grammar and loop steering)."""

    def __init__(
        self,
        config: GenerationConfig,
        gates: Sequence[str],
        judge: Judge,
        handover: Handover,
        steering: LoopSteering,
        constraint: Constraint | None,
        tracing: bool,
    ) -> None:
        self.config, self.gates, self.judge, self.handover = config, gates, judge, handover
        self.steering, self.constraint, self.tracing = steering, constraint, tracing

    def scan(self, rnd: Round, start: int, stats: EnsembleStats) -> tuple[int, list[int] | None]:
        """How many drafted tokens are accepted, and the drafter ids replacing the next one (or None); `start`:
        the byte offset where the draft begins. Tokens after the accepted ones go to `rnd.carry` when their
        judgement is deferred (and, in the overlap schedule, the token drafted while the verifiers ran)."""
        draft, seen = rnd.draft, rnd.seen
        final = (
            (draft.final and seen == len(draft))
            or rnd.window is not None  # a verifier's window ends the text here
            or len(draft) > CARRY_LIMIT * self.config.draft_length
        )
        offset, j = start, 0
        while j < seen:
            here = offset
            offset += len(draft.pieces[j])
            views = self._views(here, start, draft, j, rnd.checks, final)
            if views is None:  # boundary gate: some tokenizer splits the text inside this token
                j += 1
                continue
            rows, owns, cuts, aligned = views
            constrain = None if self.constraint is None else (lambda j=j: self._grammar(stats.tokens, draft, j))
            position = stats.tokens + j
            verdict = self.judge.judge(
                here, draft.ids[j], [draft.rows[j], *rows], owns, cuts, aligned, constrain, draft.drawn[j], position
            )
            if verdict.deferred:
                stats.deferred_positions += 1
                rnd.carry = draft.cut(j)
                return j, None
            pick = verdict.pick
            ids = None if pick is None else self.handover.ids(pick, draft.drawn[j], position)
            replaced = ids is not None and ids != draft.ids[j : j + len(ids)]
            steered = replaced and here in self.steering.kept
            if steered:  # the drafter's token stands, and so does its own distribution in the logprobs
                ids, replaced = draft.ids[j : j + 1], False
            elif verdict.decided_from is not None:
                chosen = verdict.pick.text if verdict.pick is not None else draft.pieces[j]
                rnd.decided[j] = (*verdict.decided_from, chosen)
                if ids is not None and not replaced:
                    rnd.covered.update(range(j + 1, j + len(ids)))
            if verdict.ensembled:
                handed = self.handover.spelled(ids) if ids else None
                rnd.points.append(Judged(j, here, verdict, replaced, handed, steered))
            if replaced:
                stats.discarded_draft_tokens += len(draft) - j - 1
                return j, ids
            grammar_at(self.constraint, stats.tokens, draft, len(draft))  # a look at j rolled it back: catch up
            if ids is not None and len(ids) > 1:  # GaC's string is the draft's next tokens: skip past them
                offset += sum(len(p) for p in draft.pieces[j + 1 : j + len(ids)])
                j += len(ids) - 1
            j += 1
        if seen < len(draft):
            rnd.carry = draft.cut(seen)
        return seen, None

    def _grammar(self, accepted: int, draft: Draft, j: int) -> Constraint:
        """`grammar_at` for a request that has a grammar."""
        constraint = grammar_at(self.constraint, accepted, draft, j)
        assert constraint is not None, "only asked for when the request has a grammar"
        return constraint

    def _views(
        self, offset: int, start: int, draft: Draft, j: int, checks: list[Verification], final: bool
    ) -> Views | None:
        """Each verifier's distribution, own token ids and whether these are cut at `offset`, and whether
        every tokenizer has a boundary there; None where the boundary gate skips the position."""
        aligned = all(offset in c.at for c in checks)
        if not aligned and "boundary" in self.gates:
            return None
        rows, owns, cuts = [], [], []
        for c in checks:
            if offset in c.at:
                row, own, cut = c.view(offset, final)
                if offset == len(c.text) and offset < start + sum(map(len, draft.pieces)):
                    # every-token: the verifier read only the accepted text; its own token is how it would
                    # begin the drafted text
                    own = [draft.ids[j]] if c.same_vocab else Handover.first_ids(c.track.member, draft, j)
                    if self.tracing:
                        aligned &= c.starts_token_at(offset, b"".join(draft.pieces[j:]))
            else:
                row, own, cut = c.prefix_view(offset, final)
            rows.append(row)
            owns.append(own)
            cuts.append(cut)
        return rows, owns, cuts, aligned
