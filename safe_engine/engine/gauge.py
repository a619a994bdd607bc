"""ScheduleGauge: which schedule (rounds or overlap) serves a lone request faster on this machine now.

Engine machinery, not the algorithm: the greedy text never depends on it (both schedules judge every position
on the same text); it only times the requests' rounds, shared by an ensemble's requests.
"""

from __future__ import annotations

import statistics
import threading


class ScheduleGauge:
    """Which schedule serves a lone request faster on this machine now, and how many tokens an overlapped
    round drafts; measured on the requests' own rounds and shared by an ensemble's requests.

    Overlap hides the verifiers' pass behind the drafter's steps only while the pass ends first and the two
    forwards do not slow each other down. A busy neighbour core breaks that (measured on the demo pair: 0.63
    of the drafter alone overlapped vs 0.77 in rounds), and so does a verifier set whose one-token pass
    outlasts a drafter step (Qwen-0.5B drafting for SmolLM2-135M + gemma-3-270m: 0.41 vs 0.56). So:

    - the gauge times both schedules, in seconds per token of progress (accepted, plus drafted ahead and
      carried, less what the round was handed) over `WINDOW` tokens each, in alternating blocks of `BLOCK`
      tokens, so that both see nearby stretches of text: how often the ensemble replaces a token changes
      along an answer, and a replacement costs rounds more than overlap. A request's first round (its
      prompt's) and the first round after a switch are not timed. Then it runs the faster one and times
      both again after every `REPROBE` tokens, because the machine's load changes;
    - an overlapped round drafts a chunk of `chunk` tokens, grown by one while the verifiers' pass over a
      chunk outlasts the drafter's steps (median of `CHUNK_SAMPLES` rounds): a k-token pass costs little
      more than a one-token pass, so a chunk lets two verifiers keep up with one drafter. A grown chunk is
      timed afresh (its cost per token is not the smaller one's).

    The greedy text does not depend on any of this (every schedule judges each position on the same text).
    """

    SCHEDULES = ("overlap", "rounds")
    WINDOW = 16
    BLOCK = 8
    REPROBE = 512
    CHUNK_SAMPLES = 4
    MAX_CHUNK = 8

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seconds_per_token: dict[str, float] = {}  # each schedule's last timed window
        self.chunk = 1
        self._ratios: list[float] = []
        self._last: str | None = None  # the schedule of the last round recorded
        self._start_timing()

    def _start_timing(self) -> None:
        self._window = {s: (0.0, 0) for s in self.SCHEDULES}  # (seconds, tokens) timed in this window
        self._timing = True
        self._block, self._block_tokens = "overlap", 0  # the schedule timed now, and its tokens so far
        self._since = 0  # tokens decoded since both were last timed

    def choose(self) -> str:
        """The schedule of a lone request's next round."""
        with self._lock:
            if self._timing:
                return self._block
            return min(self.SCHEDULES, key=self.seconds_per_token.__getitem__)

    def record(self, schedule: str, seconds: float, tokens: int) -> None:
        """One lone request's round: its schedule, wall time and progress in tokens. The first round after a
        switch is not timed: it inherits the other schedule's work (rounds verify what overlap drafted
        ahead; overlap's first round drafts with nothing to verify)."""
        with self._lock:
            switched, self._last = schedule != self._last, schedule
            if not self._timing:
                self._since += tokens
                if self._since >= self.REPROBE:
                    self._start_timing()
                return
            if switched:
                return
            spent, counted = self._window[schedule]
            self._window[schedule] = (spent + seconds, counted + tokens)
            if all(counted >= self.WINDOW for _, counted in self._window.values()):
                self.seconds_per_token = {s: spent / counted for s, (spent, counted) in self._window.items()}
                self._timing, self._since = False, 0
                return
            if schedule == self._block:
                self._block_tokens += tokens
                other = self.SCHEDULES[1 - self.SCHEDULES.index(schedule)]
                if self._block_tokens >= self.BLOCK and self._window[other][1] < self.WINDOW:
                    self._block, self._block_tokens = other, 0

    def record_chunk(self, ratio: float, limit: int = MAX_CHUNK) -> None:
        """One overlapped round: the verifiers' pass time over the drafter's steps beside it (`limit`: the
        request's draft_length, the largest chunk it drafts)."""
        with self._lock:
            self._ratios.append(ratio)
            if len(self._ratios) < self.CHUNK_SAMPLES:
                return
            if statistics.median(self._ratios) > 1.0 and self.chunk < min(self.MAX_CHUNK, limit):
                self.chunk += 1
                self._start_timing()  # overlap's timing so far was of smaller chunks
            self._ratios.clear()
