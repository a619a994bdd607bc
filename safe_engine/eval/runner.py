"""Resumable evaluation runner: every (configuration, problem) pair is generated once and saved at once.

Why resumable: a full SAFE comparison is hours of generation (several configurations x thousands of
problems, outputs of up to 2,048 tokens). The runner appends one JSON line per finished pair and flushes
it, so an interrupted run (crash, preemption, Ctrl-C) loses at most the pair in flight, and a rerun with
the same output file skips every pair already recorded.

A *configuration* is any callable ``problem -> dict`` returning at least ``text`` (plus, ideally,
``tokens``, ``ensembled_tokens``, ``wall_time_s``). :func:`make_ensemble_config` builds one from an
:class:`~safe_engine.Ensemble` and generation settings; tests and baselines can pass plain functions.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from tqdm.auto import tqdm

from safe_engine.eval.extract import Score, score
from safe_engine.eval.prompts import build_prompt, stop_strings
from safe_engine.eval.tasks import Problem

__all__ = [
    "ConfigFn",
    "completed_keys",
    "load_records",
    "make_batched_single_config",
    "make_ensemble_config",
    "problem_seed",
    "run_eval",
]

log = logging.getLogger(__name__)

#: One configuration under evaluation: generates for one problem, returns ``text`` and statistics.
ConfigFn = Callable[[Problem], Mapping[str, Any]]
#: Grades a generated text against a problem (default :func:`safe_engine.eval.extract.score`).
Scorer = Callable[[Problem, str], Score]

_STAT_FIELDS = ("tokens", "ensembled_tokens", "ensemble_rate", "wall_time_s", "tokens_per_s")


# --------------------------------------------------------------------------------------------------
# JSONL storage


def load_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a results JSONL file; a missing file is empty, a torn last line is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s:%d: unreadable line skipped (interrupted write?)", path, lineno)
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def completed_keys(path: str | os.PathLike[str]) -> set[tuple[str, str]]:
    """``(config, problem_id)`` pairs already recorded in ``path``."""
    return {(str(r["config"]), str(r["problem_id"])) for r in load_records(path) if "config" in r and "problem_id" in r}


def _open_for_append(path: Path) -> Any:
    """Open ``path`` for appending, first ending a torn last line so new records start on a fresh line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size > 0:
        with path.open("rb") as fh:
            fh.seek(-1, os.SEEK_END)
            torn = fh.read(1) != b"\n"
        if torn:
            with path.open("a", encoding="utf-8") as fh:
                fh.write("\n")
    return path.open("a", encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# Runner


def run_eval(
    configs: Mapping[str, ConfigFn],
    problems: Sequence[Problem],
    out_jsonl: str | os.PathLike[str],
    *,
    scorer: Scorer = score,
    order: Literal["problem", "config"] = "problem",
    on_error: Literal["raise", "skip"] = "raise",
    progress: bool = True,
    fsync: bool = False,
) -> list[dict[str, Any]]:
    """Run every configuration on every problem, appending one scored JSON line per pair to ``out_jsonl``.

    Pairs already present in ``out_jsonl`` are skipped (their configuration is not called), so rerunning
    the same command after an interruption finishes the job.

    Args:
        configs: name -> callable; the name is stored in each record and keys the resume logic.
        problems: the problems to run (ids must be unique).
        out_jsonl: results file, created if missing, only ever appended to.
        scorer: grades ``text`` for a problem; its ``prediction`` and ``correct`` are stored.
        order: ``"problem"`` runs all configurations on problem 1, then problem 2, ... (partial results
            stay comparable across configurations); ``"config"`` finishes one configuration first.
        on_error: ``"raise"`` stops at the first exception (the records written so far are kept);
            ``"skip"`` logs it and moves on, writing nothing for that pair so a rerun retries it.
        progress: show a tqdm progress bar.
        fsync: also ``os.fsync`` after each record (survives power loss, costs a little time).

    Returns:
        The records of ``out_jsonl`` that belong to ``configs`` x ``problems`` (old and new), in file order.
    """
    ids = [p.id for p in problems]
    if len(set(ids)) != len(ids):
        raise ValueError("problem ids must be unique; load each task once per run")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    path = Path(out_jsonl)
    done = completed_keys(path)
    pending = [(name, p) for name, p in _pairs(configs, problems, order) if (name, p.id) not in done]
    if done:
        log.info("%s: %d pairs already recorded, %d to run", path, len(done), len(pending))

    correct: dict[str, list[int]] = {name: [0, 0] for name in configs}
    bar = tqdm(total=len(pending), desc=f"eval {path.stem}", unit="gen", disable=not progress)
    try:
        with _open_for_append(path) as fh:
            for name, problem in pending:
                bar.set_postfix_str(f"{name} {problem.id}", refresh=False)
                try:
                    record = _run_one(name, configs[name], problem, scorer)
                except Exception:
                    if on_error == "raise":
                        raise
                    log.exception("config %r failed on %s; skipped (rerun to retry)", name, problem.id)
                    bar.update(1)
                    continue
                fh.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
                fh.flush()
                if fsync:
                    os.fsync(fh.fileno())
                correct[name][0] += int(bool(record["correct"]))
                correct[name][1] += 1
                bar.update(1)
                bar.set_postfix_str(_accuracy_postfix(correct), refresh=False)
    finally:
        bar.close()

    wanted_ids = set(ids)
    return [r for r in load_records(path) if r.get("config") in configs and r.get("problem_id") in wanted_ids]


def _pairs(configs: Mapping[str, ConfigFn], problems: Sequence[Problem], order: str) -> Iterable[tuple[str, Problem]]:
    if order == "config":
        return [(name, p) for name in configs for p in problems]
    if order == "problem":
        return [(name, p) for p in problems for name in configs]
    raise ValueError(f"order must be 'problem' or 'config', got {order!r}")


def _accuracy_postfix(correct: Mapping[str, list[int]]) -> str:
    return " ".join(f"{name}={c / n:.1%}" for name, (c, n) in correct.items() if n)


def _run_one(name: str, fn: ConfigFn, problem: Problem, scorer: Scorer) -> dict[str, Any]:
    start = time.perf_counter()
    out = dict(fn(problem))
    elapsed = time.perf_counter() - start
    if "text" not in out:
        raise KeyError(f"config {name!r} returned no 'text' for {problem.id} (keys: {sorted(out)})")
    text = str(out["text"] or "")
    graded = scorer(problem, text)
    record: dict[str, Any] = {
        "config": name,
        "problem_id": problem.id,
        "task": problem.task,
        "subtask": problem.subtask,
        "reference": problem.answer,
        "prediction": graded.prediction,
        "correct": bool(graded.correct),
    }
    for key in _STAT_FIELDS:
        record[key] = out.pop(key, None)
    if record["wall_time_s"] is None:
        record["wall_time_s"] = elapsed
    for key, value in out.items():  # text, finish_reason, settings, anything else the config reports
        record.setdefault(key, value)
    return record


# --------------------------------------------------------------------------------------------------
# Ensemble configurations


class _Generates(Protocol):
    """What :func:`make_ensemble_config` needs: the contract's ``Ensemble.generate`` (and ``Ensemble.stream``
    to decode a batch of problems together)."""

    def generate(self, *args: Any, **kwargs: Any) -> Any: ...


def problem_seed(seed: int, problem_id: str) -> int:
    """A per-problem seed derived from a run seed: sampling stays reproducible whatever the run order.

    A resumed run generates each remaining problem with exactly the seed it would have had originally.
    """
    return (seed * 1_000_003 + zlib.crc32(problem_id.encode("utf-8"))) % (2**31 - 1)


def make_ensemble_config(
    ensemble: _Generates,
    *,
    method: str = "safe",
    aggregation: str = "unite",
    do_sample: bool = False,
    seed: int | None = None,
    max_new_tokens: int = 512,
    chat: bool = True,
    fewshot: bool | None = None,
    problems: Sequence[Problem] | None = None,
    batch_size: int = 1,
    **generate_kwargs: Any,
) -> ConfigFn:
    """A configuration callable that prompts ``ensemble`` for a problem and reports text and statistics.

    With ``problems`` and ``batch_size`` > 1, a call for a problem not yet answered decodes it together with
    the next ``batch_size - 1`` problems of ``problems`` (``Ensemble.generate_batch``: continuous batching,
    each request's output as if alone); the record's ``wall_time_s`` is then the batch's time divided by its
    size, and ``batch_size`` says so.

    Uses the contract API: ``ensemble.generate(messages=..., **kw)`` for chat models (each member applies
    its own chat template), ``ensemble.generate(prompt_text, **kw)`` with few-shot text and stop strings
    for base models. The result's ``.text``, ``.finish_reason`` and ``.stats`` (``tokens``,
    ``ensembled_tokens``, ``ensemble_rate``, ``wall_time_s``, ``tokens_per_s``, ``replaced_tokens``,
    ``discarded_draft_tokens``, ``steered_tokens``, ``rolled_back_tokens``, ``forward_passes``) are copied
    into the record, with ``cpu_time_s`` (this process's CPU time, all threads; a batch's times are divided by
    its size).

    Args:
        method / aggregation / do_sample / max_new_tokens: passed to ``generate`` unchanged.
        seed: run seed; each problem gets :func:`problem_seed` of it, passed as ``seed=``.
        chat: chat messages (instruct models) or few-shot text (base models).
        fewshot: chat only: include the task exemplars as earlier turns (None: task default).
        generate_kwargs: any other GenerationConfig field (``draft_length``, ``top_k``, ``stop``, ...).
    """
    settings: dict[str, Any] = {
        "method": method,
        "aggregation": aggregation,
        "do_sample": do_sample,
        "max_new_tokens": max_new_tokens,
        "chat": chat,
        **generate_kwargs,
    }

    def request(problem: Problem) -> tuple[dict[str, Any], dict[str, Any]]:
        kwargs: dict[str, Any] = {
            "method": method,
            "aggregation": aggregation,
            "do_sample": do_sample,
            "max_new_tokens": max_new_tokens,
            **generate_kwargs,
        }
        stops = tuple(kwargs.get("stop") or ()) or stop_strings(problem, chat=chat)
        if stops:
            kwargs["stop"] = stops
        if seed is not None:
            kwargs["seed"] = problem_seed(seed, problem.id)
        prompt = build_prompt(problem, chat=chat, fewshot=fewshot)
        return {"messages": prompt} if chat else {"prompt": prompt}, kwargs

    def record(result: Any, kwargs: dict[str, Any], elapsed: float, cpu: float, batch: int) -> dict[str, Any]:
        stats = getattr(result, "stats", None)
        out: dict[str, Any] = {
            "text": _cut_at_stop(str(result.text), tuple(kwargs.get("stop") or ())),
            "finish_reason": getattr(result, "finish_reason", None),
            "tokens": getattr(stats, "tokens", None),
            "ensembled_tokens": getattr(stats, "ensembled_tokens", None),
            "ensemble_rate": getattr(stats, "ensemble_rate", None),
            "wall_time_s": elapsed if batch > 1 else getattr(stats, "wall_time_s", None) or elapsed,
            "cpu_time_s": cpu,
            "tokens_per_s": getattr(stats, "tokens_per_s", None),
            # what SAFE paid beyond its floor: replaced drafter tokens and the drafted tokens dropped after them
            "replaced_tokens": getattr(stats, "replaced_tokens", None),
            "discarded_draft_tokens": getattr(stats, "discarded_draft_tokens", None),
            "steered_tokens": getattr(stats, "steered_tokens", None),
            "rolled_back_tokens": getattr(stats, "rolled_back_tokens", None),
            "forward_passes": dict(getattr(stats, "forward_passes", None) or {}),
            "seed": kwargs.get("seed"),
            **({"batch_size": batch} if batch > 1 else {}),
        }
        out.update({k: v for k, v in settings.items() if k not in out and _jsonable(v)})
        return out

    order = {p.id: i for i, p in enumerate(problems or ())}
    answers: dict[str, dict[str, Any]] = {}

    def run(problem: Problem) -> dict[str, Any]:
        if batch_size > 1 and problems is not None and problem.id in order:
            if problem.id not in answers:
                batch = list(problems[order[problem.id] : order[problem.id] + batch_size])
                requests = [request(p) for p in batch]
                start, cpu_start = time.perf_counter(), time.process_time()
                results = _decode_together(ensemble, requests)
                share = (time.perf_counter() - start) / len(batch)
                cpu_share = (time.process_time() - cpu_start) / len(batch)
                for p, result, (_, kwargs) in zip(batch, results, requests, strict=True):
                    answers[p.id] = record(result, kwargs, share, cpu_share, len(batch))
            return answers.pop(problem.id)
        call, kwargs = request(problem)
        start, cpu_start = time.perf_counter(), time.process_time()
        args, call = _prompt_args(call)
        result = ensemble.generate(*args, **call, **kwargs)
        return record(result, kwargs, time.perf_counter() - start, time.process_time() - cpu_start, 1)

    run.settings = settings  # type: ignore[attr-defined]
    run.__name__ = f"ensemble_{method}_{aggregation}"
    return run


def _prompt_args(call: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A request as (positional args, keywords): the prompt text goes positionally (the contract does not
    name that parameter), chat messages as ``messages=``."""
    call = dict(call)
    return ((call.pop("prompt"),) if "prompt" in call else ()), call


def _decode_together(ensemble: Any, requests: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[Any]:
    """Every request at once: one stream each joins one batch of the ensemble (each request keeps its own
    options: stop strings and seed differ per problem). Read from this thread, so an interrupt (Ctrl-C)
    lands here and closing the streams cancels the whole batch at once."""
    streams = []
    try:
        for call, kwargs in requests:
            args, call = _prompt_args(call)
            streams.append(ensemble.stream(*args, **call, **kwargs))
        for stream in streams:
            for _ in stream:
                pass
        return [stream.result for stream in streams]
    finally:
        for stream in streams:
            stream.close()  # a no-op for a finished request


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """Drop anything from the first stop string on (in case the engine returns it or runs past it)."""
    cut = min((i for s in stops if s and (i := text.find(s)) >= 0), default=-1)
    return text[:cut] if cut >= 0 else text


def _jsonable(value: Any) -> bool:
    return isinstance(value, str | int | float | bool | type(None) | list | tuple | dict)


def make_batched_single_config(
    member: Any,
    problems: Sequence[Problem],
    *,
    batch_size: int = 16,
    max_new_tokens: int = 512,
    fewshot: bool | None = None,
    stop: Sequence[str] = (),
) -> ConfigFn:
    """A single-model greedy baseline that answers ``batch_size`` chat problems per transformers ``generate``.

    Why: on a CPU a small model's decoding is memory-bound, so a batch of 16 costs about 2.5x one sequence;
    single-model rows of a long accuracy run cost a fraction of their sequential time. Greedy output equals
    the engine's ``method="single"`` up to float rounding from left padding (the prompt is rendered the same
    way, :func:`safe_engine.shaping.chat.chat_prompt_ids`). Each record's ``wall_time_s`` and ``cpu_time_s`` (this
    process's CPU time, all threads) are the batch's times divided by the batch's size. A call for a problem
    not yet answered generates it and the next ``batch_size - 1`` problems of ``problems``.

    ``stop``: strings that end an answer (e.g. ``"\nQuestion:"`` for a base model behind a plain
    "Question/Answer" template, which would otherwise invent the next question until the budget). A row
    stops once its text contains one (transformers ``stop_strings``); the text is cut before it, the
    record's ``finish_reason`` is ``"stop"`` and ``tokens`` counts up to the token that completed it.
    """
    from safe_engine.runtime.baseline import hf_generate
    from safe_engine.shaping.chat import chat_prompt_ids

    order = {p.id: i for i, p in enumerate(problems)}
    answers: dict[str, dict[str, Any]] = {}
    stops = tuple(s for s in stop if s)
    stop_kwargs: dict[str, Any] = {"stop_strings": list(stops), "tokenizer": member.tokenizer} if stops else {}

    def decode(tokens: Sequence[int]) -> str:
        return str(member.tokenizer.decode(tokens, skip_special_tokens=True))

    def stop_length(new: Sequence[int]) -> int | None:
        """Fewest leading tokens of ``new`` whose text contains a stop string (None: no stop string)."""
        if not stops or not any(s in decode(new) for s in stops):
            return None
        lo, hi = 1, len(new)
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in decode(new[:mid]) for s in stops):
                hi = mid
            else:
                lo = mid + 1
        return lo

    def generate_batch(batch: Sequence[Problem]) -> None:
        prompts = [chat_prompt_ids(member, build_prompt(p, chat=True, fewshot=fewshot)) for p in batch]
        out = hf_generate(member, prompts, max_new_tokens, **stop_kwargs)
        per_problem, cpu_per_problem = out.wall_s / len(batch), out.cpu_s / len(batch)
        for p, row in zip(batch, out.rows, strict=True):
            new, tokens, finish = row.ids, row.tokens, row.finish
            stopped = stop_length(new)
            if stopped is not None:  # a stop string ends the answer (rows after it are padding)
                new, tokens, finish = new[:stopped], stopped, "stop"
            answers[p.id] = {
                "text": _cut_at_stop(decode(new), stops),
                "finish_reason": finish,
                "tokens": tokens,
                "ensembled_tokens": 0,
                "ensemble_rate": 0.0,
                "wall_time_s": per_problem,
                "cpu_time_s": cpu_per_problem,
                "tokens_per_s": tokens / per_problem,
                "method": "hf_generate_batched",
                "batch_size": len(batch),
                "max_new_tokens": max_new_tokens,
                "chat": True,
                **({"stop": list(stops)} if stops else {}),
            }

    def run(problem: Problem) -> dict[str, Any]:
        if problem.id not in answers:
            i = order[problem.id]
            generate_batch(problems[i : i + batch_size])
        return answers.pop(problem.id)

    run.__name__ = f"batched_single_{member.name}"
    return run
