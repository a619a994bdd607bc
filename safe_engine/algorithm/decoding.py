"""The draft → verify loop shared by every strategy.

One `Generation` is one request. Each round has three phases:
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

import codecs
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol, cast

import torch

from ..errors import ConfigError, GenerationTimeout, InputError, drop_frame_locals
from ..runtime.members import Job, Member, Track
from ..runtime.placement import Placement
from ..runtime.rows import Draws, LocalRow, Row, race_sample
from ..shaping.constrained import Constraint
from ..shaping.request import Request
from ..stats import EnsemblePoint, EnsembleStats, GenerationResult, TokenLogprob
from .aggregation import Pick, UnionVocab, eos_ids, token_string
from .alignment import Verification
from .decision import Judge, Verdict
from .logprobs import Logprobs
from .text import TextBuffer, ends_in_loop, loop_period

CARRY_LIMIT = 3  # judge anyway once the carried-over tokens exceed this many drafts (a verifier token that
# keeps growing, like a long run of "=", must not postpone the decision forever)
UNSURE = 0.4  # a drafted token below this probability is a likely ensemble point (transformers' assistant default)
STEER_REACH = 512  # bytes: loop steering goes back at most this far (the study's loops: periods of 4 to 265
# characters), so a stream holds back at most this much text behind the decoding


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

    def __len__(self) -> int:
        return len(self.ids)


class Point(NamedTuple):
    """A committed ensemble point, as loop steering needs it: where it is in the text and what it did."""

    offset: int  # byte offset of its token in the generated text
    token: int  # index of its token among the generated ones
    replaced: bool
    steered: bool


class Gauge(Protocol):
    """The engine's schedule gauge (`engine.gauge.ScheduleGauge`), as a request's rounds use it: which schedule
    to run, the overlap chunk, and each round's timing."""

    chunk: int

    def choose(self) -> str: ...

    def record(self, schedule: str, seconds: float, tokens: int) -> None: ...

    def record_chunk(self, ratio: float, limit: int) -> None: ...


@dataclass
class Lineup:
    """The ensemble as one request's decoding sees it: the members, their names and weights, the drafter's
    index, and what the ensemble's requests share (a thread pool for forwards of different members at once,
    the overlap gauge, GaC's union vocabulary, built on first use)."""

    members: Sequence[Member]
    names: Sequence[str]
    drafter: int
    weights: torch.Tensor
    executor: Executor | None = None  # runs forwards of different members at once (overlap, devices)
    parallel_members: bool = False  # the verifiers sit on different devices: score them concurrently
    schedule_gauge: Gauge | None = None  # given when a free core or device exists (schedule="auto")
    union: Callable[[], UnionVocab] | None = None  # GaC's union vocabulary of the members
    placement: Placement | None = None  # threads per kind of forward, for members on the CPU


class Generation:
    """One request decoded by the ensemble; `step()` runs one round and returns whether it finished."""

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
        if strategy.full_vocabulary and any(getattr(members[i], "is_remote", False) for i in active):
            raise ConfigError(
                "aggregation='gac' needs every member's full next-token distribution, which never leaves a Ray "
                "actor (GaC is local-only); use aggregation='unite' with Ray members"
            )
        self.constraint: Constraint | None = None
        if request.grammar is not None:
            if getattr(members[drafter], "is_remote", False):
                raise ConfigError(
                    "constrained output (tools, json_schema) masks the drafter's logits, which stay in its Ray "
                    "actor; use a local drafter"
                )
            self.constraint = Constraint(request.grammar, members[drafter])
        remote = [lineup.names[i] for i in active if getattr(members[i], "is_remote", False)]
        if remote and config.penalized:
            raise ConfigError(
                f"penalties are applied to each member's logits, which stay in its Ray actor ({', '.join(remote)}); "
                "use local members, or leave frequency_penalty / presence_penalty at 0 and repetition_penalty at 1"
            )
        if config.logit_bias and getattr(members[drafter], "is_remote", False):
            raise ConfigError(
                "logit_bias is added to the drafter's logits, which stay in its Ray actor; use a local drafter"
            )
        self.tracks = [Track(members[i], request.encode(members[i]), lineup.names[i]) for i in active]
        self.tracks[0].logit_bias = config.logit_bias  # the bias is in the drafter's token ids
        self.gates = strategy.gates
        self.executor = lineup.executor
        self.parallel_members = lineup.parallel_members
        self.schedule_gauge = lineup.schedule_gauge
        self.placement = lineup.placement
        self.draft_length = config.draft_length  # adapted per round with `adaptive_draft`
        self.draws = Draws(config.seed)
        weights = lineup.weights[active] / lineup.weights[active].sum()
        union = lineup.union() if strategy.full_vocabulary and lineup.union is not None else None
        self.judge = Judge([t.member for t in self.tracks], weights, config, union, self.draws)
        self.stats = EnsembleStats(method=strategy.method, gates=strategy.labels, note=strategy.note)
        self.stats.prompt_tokens = {t.name: t.prompt_len for t in self.tracks}
        self.trace: list[EnsemblePoint] | None = [] if config.trace else None
        # With logprobs: an entry per accepted token, the byte offset where each ends, and this round's
        # decided positions (draft index -> the distribution, the chosen string) and the draft positions that a
        # GaC pick of several ids covers
        self.logprobs = Logprobs(self.drafter.member, config.logprobs) if config.logprobs is not None else None
        self._decided: dict[int, tuple[list[bytes], torch.Tensor, bytes]] = {}
        self._covered: set[int] = set()
        self.buffer = TextBuffer(config.stop)
        self.pending = Draft()  # drafted tokens carried into the next round
        self.draft = Draft()  # this round's tokens not accepted yet
        self.checks: list[Verification] = []  # this round's verifications
        self._to_draft = self._budget = 0
        self._verified: int | None = 0  # drafted tokens the verifiers see this round (all of them, but in overlap)
        # this round's ensemble points (committed on accept): position, byte offset, verdict, replaced, the bytes
        # handed over, steered away from a repetition
        self._points: list[tuple[int, int, Verdict, bool, bytes | None, bool]] = []
        # loop steering: the committed ensemble points, the offsets where the drafter's token is to stand, and
        # the offset before which steering no longer goes back (text before it may have been streamed)
        self._committed: list[Point] = []
        self._kept: set[int] = set()
        self._settled = 0
        self._cut_short = False  # this round's draft ended early at an unsure token
        self._adaptive = config.adaptive_draft  # this round adapts its draft (never in a batch)
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

    @property
    def text(self) -> str:
        return self.buffer.text

    # -- the round, phase by phase (engine.rounds.run_round batches each phase over many requests) --------
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

    def begin_round(self, overlap: bool = False, batched: bool = False) -> None:
        """Start a round: the carried tokens become the draft; up to n new ones follow (1 without gates; the
        gauge's chunk in the overlap schedule, where the verifiers meanwhile score the carried ones). In a
        batch (`batched`) the draft keeps the configured length: the batch drafts in lockstep, and one request
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
        cfg = self.config
        self.draft, self.pending = self.pending, Draft()
        self._budget = cfg.max_new_tokens - self.stats.tokens
        self._adaptive = cfg.adaptive_draft and not batched
        if not self.gates:
            n = 1
        elif overlap:
            n = min(self.schedule_gauge.chunk, cfg.draft_length) if self.schedule_gauge is not None else 1
        else:
            n = self.draft_length if self._adaptive else cfg.draft_length
        self._to_draft = min(n, self._budget - len(self.draft))
        self.checks = []
        self.draft.final |= self._to_draft <= 0
        self._verified = len(self.draft) if overlap and self._to_draft > 0 else None
        self._cut_short = False

    @property
    def drafting(self) -> bool:
        return self._to_draft > 0 and not self.draft.final

    def draft_job(self) -> Job:
        """The drafter's next forward: its distribution after everything drafted so far."""
        return self.drafter.job(self.config)[0]

    def take_draft(self, rows: list[Row]) -> None:
        """The drafter's next token from its distribution (sampled, or its argmax)."""
        drafter, draft = self.drafter, self.draft
        drafter.done()
        row = rows[-1]
        # Under a grammar the token is drawn from the masked row (speculative sampling's q); the ensemble
        # aggregates the unmasked one, like every verifier's, and restricts its candidates afterwards.
        # (a grammar needs a local drafter, checked in __init__, so its rows are LocalRows)
        drawn: Row = row if self.constraint is None else cast(LocalRow, row).masked(self.constraint.mask_logits)
        position = self.stats.tokens + len(draft)
        tok = drawn.sample(self.draws.key("draft", position)) if self.config.do_sample else drawn.argmax()
        if self.constraint is not None:
            self.constraint.consume([tok])
        drafter.ids.append(tok)
        piece = token_string(drafter.member, tok)
        draft.ids.append(tok)
        draft.rows.append(row)
        draft.drawn.append(drawn)
        draft.pieces.append(piece or b"")
        self._to_draft -= 1
        if not piece or drafter.full:  # EOS or another control token ends the draft
            draft.final = True
        draft.final |= len(draft) >= self._budget
        if self._to_draft > 1 and self._verified is None and self._likely_ensemble_point(tok, row):
            self._to_draft, self._cut_short = 1, True  # one token of look-ahead, then verify

    def _likely_ensemble_point(self, tok: int, row: Row) -> bool:
        """Whether drafting on past `tok` is likely wasted: the drafter is unsure of it and it starts where
        every tokenizer has a boundary (only there can the ensemble replace it)."""
        if not self._adaptive or float(row.logprob([tok]).exp()) >= UNSURE:
            return False
        if "boundary" not in self.gates:
            return True
        offset = len(self.buffer) + sum(len(p) for p in self.draft.pieces[:-1])
        text = bytes(self.buffer.data) + b"".join(self.draft.pieces)
        own = self.drafter.member.vocab.fingerprint
        for t in self.verifiers:
            if t.member.vocab.fingerprint == own:
                continue
            _, starts = t.member.vocab.encode(text[t.frozen_bytes :])
            if offset - t.frozen_bytes not in starts:
                return False
        return True

    def verify(self) -> list[Verification]:
        """The verifiers' views of this round (their forwards are run by the caller: one job each).

        Nothing is verified for `single`, or where no drafted position can be an ensemble point whatever
        the verifiers say (GaC with a confident drafter everywhere). Without gates (every-token ensembling)
        a verifier reads only the accepted text, as it would generating alone; otherwise also the draft."""
        draft = self.draft
        if not self.strategy.ensembles or all(self.judge.drafter_confident(row) for row in draft.rows):
            return []
        drafter = self.drafter
        accepted = bytes(self.buffer.data)
        generated = drafter.ids[drafter.prompt_len : drafter.prompt_len + self.stats.tokens]
        text = accepted
        if self.gates:
            seen = len(draft) if self._verified is None else self._verified
            if seen == 0:
                return []  # overlap: nothing drafted before this round's token yet
            text += b"".join(draft.pieces[:seen])
            generated += [t for t, piece in zip(draft.ids[:seen], draft.pieces[:seen]) if piece]  # control: no text
        own = drafter.member.vocab.fingerprint
        self.checks = [
            Verification(t, text, len(accepted), generated if t.member.vocab.fingerprint == own else None, self.config)
            for t in self.verifiers
        ]
        return self.checks

    def end_round(self) -> None:
        """Scan the verified draft, accept what stands, crop caches; finish when the text is complete."""
        draft, checks = self.draft, self.checks
        seen = len(draft) if self._verified is None else self._verified
        if not checks:  # nothing could be an ensemble point (single, a confident GaC drafter) or nothing seen yet
            if seen < len(draft):  # overlap: the token drafted this round waits for the verifiers
                self.pending = draft.cut(seen)
            self._accept(draft, seen, None)
        elif any(c.too_long for c in checks):
            self._finish("length")
        else:
            kept, replacement = self._scan_phase(draft, checks)
            agreed = len(self.buffer) + sum(len(p) for p in draft.pieces[:kept])
            for check in checks:
                check.freeze(min(agreed, len(check.text)))
            self._adapt(replacement)
            self._accept(draft, kept, replacement)
        self.checks = []
        self.stats.rounds += 1
        self.stats.forward_passes = {t.name: t.passes for t in self.tracks}
        if self.finished or self._cancelled:
            self._release()

    def _adapt(self, replacement: list[int] | None) -> None:
        """Draft length follows the replacements: one shorter after one, one longer after a clean round."""
        if not self._adaptive or self._verified is not None:
            return
        base = self.config.draft_length
        if replacement is not None:
            self.draft_length = max(2, self.draft_length - 1)
        elif not self._cut_short:  # tokens carried into the next round are not a miss
            self.draft_length = min(2 * base, self.draft_length + 1)

    def _scan_phase(self, draft: Draft, checks: list[Verification]) -> tuple[int, list[int] | None]:
        """How many drafted tokens are accepted, and the drafter ids replacing the next one (or None).

        Tokens after the accepted ones stay in `self.pending` when their judgement is deferred (and, in the
        overlap schedule, the token drafted while the verifiers ran)."""
        seen = len(draft) if self._verified is None else self._verified
        final = (draft.final and seen == len(draft)) or len(draft) > CARRY_LIMIT * self.config.draft_length
        offset = len(self.buffer)
        j = 0
        while j < seen:
            here = offset
            offset += len(draft.pieces[j])
            views = self._views(here, draft, j, checks, final)
            if views is None:  # boundary gate: some tokenizer splits the text inside this token
                j += 1
                continue
            rows, owns, cuts, aligned = views
            constrain = None if self.constraint is None else (lambda j=j: self._grammar_at(j))
            verdict = self.judge.judge(
                here,
                draft.ids[j],
                [draft.rows[j], *rows],
                owns,
                cuts,
                aligned,
                constrain,
                draft.drawn[j],
                self.stats.tokens + j,
            )
            if verdict.deferred:
                self.stats.deferred_positions += 1
                self.pending = draft.cut(j)
                return j, None
            pick = verdict.pick
            ids = None if pick is None else self._ids_of(pick, draft.drawn[j], self.stats.tokens + j)
            replaced = ids is not None and ids != draft.ids[j : j + len(ids)]
            steered = replaced and here in self._kept
            if steered:  # the drafter's token stands, and so does its own distribution in the logprobs
                ids, replaced = draft.ids[j : j + 1], False
            elif verdict.decided_from is not None:
                chosen = verdict.pick.text if verdict.pick is not None else draft.pieces[j]
                self._decided[j] = (*verdict.decided_from, chosen)
                if ids is not None and not replaced:
                    self._covered.update(range(j + 1, j + len(ids)))
            if verdict.ensembled:
                handed = b"".join(self.drafter.member.token_bytes[t] or b"" for t in ids) if ids else None
                self._points.append((j, here, verdict, replaced, handed, steered))
            if replaced:
                self.stats.discarded_draft_tokens += len(draft) - j - 1
                return j, ids
            self._constraint_at(len(draft))  # a look at position j rolled the grammar back: catch up
            if ids is not None and len(ids) > 1:  # GaC's string is the draft's next tokens: skip past them
                offset += sum(len(p) for p in draft.pieces[j + 1 : j + len(ids)])
                j += len(ids) - 1
            j += 1
        if seen < len(draft):
            self.pending = draft.cut(seen)
        return seen, None

    def _views(self, offset: int, draft: Draft, j: int, checks: list[Verification], final: bool):
        """Each verifier's distribution, own token ids and whether these are cut at `offset`, and whether
        every tokenizer has a boundary there; None where the boundary gate skips the position."""
        aligned = all(offset in c.at for c in checks)
        if not aligned and "boundary" in self.gates:
            return None
        rows, owns, cuts = [], [], []
        for c in checks:
            if offset in c.at:
                row, own, cut = c.view(offset, final)
                if offset == len(c.text) and offset < len(self.buffer) + sum(map(len, draft.pieces)):
                    # every-token: the verifier read only the accepted text; its own token is how it would
                    # begin the drafted text
                    own = [draft.ids[j]] if c.same_vocab else self._first_ids(c.track.member, draft, j)
                    if self.trace is not None:
                        aligned &= c.starts_token_at(offset, b"".join(draft.pieces[j:]))
            else:
                row, own, cut = c.prefix_view(offset, final)
            rows.append(row)
            owns.append(own)
            cuts.append(cut)
        return rows, owns, cuts, aligned

    def _constraint_at(self, j: int) -> Constraint | None:
        """The grammar at drafted position j (rolled back, or caught up with the draft's ids)."""
        constraint = self.constraint
        if constraint is None:
            return None
        consumed, target = len(constraint.ids) - self.stats.tokens, j
        if consumed > target:
            constraint.rollback(consumed - target)
        elif consumed < target:
            constraint.consume(self.draft.ids[consumed:target])
        return constraint

    def _grammar_at(self, j: int) -> Constraint:
        """`_constraint_at` for a request that has a grammar."""
        constraint = self._constraint_at(j)
        assert constraint is not None, "only asked for when the request has a grammar"
        return constraint

    @staticmethod
    def _first_ids(member: Member, draft: Draft, j: int) -> list[int]:
        text = b"".join(draft.pieces[j:])
        first = member.vocab.first_id(text) if text else None
        return [first] if first is not None else eos_ids(member)

    def _ids_of(self, pick: Pick, row: Row, position: int) -> list[int]:
        """The drafter ids a pick becomes. UniTE hands the drafter one id, its first token of the string,
        and lets it continue from there (as the reference does); GaC the whole string re-encoded.

        With `token_healing` (the default), a pick the drafter spells with one token is handed as the token
        the drafter itself would spell the text with: its likeliest token (under `row`, the distribution the
        drafted token was drawn from) that starts with the pick and agrees with all of it. Why: a verifier's
        token is often a piece of one of the drafter's (":" of ":\n", "\n" of "\n\n", " sub" of
        " subspace"); handed the piece, the drafter continues from a split its tokenizer never makes, a
        sequence it was not trained on (issue 31: such handovers preceded most loops of the accuracy study)."""
        member = self.drafter.member
        if pick.eos:
            return [min(member.eos_ids)]
        single = member.vocab.id_of_bytes.get(pick.text)
        ids = [single] if single is not None else member.vocab.encode(pick.text)[0]
        if self.strategy.aggregation == "unite":
            ids = ids[:1]
        if len(ids) == 1 and self.config.token_healing:
            ids = [self._healed(ids[0], pick.text, row, position)]
        return ids

    def _healed(self, first: int, text: bytes, row: Row, position: int) -> int:
        """The drafter's token that spells the start of `text` as the drafter would (see `_ids_of`)."""
        vocab = self.drafter.member.vocab
        start = vocab.token_bytes[first] or b""
        spellings, ids = vocab.extensions(start)
        if text != start:  # a pick of several drafter tokens: keep to spellings that agree with all of it
            ids = [tid for b, tid in zip(spellings, ids) if b.startswith(text) or text.startswith(b)]
        if len(ids) <= 1:
            return first
        logprobs = row.logprob(ids)
        if not bool(torch.isfinite(logprobs).any()):
            return first  # top-p left none of them: the pick's own token stands
        if self.config.do_sample:
            return ids[race_sample(logprobs, self.draws.key("heal", position))]
        return ids[int(torch.argmax(logprobs))]

    def _commit_points(self, first: int, accepted: int) -> None:
        """Count this round's ensemble points among the `accepted` tokens, the first of which is generated token
        `first` (a stop string may end the text before some judged positions)."""
        for j, offset, verdict, replaced, handed, steered in self._points:
            if j >= accepted:
                break
            if self.config.loop_steer is not None:
                self._committed.append(Point(offset, first + j, replaced, steered))
            self.stats.ensembled_tokens += 1
            self.stats.replaced_tokens += replaced
            self.stats.steered_tokens += steered
            if self.trace is not None and verdict.point is not None:
                shown = verdict.point.drafted if handed is None else handed.decode("utf-8", errors="replace")
                self.trace.append(replace(verdict.point, replaced=replaced, handed=shown, steered=steered))
        self._points = []

    # -- bookkeeping ------------------------------------------------------------------------------------
    def _accept(self, draft: Draft, kept: int, replacement: list[int] | None) -> None:
        """Move `kept` drafted tokens (+ a replacement) into the text; crop the drafter where they diverge."""
        drafter = self.drafter
        member = drafter.member
        first = self.stats.tokens
        base = drafter.prompt_len + first
        budget = self.config.max_new_tokens - self.stats.tokens
        ids = draft.ids[:kept]
        pieces = draft.pieces[:kept]
        ended = bool(ids) and not pieces[-1]
        decided, covered = self._decided, self._covered
        self._decided, self._covered = {}, set()
        entries = [self._entry(draft, j, decided, covered) for j in range(kept)] if self.logprobs is not None else []
        if replacement is not None:
            room = budget - kept  # >= 1: the replaced position was within the budget and the window
            if member.context_window is not None:
                room = min(room, member.context_window - base - kept)
            replacement = replacement[: max(room, 1)]
            ended = replacement[0] in member.eos_ids
            constraint = self._constraint_at(kept)
            if constraint is not None:
                constraint.consume(replacement)
            ids = ids + replacement
            pieces = pieces + [member.token_bytes[t] or b"" for t in replacement]
            if self.logprobs is not None:
                strings, target, chosen = decided[kept]
                entries += [self.logprobs.ensemble(replacement[0], strings, target, chosen)]
                entries += [self.logprobs.determined(t) for t in replacement[1:]]
            drafter.ids = drafter.ids[:base] + ids
            drafter.cached = min(drafter.cached, base + kept)
            self.pending = Draft()
        guard, back = self.config.loop_guard, None
        for n, piece in enumerate(pieces, 1):  # token by token: a stop string ends the count where it appears
            if self.buffer.append(piece):
                ids = ids[:n]
                self._finish("stop")
                break
            if not piece:
                continue
            if self.config.loop_steer is not None and (back := self._steer_target(first, n)) is not None:
                ids = ids[:n]
                break
            if guard is not None and ends_in_loop(self.buffer.data, self.config.loop_span, guard):
                ids = ids[:n]
                self._finish("repetition")
                break
        self.stats.tokens += len(ids)
        if self.logprobs is not None:
            self.logprobs.extend(entries[: len(ids)], pieces[: len(ids)])
        self._commit_points(first, len(ids))
        if back is not None:
            self._go_back(back)
        elif self.finish_reason is None:
            if ended:
                self._finish("eos")
            elif self.stats.tokens >= self.config.max_new_tokens or drafter.full:
                self._finish("length")

    def _steer_target(self, first: int, n: int) -> Point | None:
        """Loop steering, checked at each token's end (here the round's n-th, generated token first + n - 1):
        where the text has come to end in a repetition (a stretch of loop_span+ bytes, loop_steer times in a
        row, digits counting as equal) and an ensemble replacement lies inside those copies, the first such
        replacement, to go back to and let the drafter's own token stand there.

        Why there, and why afterwards: in the accuracy study a pick starts the loop and the drafter continues
        it alone (issue 31, mmlu-redux/nutrition/1: a pick began the sentence's second copy, and the drafter
        wrote every later copy with no replacement). The loop is certain only once the copies stand, when that
        pick lies behind, often in the first copy: the drafter copies the pick along with the rest (all eight
        GSM8K UniTE+SAFE loops that survived going back to the last copy, traced). Going back to it undoes the
        ensemble's part in the loop and nothing else. Digits count as equal because most GSM8K loops are
        numbered lists that repeat their lines ("13. **Step 13: ..."). A loop with no replacement in its copies
        is the drafter's own and stays (the guard can end it).
        Checked token by token, the greedy text is the same whatever the rounds; each token taken back is
        decoded again, at most max_new_tokens of them per answer, and never further back than STEER_REACH bytes
        from the end."""
        data, copies = self.buffer.data, cast(int, self.config.loop_steer)
        settled = self._settled
        self._settled = max(settled, len(data) - STEER_REACH)
        if self.stats.rolled_back_tokens >= self.config.max_new_tokens:
            return None  # the budget is spent: no per-token loop search any more
        period = loop_period(data, self.config.loop_span, copies, digits_equal=True)
        if period is None:
            return None
        start = max(len(data) - copies * period, settled)
        fresh = (Point(o, first + j, r, s) for j, o, _, r, _, s in self._points if j < n)
        target = next((p for p in itertools.chain(self._committed, fresh) if p.replaced and p.offset >= start), None)
        if target is None or self.stats.rolled_back_tokens + first + n - target.token > self.config.max_new_tokens:
            return None
        return target

    def _go_back(self, point: Point) -> None:
        """Take back the text from `point` on: the members, the grammar, the stats, the trace and the logprobs
        return to where they stood before it, and the drafter's own token is to stand there."""
        offset, kept = point.offset, point.token
        dropped = [p for p in self._committed if p.offset >= offset]
        self._committed = self._committed[: len(self._committed) - len(dropped)]
        stats = self.stats
        stats.ensembled_tokens -= len(dropped)
        stats.replaced_tokens -= sum(p.replaced for p in dropped)
        stats.steered_tokens -= sum(p.steered for p in dropped)
        stats.rolled_back_tokens += stats.tokens - kept
        stats.tokens = kept
        self._kept = {o for o in self._kept if o < offset} | {offset}
        if self.trace is not None:
            self.trace = [p for p in self.trace if p.offset < offset]
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

    def _entry(
        self, draft: Draft, j: int, decided: dict[int, tuple[list[bytes], torch.Tensor, bytes]], covered: set[int]
    ) -> TokenLogprob:
        """The logprob entry of drafted token j: the ensemble's where it decided j, the drafter's otherwise."""
        assert self.logprobs is not None
        if j in decided:
            strings, target, chosen = decided[j]
            return self.logprobs.ensemble(draft.ids[j], strings, target, chosen)
        if j in covered:
            return self.logprobs.determined(draft.ids[j])
        return self.logprobs.drafter(draft.ids[j], draft.drawn[j])

    def _finish(self, reason: str) -> bool:
        if reason != "stop" and self.buffer.append(b"", final=True):
            reason = "stop"  # a cut character became U+FFFD, which completed a stop string
        self.finish_reason = reason
        self.pending = Draft()
        self.stats.wall_time_s = time.perf_counter() - self._started
        self.stats.forward_passes = {t.name: t.passes for t in self.tracks}
        return True

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
        """Free what the request holds: its caches, and the round's rows of logits.

        Why the rows too: a row is a view into its round's batched logits (a whole [positions, vocab] block),
        and a finished request stays referenced for a while (a server's stream objects, a caller's handle, a
        reference cycle the garbage collector only reaches in its rare full passes). Measured on a server:
        ~550 MB of such blocks per wave of 128 requests on tiny models (benchmarks/soak.py).
        """
        self.checks = []  # a round cut short leaves its verifications, whose jobs hold the caches
        self.draft, self.pending = Draft(), Draft()
        self._decided, self._covered = {}, set()
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
            revisable = next((p.offset for p in self._committed if p.replaced and p.offset >= self._settled), None)
            if revisable is not None:
                decoded = codecs.getincrementaldecoder("utf-8")("replace").decode(bytes(self.buffer.data[:revisable]))
                text = text[: len(decoded)]
        return text
