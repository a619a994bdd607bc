"""Running rounds: the forwards of one draft → verify → scan round, batched over many requests.

The algorithm (`algorithm.decoding.Generation`) says what each phase needs and takes what comes back; this
module runs the members' forwards for it: batched per member, on the lineup's executor where the members sit
on different devices, and in the overlap schedule with the verifiers beside the drafter.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

from ..algorithm.decoding import Generation
from ..algorithm.round import Round
from ..errors import MemberError, SafeEngineError, drop_frame_locals
from ..runtime.members import Job, Track
from ..runtime.placement import Placement, use_threads
from ..runtime.rows import Row


def run_round(gens: Sequence[Generation]) -> None:
    """One draft → verify → scan round of every request, batched phase by phase: each drafting step is one
    forward of the drafter over all requests still drafting, each verifier scores all requests' drafts in
    one forward, then every request scans and accepts on its own. A batch of one is a request alone.

    Failures are the requests' own: one that cannot go on keeps its error in `error` and frees its caches;
    the others continue. A failed forward fails every request of the batch."""
    with contextlib.ExitStack() as held:
        for gen in gens:
            held.enter_context(gen._busy)  # cancel() from another thread waits for the round to end
        try:
            _run_round(gens)
        finally:  # `_run_round`'s frame, now finished, holds the round's jobs: the failed ones' errors keep it
            for gen in gens:
                if gen.error is not None:
                    drop_frame_locals(gen.error)


def _run_round(gens: Sequence[Generation]) -> None:
    lone = gens[0] if len(gens) == 1 else None  # with many live requests, batching comes first
    overlap = lone is not None and lone.can_overlap
    placement = gens[0].placement
    if placement is not None:  # beside the verifiers, alone (rounds, single), or a batch's phases: each its count
        count = placement.batch if lone is None else placement.drafter if overlap else placement.alone
        use_threads(count, placement.process)
    started, rounds = time.perf_counter(), gens[0].stats.rounds
    ahead = gens[0].stats.tokens + len(gens[0].pending)  # accepted + drafted ahead (carried into the round)
    live: list[tuple[Generation, Round]] = []  # each request with its round
    for gen in gens:
        try:
            live.append((gen, gen.begin_round(overlap, batched=lone is None)))
        except Exception as err:  # this request alone (timed out, cancelled, finished)
            gen.fail(err)
    try:
        if overlap and live:
            _overlapped(*live[0])
        else:
            drafting = [(g, r) for g, r in live if r.drafting]
            while drafting:
                for (gen, rnd), rows in zip(drafting, _score_all([(g.drafter, g.draft_job()) for g, _ in drafting])):
                    gen.take_draft(rnd, rows)
                drafting = [(g, r) for g, r in drafting if r.drafting]
            checks = [c for g, r in live for c in g.verify(r)]
            work = [(c.track, c.job) for c in checks]
            for check, rows in zip(checks, _verify(work, [g for g, _ in live])):
                check.take(rows)
        for gen, rnd in live:
            gen.end_round(rnd)
    except Exception as err:  # a forward failed: every request of the batch fails with it
        for gen, _ in live:
            gen.fail(err)
    except BaseException as err:  # KeyboardInterrupt and the like: free everything, then let it through
        for gen, _ in live:
            gen.fail(err)
        raise
    gauge = lone.schedule_gauge if lone is not None else None
    if gauge is not None and lone is not None and lone.error is None and rounds > 0:  # not the prompt's round
        # the round's progress: tokens accepted plus those carried ahead, less those it was handed (an overlapped
        # round accepts what the round before drafted; a replacement drops what was drafted past it)
        progress = lone.stats.tokens + len(lone.pending) - ahead
        if progress >= 0:  # loop steering may have taken tokens back: a round that times neither schedule
            gauge.record("overlap" if overlap else "rounds", time.perf_counter() - started, progress)


def _verify(work: Sequence[tuple[Track, Job]], live: Sequence[Generation]) -> list[list[Row]]:
    """The verifiers' rows in a round without overlap. A lone request on the CPU scores them on the drafter's
    thread, after its drafting, with the count measured fastest for them (`Placement.verifying`): one phase
    after another, with no hand-over to another thread and its own thread team."""
    placement = live[0].placement if live else None
    if len(live) == 1 and placement is not None and work:
        use_threads(placement.verifying, placement.process)
    return _score_all(work, _executor(live))


def _on_verifier_threads(placement: Placement | None, fn: Any, *args: Any) -> Any:
    """`fn(*args)` with the verifiers' thread count beside the drafter, where the engine places threads."""
    if placement is not None:
        use_threads(placement.verifiers, placement.process)
    return fn(*args)


def _overlapped(gen: Generation, rnd: Round) -> None:
    """The drafter's next chunk and the verifiers' pass over the text before it, at the same time; both are
    timed for the schedule gauge."""
    executor = gen.executor
    assert executor is not None, "the overlap schedule needs the lineup's executor (see Generation.can_overlap)"
    checks = gen.verify(rnd)
    work = [(c.track, c.job) for c in checks]
    reads_prompt = any(c.track.passes == 0 for c in checks)  # a verifier's first pass: the prompt too
    verifying = executor.submit(_timed, _on_verifier_threads, gen.placement, _score_all, work) if checks else None
    drafter_s = 0.0
    try:
        while rnd.drafting:
            drafted, seconds = _timed(_score_all, [(gen.drafter, gen.draft_job())])
            gen.take_draft(rnd, drafted[0])
            drafter_s += seconds
    finally:
        rows, verifiers_s = verifying.result() if verifying is not None else ([], None)  # never leave one running
    for check, check_rows in zip(checks, rows):
        check.take(check_rows)
    if gen.schedule_gauge is not None and drafter_s and verifiers_s is not None and not reads_prompt:
        gen.schedule_gauge.record_chunk(verifiers_s / drafter_s, gen.config.draft_length)


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def _executor(gens: Sequence[Generation]) -> Executor | None:
    return gens[0].executor if gens and gens[0].parallel_members else None


def _score_all(work: Sequence[tuple[Track, Job]], executor: Executor | None = None) -> list[list[Row]]:
    """Rows for each (track, job), one `score_many` per member (members on different devices at once)."""
    by_member: dict[int, list[tuple[Track, Job]]] = {}
    for track, job in work:
        by_member.setdefault(id(track.member), []).append((track, job))
    groups = list(by_member.values())
    if executor is not None and len(groups) > 1:
        scored = [future.result() for future in [executor.submit(_score_group, g) for g in groups]]
    else:
        scored = [_score_group(g) for g in groups]
    rows_of = {id(job): rows for group, group_rows in zip(groups, scored) for (_, job), rows in zip(group, group_rows)}
    return [rows_of[id(job)] for _, job in work]


def _score_group(group: list[tuple[Track, Job]]) -> list[list[Row]]:
    """One member's `score_many` over its jobs; a failure is that member's, for every job of the batch.

    A plain function, not a closure: a failed call's frames (kept by the error) hold the jobs only in
    locals, which `drop_frame_locals` clears (a frame keeps its function, and a closure its cells)."""
    track = group[0][0]
    try:
        return track.member.score_many([job for _, job in group])
    except SafeEngineError:
        raise
    except Exception as err:  # out of memory, a CUDA error, a broken model: it fails the whole batch
        raise MemberError(
            f"member {track.name!r} failed in a forward pass over {len(group)} request(s): {type(err).__name__}: {err}",
            member=track.name,
        ) from err
