"""Loop steering (`loop_steer`): going back to the ensemble replacement that started a repetition, to let
the drafter's own token stand there.

Why there, and why afterwards: in the accuracy study a pick starts the loop and the drafter continues it alone
(issue 31, mmlu-redux/nutrition/1: a pick began the sentence's second copy, and the drafter wrote every later
copy with no replacement). The loop is certain only once the copies stand, when that pick lies behind, often in
the first copy: the drafter copies the pick along with the rest (all eight GSM8K UniTE+SAFE loops that survived
going back to the last copy, traced). Going back to it undoes the ensemble's part in the loop and nothing else.
Digits count as equal because most GSM8K loops are numbered lists that repeat their lines ("13. **Step 13:
..."). A loop with no replacement in its copies is the drafter's own and stays (the guard can end it).
Checked token by token, the greedy text is the same whatever the rounds; each token taken back is decoded
again, at most max_new_tokens of them per answer, and never further back than STEER_REACH bytes from the end.
"""

from __future__ import annotations

import codecs
import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple, cast

from ..config import GenerationConfig
from ..stats import EnsemblePoint, EnsembleStats
from .round import Judged
from .text import loop_period

STEER_REACH = 512  # bytes: loop steering goes back at most this far (the study's loops: periods of 4 to 265
# characters), so a stream holds back at most this much text behind the decoding

Trace = list[EnsemblePoint] | None  # the request's trace, when asked for


class Point(NamedTuple):
    """A committed ensemble point, as loop steering needs it: where it is in the text and what it did."""

    offset: int  # byte offset of its token in the generated text
    token: int  # index of its token among the generated ones
    replaced: bool
    steered: bool


class LoopSteering:
    """The committed ensemble points, the offsets where the drafter's token is to stand, and the offset before
    which steering no longer goes back (text before it may have been streamed). Points are counted in the
    stats and the trace as they are committed, and uncounted when steering takes them back."""

    def __init__(self, config: GenerationConfig) -> None:
        self.config = config
        self.committed: list[Point] = []
        self.kept: set[int] = set()
        self.settled = 0

    def commit(
        self,
        points: Sequence[Judged],
        first: int,
        accepted: int,
        stats: EnsembleStats,
        trace: list[EnsemblePoint] | None,
    ) -> None:
        """Count a round's ensemble points among its `accepted` tokens, the first of which is generated token
        `first` (a stop string may end the text before some judged positions)."""
        for p in points:
            if p.j >= accepted:
                break
            if self.config.loop_steer is not None:
                self.committed.append(Point(p.offset, first + p.j, p.replaced, p.steered))
            stats.ensembled_tokens += 1
            stats.replaced_tokens += p.replaced
            stats.steered_tokens += p.steered
            if trace is not None and p.verdict.point is not None:
                shown = p.verdict.point.drafted if p.handed is None else p.handed.decode("utf-8", errors="replace")
                trace.append(replace(p.verdict.point, replaced=p.replaced, handed=shown, steered=p.steered))

    def target(
        self, data: bytearray, stats: EnsembleStats, first: int, n: int, fresh: Sequence[Judged]
    ) -> Point | None:
        """Checked at each token's end (here the round's n-th, generated token first + n - 1): where the text
        has come to end in a repetition (a stretch of loop_span+ bytes, loop_steer times in a row, digits
        counting as equal) and an ensemble replacement lies inside those copies (committed, or among this
        round's `fresh` ones), the first such replacement."""
        copies = cast(int, self.config.loop_steer)
        settled = self.settled
        self.settled = max(settled, len(data) - STEER_REACH)
        if stats.rolled_back_tokens >= self.config.max_new_tokens:
            return None  # the budget is spent: no per-token loop search any more
        period = loop_period(data, self.config.loop_span, copies, digits_equal=True)
        if period is None:
            return None
        start = max(len(data) - copies * period, settled)
        points = (Point(p.offset, first + p.j, p.replaced, p.steered) for p in fresh if p.j < n)
        target = next((p for p in itertools.chain(self.committed, points) if p.replaced and p.offset >= start), None)
        if target is None or stats.rolled_back_tokens + first + n - target.token > self.config.max_new_tokens:
            return None
        return target

    def take_back(self, point: Point, stats: EnsembleStats, trace: Trace) -> None:
        """Uncount the points from `point` on, and let the drafter's token stand there."""
        offset = point.offset
        dropped = [p for p in self.committed if p.offset >= offset]
        self.committed = self.committed[: len(self.committed) - len(dropped)]
        stats.ensembled_tokens -= len(dropped)
        stats.replaced_tokens -= sum(p.replaced for p in dropped)
        stats.steered_tokens -= sum(p.steered for p in dropped)
        stats.rolled_back_tokens += stats.tokens - point.token
        stats.tokens = point.token
        self.kept = {o for o in self.kept if o < offset} | {offset}
        if trace is not None:
            trace[:] = [p for p in trace if p.offset < offset]

    def visible(self, text: str, data: bytearray) -> str:
        """`text` less what steering may still take back: from the first replacement it may go back to."""
        revisable = next((p.offset for p in self.committed if p.replaced and p.offset >= self.settled), None)
        if revisable is None:
            return text
        return text[: len(codecs.getincrementaldecoder("utf-8")("replace").decode(bytes(data[:revisable])))]
