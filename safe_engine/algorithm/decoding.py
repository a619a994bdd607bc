"""The draft → verify loop shared by every strategy.

One `Generation` is one request; each round is a `Round` value that `begin_round` makes, the phases fill in
and `end_round` consumes (the engine runs the forwards: `engine.rounds.run_round`). It has three phases:
1. **draft**: the drafter proposes up to n new tokens after those carried over from the last round
   (n = 1 when no gate runs: every-token ensembling; no verification at all for `single`);
2. **verify**: each verifier re-tokenizes the text after its frozen prefix and scores it in one forward
   pass over the tail it has not cached;
3. **scan**: the drafted positions are judged in order. With the boundary gate, only positions where
   every tokenizer has a token boundary at the byte offset count (`alignment`); the remaining gates and
   the pick are `decision.Judge`'s. At the first pick that changes the drafter's text, the rest of the
   draft is dropped. A position whose view may still change with more text (a verifier's last token,
   " Inc" of " Incorrect") is judged next round instead, with its drafted tokens carried over.
Caches are cropped, never recomputed from scratch.

Two schedules. **rounds** (above; with `adaptive_draft`, a lone request's draft ends one token after an
unsure drafter token at a shared boundary, where replacements happen, and its length follows the request's
replacement rate; a batch drafts the configured length in lockstep). **overlap**: every round drafts a chunk
of k tokens (k = 1 while the verifiers keep up) while the verifiers, on other cores or devices, score the
chunk before it, so their forward is off the critical path and a replacement costs at most the chunk drafted
meanwhile. Both judge every position on the same text, so they give the same greedy output, and the choice
is made per round: schedule="auto" runs a lone request in whichever schedule `ScheduleGauge` timed faster.
On the CPU, `runtime.placement` says how many threads each kind of forward gets (measured at load).
"""

from __future__ import annotations

import math
import threading
import time
from itertools import accumulate

from ..errors import GenerationTimeout, InputError, drop_frame_locals
from ..runtime.members import Job, Member, Track
from ..runtime.rows import Draws, Row
from ..shaping.constrained import Constraint
from ..shaping.request import Request
from ..stats import EnsemblePoint, EnsembleStats, GenerationResult
from .alignment import Verification, texts_held
from .decision import Judge
from .drafting import UNSURE, Drafting
from .handover import Handover
from .lineup import Gauge, Lineup
from .logprobs import Logprobs
from .round import Draft, Round
from .scan import CARRY_LIMIT, Scanner, grammar_at
from .steering import STEER_REACH, LoopSteering, Point
from .text import TextBuffer, ends_in_loop

# A verifier's tokens of the answer can outnumber the drafter's by more than the prompt's ratio says (a word
# its vocabulary splits): the positions its reservation adds for that
RESERVE_SLACK = 64

__all__ = ["CARRY_LIMIT", "STEER_REACH", "UNSURE", "Draft", "Gauge", "Generation", "Lineup", "Point", "Round"]


class Generation:
    """One request decoded by the ensemble, one `Round` at a time (`engine.rounds.run_round` runs them)."""

    def __init__(self, lineup: Lineup, request: Request) -> None:
        """The request's strategy is resolved here, once; each active member tokenizes the request its own
        way. A grammar (`request.grammar`) becomes a `Constraint` over the drafter's ids that the output
        must follow (the drafter drafts under its mask, the ensemble picks only what it allows); it always
        holds the accepted ids plus the current draft."""
        config = request.config
        members, drafter = lineup.members, lineup.drafter
        self.request, self.config = request, config
        self.strategy = strategy = config.strategy(len(members))
        order = [drafter] + [i for i in range(len(members)) if i != drafter]
        active = order if strategy.ensembles else [drafter]
        lineup.check(request, strategy, active)
        self.constraint = None if request.grammar is None else Constraint(request.grammar, members[drafter])
        self.tracks = [Track(members[i], request.encode(members[i]), lineup.names[i]) for i in active]
        self.tracks[0].logit_bias = config.logit_bias  # the bias is in the drafter's token ids
        self.gates = strategy.gates
        self.executor, self.parallel_members = lineup.executor, lineup.parallel_members
        self.schedule_gauge, self.placement = lineup.schedule_gauge, lineup.placement
        self.draws = Draws(config.seed)
        weights = lineup.weights[active] / lineup.weights[active].sum()
        union = lineup.union() if strategy.full_vocabulary and lineup.union is not None else None
        self.judge = Judge([t.member for t in self.tracks], weights, config, union, self.draws)
        self.handover = Handover(self.drafter.member, config, strategy.aggregation, self.draws)
        self.stats = EnsembleStats(method=strategy.method, gates=strategy.labels, note=strategy.note)
        self.stats.prompt_tokens = {t.name: t.prompt_len for t in self.tracks}
        self.trace: list[EnsemblePoint] | None = [] if config.trace else None
        self.logprobs = Logprobs(self.drafter.member, config.logprobs) if config.logprobs is not None else None
        self.steering = LoopSteering(config)
        self.scanner = Scanner(
            config, self.gates, self.judge, self.handover, self.steering, self.constraint, config.trace
        )
        self.buffer = TextBuffer(config.stop)
        self.drafting = Drafting(config, self.tracks, self.gates, self.buffer, self.constraint, self.draws)
        self.pending = Draft()  # drafted tokens carried into the next round
        self.error: BaseException | None = None  # why the request failed (it then holds no caches)
        self.finish_reason: str | None = None
        self._busy = threading.Lock()
        self._cancelled = False
        self._started = time.perf_counter()
        for track in self.tracks:
            if track.full:
                raise InputError(
                    f"the prompt has {track.prompt_len} tokens for member {track.name!r}, which does not fit its "
                    f"context window of {track.member.context_window}; shorten the prompt"
                )

    @property
    def drafter(self) -> Track:
        return self.tracks[0]

    @property
    def verifiers(self) -> list[Track]:
        return self.tracks[1:]

    def reserved_positions(self) -> list[tuple[Member, int]]:
        """The positions this request may come to hold in each member whose requests share one pool of them (a
        llama.cpp context), for the scheduler to admit it only where they fit: its prompt and token budget with
        a draft's lookahead, a verifier's budget scaled by how many more tokens than the drafter's its
        tokenizer made of the prompt (and some slack), never more than the member's window."""
        cfg = self.config
        ahead = cfg.max_new_tokens + cfg.draft_length + 1
        out = []
        for track in self.tracks:
            if track.member.positions is None:
                continue
            scale = max(1.0, track.prompt_len / max(1, self.drafter.prompt_len))
            need = track.prompt_len + math.ceil(ahead * scale) + (0 if track is self.drafter else RESERVE_SLACK)
            window = track.member.context_window
            out.append((track.member, min(need, window) if window else need))
        return out

    @property
    def text(self) -> str:
        return self.buffer.text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def can_overlap(self) -> bool:
        """Whether this request's next round may use the overlap schedule (decided per round)."""
        schedule = self.strategy.schedule
        if not self.gates or self.executor is None or schedule == "rounds":
            return False
        gauge = self.schedule_gauge
        return schedule == "overlap" or (gauge is not None and gauge.choose() == "overlap")

    # -- one round: begin → draft (take_draft per token) → verify → end ---------------------------------
    def begin_round(self, overlap: bool = False, batched: bool = False) -> Round:
        """The round: the carried tokens are its draft; up to n new ones follow (1 without gates; the gauge's
        chunk in the overlap schedule, where the verifiers meanwhile score the carried ones). In a batch
        (`batched`) the draft keeps the configured length: the batch drafts in lockstep, and one request
        stopping early leaves the others' drafting steps part empty (8 GSM8K requests: 10.7 tok/s adaptive vs
        15.9 fixed)."""
        if self.finished:
            raise InputError("this generation has finished; start a new one")
        if self._cancelled:
            raise InputError("this generation was cancelled; start a new one")
        timeout = self.config.timeout_s
        if timeout is not None and time.perf_counter() - self._started > timeout:
            self.cancel()
            raise GenerationTimeout(
                f"the generation ran past timeout_s={timeout} s after {self.stats.tokens} tokens; "
                "raise timeout_s or lower max_new_tokens"
            )
        draft, self.pending = self.pending, Draft()
        budget = self.config.max_new_tokens - self.stats.tokens
        adaptive = self.config.adaptive_draft and not batched
        to_draft = min(self.drafting.for_round(overlap, adaptive, self.schedule_gauge), budget - len(draft))
        draft.final |= to_draft <= 0
        return Round(draft, to_draft, budget, len(draft) if overlap and to_draft > 0 else None, adaptive)

    def draft_job(self) -> Job:
        """The drafter's next forward: its distribution after everything drafted so far."""
        return self.drafter.job(self.config)[0]

    def take_draft(self, rnd: Round, rows: list[Row]) -> None:
        """The drafter's next token, from its distribution after the draft so far (`rows[-1]`)."""
        self.drafting.take(rnd, rows[-1], self.stats.tokens)

    def verify(self, rnd: Round) -> list[Verification]:
        """The verifiers' views of this round (their forwards are run by the caller: one job each).

        Nothing is verified for `single`, or where no drafted position can be an ensemble point whatever
        the verifiers say (GaC with a confident drafter everywhere). Without gates (every-token ensembling)
        a verifier reads only the accepted text, as it would generating alone; otherwise also the draft.
        Where a verifier's context window cannot hold it all, the text ends before the first drafted token
        it cannot score (`rnd.window`), in every schedule."""
        if not self.strategy.ensembles:
            return []
        draft = rnd.draft
        pieces = draft.pieces[: rnd.seen] if self.gates else []
        texts = self._texts_held([], [], pieces)
        if texts <= len(pieces):
            rnd.window, rnd.to_draft = max(texts - 1, 0), 0
            pieces = pieces[: rnd.window]
        if self.gates and not pieces:
            return []  # overlap: nothing drafted before this round's token yet (or no drafted token fits)
        if texts == 0 or all(self.judge.drafter_confident(row) for row in draft.rows):
            return []
        text, generated = self._text_with(pieces), self._ids_with(draft.ids, pieces)
        own, accepted = self.drafter.member.vocab.fingerprint, len(self.buffer)
        rnd.checks = [
            Verification(t, text, accepted, generated if t.member.vocab.fingerprint == own else None, self.config)
            for t in self.verifiers
        ]
        return rnd.checks

    def _text_with(self, pieces: list[bytes]) -> bytes:
        """The accepted text, then `pieces`."""
        return bytes(self.buffer.data) + b"".join(pieces)

    def _ids_with(self, ids: list[int], pieces: list[bytes]) -> list[int]:
        """The drafter's accepted ids, then those of `ids` that spell text (`pieces`: control tokens spell none)."""
        drafter = self.drafter
        accepted = drafter.ids[drafter.prompt_len : drafter.prompt_len + self.stats.tokens]
        return accepted + [t for t, piece in zip(ids, pieces) if piece]

    def _texts_held(self, ids: list[int], pieces: list[bytes], more: list[bytes]) -> int:
        """How many of the texts accepted + `pieces` + more[:j] (j = 0, 1, ...) every verifier's window holds
        (`ids`: the tokens that spell `pieces`)."""
        start = self._text_with(pieces)
        text = start + b"".join(more)
        ends = list(accumulate(map(len, more), initial=len(start)))
        counts = list(accumulate((1 if piece else 0 for piece in more), initial=len(self._ids_with(ids, pieces))))
        own = self.drafter.member.vocab.fingerprint
        return min(
            (texts_held(t, text, ends, counts if t.member.vocab.fingerprint == own else None) for t in self.verifiers),
            default=len(ends),
        )

    def end_round(self, rnd: Round) -> None:
        """Scan the verified draft, accept what stands, crop caches; finish when the text is complete."""
        draft, checks = rnd.draft, rnd.checks
        if not checks:  # nothing could be an ensemble point (single, a confident GaC drafter) or nothing seen
            kept, replacement = rnd.seen, None
            if kept < len(draft):  # overlap: the token drafted this round waits for the verifiers
                rnd.carry = draft.cut(kept)
        else:
            kept, replacement = self.scanner.scan(rnd, len(self.buffer), self.stats)
            agreed = len(self.buffer) + sum(len(p) for p in draft.pieces[:kept])
            for check in checks:
                check.freeze(min(agreed, len(check.text)))
            self.drafting.adapt(rnd, replacement)
        self.pending = rnd.carry
        before = self.stats.tokens
        self._accept(rnd, kept, replacement)
        held_all = rnd.window is not None and replacement is None and self.stats.tokens == before + rnd.seen
        if held_all and self.finish_reason is None:
            self._finish("length")  # a verifier's window holds no more of the text
        self.stats.rounds += 1
        self.stats.forward_passes = {t.name: t.passes for t in self.tracks}
        if self.finished or self._cancelled:
            self._release()

    # -- what a round leaves: accepted text, counted points, loop steering -------------------------------
    def _accept(self, rnd: Round, kept: int, replacement: list[int] | None) -> None:
        """Move `kept` drafted tokens (+ a replacement) into the text; crop the drafter where they diverge."""
        drafter, draft, cfg = self.drafter, rnd.draft, self.config
        member = drafter.member
        first = self.stats.tokens
        base = drafter.prompt_len + first
        ids, pieces = draft.ids[:kept], draft.pieces[:kept]
        ended = bool(ids) and not pieces[-1]
        entries = self.logprobs.of_round(rnd, kept) if self.logprobs is not None else []
        windowed = False  # a verifier's window ends the text inside the replacement
        if replacement is not None:
            room = cfg.max_new_tokens - first - kept  # >= 1: the replaced position was within the budget and window
            if member.context_window is not None:
                room = min(room, member.context_window - base - kept)
            spelled = [member.token_bytes[t] or b"" for t in replacement[: max(room, 1)]]
            held = max(self._texts_held(ids, pieces, spelled) - 1, 0)
            windowed = held < len(spelled)
            replacement, spelled = replacement[:held] or None, spelled[:held]
        if replacement is not None:
            ended = replacement[0] in member.eos_ids
            constraint = grammar_at(self.constraint, first, draft, kept)
            if constraint is not None:
                constraint.consume(replacement)
            ids = ids + replacement
            pieces = pieces + spelled
            if self.logprobs is not None:
                entries += self.logprobs.of_replacement(rnd, kept, replacement)
            drafter.ids = drafter.ids[:base] + ids
            drafter.cached = min(drafter.cached, base + kept)
            self.pending = Draft()
        back = None
        for n, piece in enumerate(pieces, 1):  # token by token: a stop string ends the count where it appears
            if self.buffer.append(piece):
                ids = ids[:n]
                self._finish("stop")
                break
            if not piece:
                continue
            if cfg.loop_steer is not None:
                back = self.steering.target(self.buffer.data, self.stats, first, n, rnd.points)
                if back is not None:
                    ids = ids[:n]
                    break
            if cfg.loop_guard is not None and ends_in_loop(self.buffer.data, cfg.loop_span, cfg.loop_guard):
                ids = ids[:n]
                self._finish("repetition")
                break
        self.stats.tokens += len(ids)
        if self.logprobs is not None:
            self.logprobs.extend(entries[: len(ids)], pieces[: len(ids)])
        self.steering.commit(rnd.points, first, len(ids), self.stats, self.trace)
        if back is not None:
            self._go_back(back)
        elif self.finish_reason is None:
            if ended:
                self._finish("eos")
            elif self.stats.tokens >= cfg.max_new_tokens or windowed or self._drafter_window_full():
                self._finish("length")

    def _drafter_window_full(self) -> bool:
        """Whether the accepted text fills the drafter's window (not its ids: in the overlap schedule they hold
        a token drafted ahead, which the next round judges)."""
        drafter, window = self.drafter, self.drafter.member.context_window
        return window is not None and drafter.prompt_len + self.stats.tokens >= window

    def _go_back(self, point: Point) -> None:
        """Take back the text from `point` on (`steering`): the members, the grammar, the stats, the trace and
        the logprobs return to where they stood before it, and the drafter's own token is to stand there."""
        offset, kept = point.offset, point.token
        self.steering.take_back(point, self.stats, self.trace)
        if self.logprobs is not None:
            self.logprobs.truncate(offset)
        self.buffer.truncate(offset)
        if self.constraint is not None:
            self.constraint.rollback(len(self.constraint.ids) - kept)
        drafter = self.drafter
        drafter.ids = drafter.ids[: drafter.prompt_len + kept]
        drafter.cached = min(drafter.cached, len(drafter.ids))
        for track in self.verifiers:
            if track.frozen_bytes > offset:  # re-encoded whole next round; its cache keeps the common prefix
                track.frozen_ids = track.frozen_bytes = 0
        self.pending = Draft()

    # -- lifecycle -----------------------------------------------------------------------------------------
    def _finish(self, reason: str) -> None:
        if reason != "stop" and self.buffer.append(b"", final=True):
            reason = "stop"  # a cut character became U+FFFD, which completed a stop string
        self.finish_reason = reason
        self.pending = Draft()
        self.stats.wall_time_s = time.perf_counter() - self._started

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def fail(self, err: BaseException) -> None:
        """The request cannot go on: keep why (raised to its caller) and free its caches."""
        if self.error is None and not self.finished:
            self.error = err
            drop_frame_locals(err)
        self._cancelled = True
        self._release()  # called by whoever runs the round, so no round of this request is in progress

    def cancel(self) -> None:
        """Abandon the request: its KV caches are freed now, or when the round in progress ends."""
        self._cancelled = True
        if self._busy.acquire(blocking=False):
            try:
                self._release()
            finally:
                self._busy.release()

    def _release(self) -> None:
        """Free what the request holds: its caches, and the carried draft's rows of logits (a round's own go
        with its `Round`). Why the rows: each is a view into its round's batched [positions, vocab] logits, and
        a finished request stays referenced for a while (a server's stream objects, a caller's handle, a cycle
        the garbage collector reaches late): ~550 MB per wave of 128 requests on tiny models (benchmarks/soak.py).
        """
        self.pending = Draft()
        for track in self.tracks:
            track.release()

    def result(self) -> GenerationResult:
        """The finished request's result (its content and tool calls are the reply's: `shaping.reply`)."""
        assert self.finish_reason is not None
        logprobs = None if self.logprobs is None else self.logprobs.spelling(self.text)
        return GenerationResult(self.text, self.finish_reason, self.stats, self.trace, logprobs=logprobs)

    def visible_text(self) -> str:
        """Text that no later round can change: all of it once finished, else minus a possible stop prefix
        and, with loop steering, minus the text from the first replacement it may still go back to."""
        text = self.buffer.visible(self.finish_reason is not None)
        if self.finish_reason is None and self.config.loop_steer is not None:
            text = self.steering.visible(text, self.buffer.data)
        return text
