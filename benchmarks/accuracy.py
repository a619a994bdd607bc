"""Accuracy of single models vs every-token and SAFE ensembles on the real demo models, resumable.

One command per task (rerun the same command to resume; finished (configuration, problem) pairs are skipped):

    python benchmarks/accuracy.py --task bbh --limit 150 --threads 1 \\
        --configs "qwen alone" "smollm2 alone" "gemma alone" --out benchmarks/results/accuracy

writes OUT/TASK.jsonl, the report OUT/TASK/results.{md,json,png} and appends the run's wall and CPU time to
OUT/timings.jsonl. Tasks: gsm8k, arc (ARC-Challenge), bbh (the BBH_SUBTASKS below, 3-shot CoT from
cot-prompts), mmlu-redux, math500.

Members: Qwen2.5-Coder-0.5B-Instruct (drafter), SmolLM2-135M-Instruct, and gemma-3-270m (a base model: it joins
the chat ensemble through the plain "Question/Answer" chat template PLAIN_CHAT, and its single-model row stops
at "\\nQuestion:", where it would start inventing the next question). Rows (config_factories): each member
alone; every-token UniTE and GaC (the faithful baselines: no SAFE gate; GaC keeps its own "drafter's top
probability < 0.5" gate, as GaC itself does); UniTE+SAFE and GaC+SAFE; the extended rows
(each SAFE gate alone, UniTE+SAFE sampling at temperature 0.7 with three seeds, SmolLM2 drafting); and with
gemma: SAFE over three members with each of them drafting; issue 31's loop-steering rows (`loop_steer`); and
issue 46 item 3's stronger drafter, Qwen2.5-Coder-1.5B-Instruct (the demo model "qwen2.5-coder-1.5b", 1.1 GB):
alone, and drafting for SmolLM2 with today's defaults. Without --configs the pair's rows run; --three adds the
gemma rows; the 1.5B rows run only when named in --configs, with --backend llama.cpp (as float32 torch weights it
would need 6 GB; they are refused there). A member is loaded only when a selected row needs it.

Which problems (the same for every row, deterministic): gsm8k and arc the first LIMIT problems in file order;
bbh the first LIMIT / len(subtasks) problems of each subtask in file order; mmlu-redux the
subject-stratified first LIMIT (round-robin over the 57 subjects in alphabetical order, the first questions of
each subject in file order, questions flagged by MMLU-redux as erroneous left out); see load_problems.

Budgets: --max-new-tokens defaults to MAX_NEW_TOKENS[task], chosen so that fewer than 10 % of each member's
answers are cut at the budget on a pilot of the first 32 problems (see benchmarks/results/accuracy/README.md).

Single-model rows answer `--batch` problems per transformers `generate` call (greedy; see
make_batched_single_config); ensemble rows decode `--ensemble-batch` problems at once (default 8; continuous
batching, each answer as if alone), handed to the engine SUBMITTED times as many at a time, so a finished
answer's place is taken at the next round. On a small CPU machine, split the work
over processes with one torch thread each (decoding is memory-bound, so two 1-thread processes do almost twice
the work of one 2-thread process), each appending to its own part file OUT/TASK.NAME.jsonl:
    python benchmarks/accuracy.py --threads 1 --configs "qwen alone" "smollm2 alone"
    python benchmarks/accuracy.py --threads 1 --configs UniTE+SAFE --jsonl benchmarks/results/gsm8k.safe.jsonl
`--ids FILE` runs only the listed problems (issue 31 decodes only the answers loop steering can change).
The report (and benchmarks/accuracy_summarize.py) reads TASK.jsonl and every part TASK.*.jsonl;
`--report-only` rewrites it (adding any --jsonl files kept elsewhere).
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from functools import cache, partial
from pathlib import Path
from typing import Any

import torch

from safe_engine import Ensemble, ModelSpec
from safe_engine.eval import (
    ConfigFn,
    Problem,
    load_records,
    load_task,
    make_batched_single_config,
    make_ensemble_config,
    run_eval,
    write_report,
)
from safe_engine.runtime.llamacpp import load_llamacpp_member
from safe_engine.runtime.members import Member, load_member
from safe_engine.runtime.placement import cpu_model

PLAIN_CHAT = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}Question: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}Answer: {{ m['content'] }}\n{% endif %}{% endfor %}Answer:"
)
#: Where a base model behind PLAIN_CHAT has finished its answer and starts the next question.
PLAIN_CHAT_STOP = ("\nQuestion:",)

#: Default max_new_tokens per task (the caps of the study: gsm8k 1024, CoT on bbh / arc / mmlu-redux 512).
MAX_NEW_TOKENS: dict[str, int] = {"gsm8k": 1024, "arc": 512, "bbh": 512, "mmlu-redux": 512, "math500": 1024}

#: Ensemble rows hand the engine this many times --ensemble-batch problems at once (see config_factories).
SUBMITTED = 4

#: The loop-steering rows' loop_steer (with loop_span at its default, 32): steer from the second copy on.
LOOP_STEER = 2

#: BBH subtasks of the study: short answers (True/False, Yes/No, a count) that tiny models can attempt.
BBH_SUBTASKS = ("boolean_expressions", "navigate", "object_counting", "sports_understanding", "web_of_lies")


def load_problems(task: str, limit: int, start: int = 0, subtasks: tuple[str, ...] = BBH_SUBTASKS) -> list[Problem]:
    """The problems of a run, deterministically: see the module docstring. ``start`` skips the problems of
    ``--limit START`` (per subtask for bbh) so a run can be split: START + LIMIT problems in two runs are the
    START + LIMIT of one run, each once (by id: mmlu-redux's stratified subset is not in selection order)."""
    if task != "bbh":
        skipped = {p.id for p in load_task(task, limit=start)} if start else set()
        return [p for p in load_task(task, limit=start + limit) if p.id not in skipped]
    per_task, extra = divmod(limit, len(subtasks))
    out: list[Problem] = []
    for i, sub in enumerate(subtasks):
        n = per_task + (1 if i < extra else 0)
        out += load_task(f"bbh:{sub}", limit=start + n)[start:]
    return out


def describe(task: str, limit: int, subtasks: tuple[str, ...]) -> str:
    """The report title: which problems the rows answered."""
    if task == "bbh":
        return f"bbh (3-shot CoT): first {limit // len(subtasks)} problems of {', '.join(subtasks)}"
    if task == "mmlu-redux":
        return f"mmlu-redux: {limit} problems, the first of each subject round-robin"
    return f"{task}: first {limit} problems"


@cache
def member(name: str, quantization: str | None = None, backend: str = "torch", positions: int | None = None) -> Member:
    """A demo member, loaded once (gemma with the plain Question/Answer chat template): float32 (or int8)
    torch weights de-quantised from the demo GGUF, or the GGUF as it is in llama.cpp (issue 46)."""
    spec = ModelSpec(name, chat_template=PLAIN_CHAT if name == "gemma3-270m" else None, quantization=quantization)
    if backend == "llama.cpp":
        return load_llamacpp_member(spec, positions=positions)
    return load_member(spec)


def config_factories(problems: list[Problem], args: argparse.Namespace) -> dict[str, Callable[[], ConfigFn]]:
    """Row name -> a function building that row's configuration (loading its members on first use)."""
    kw: dict[str, Any] = {"max_new_tokens": args.max_new_tokens}
    qwen, smol, gemma = (
        partial(member, name, backend=args.backend, positions=args.positions)
        for name in ("qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m")
    )

    def ensemble(*members: Callable[[], Member], drafter: int = 0) -> Callable[[], Ensemble]:
        return lambda: Ensemble([m() for m in members], drafter=drafter, max_batch_size=args.ensemble_batch)

    pair = ensemble(qwen, smol)
    int8_pair = ensemble(partial(member, "qwen2.5-coder-0.5b", "int8"), partial(member, "smollm2-135m", "int8"))

    def single(m: Callable[[], Member], stop: tuple[str, ...] = ()) -> Callable[[], ConfigFn]:
        if args.backend == "llama.cpp":  # the engine's greedy `single` (llama-cpp-python's own text, docs/llamacpp.md)
            return ens(lambda: Ensemble([m()], max_batch_size=args.ensemble_batch), method="single", stop=stop)
        return lambda: make_batched_single_config(m(), problems, batch_size=args.batch, stop=stop, **kw)

    def ens(members: Callable[[], Ensemble], **settings: Any) -> Callable[[], ConfigFn]:
        # SUBMITTED x the live batch at a time: a finished answer's place is taken by a waiting problem at the
        # next round (continuous batching) instead of the batch waiting for its longest answer
        batch = {"problems": problems, "batch_size": args.ensemble_batch * SUBMITTED}
        return lambda: make_ensemble_config(members(), **settings, **batch, **kw)

    def three(drafter: int = 0) -> Callable[[], Ensemble]:
        return ensemble(qwen, smol, gemma, drafter=drafter)

    qwen15 = partial(member, "qwen2.5-coder-1.5b", backend=args.backend, positions=args.positions)

    sampling = {
        f"UniTE+SAFE sampling (seed {seed})": ens(pair, method="safe", do_sample=True, temperature=0.7, seed=seed)
        for seed in range(args.seed, args.seed + 3)
    }
    return {
        "qwen alone": single(qwen),
        "smollm2 alone": single(smol),
        "UniTE every token": ens(pair, method="every_token", aggregation="unite"),
        "GaC every token": ens(pair, method="every_token", aggregation="gac"),
        "UniTE+SAFE": ens(pair, method="safe", aggregation="unite"),
        "GaC+SAFE": ens(pair, method="safe", aggregation="gac"),
        "UniTE+SAFE, int8 members": ens(int8_pair, method="safe", aggregation="unite"),
        # the extended rows: each gate alone, sampling, another drafter
        "UniTE+SAFE boundary gate only": ens(pair, method="safe", gates=("boundary",)),
        "UniTE+SAFE consensus gate only": ens(pair, method="safe", gates=("consensus",)),
        **sampling,
        "UniTE+SAFE, smollm2 drafts": ens(ensemble(qwen, smol, drafter=1), method="safe"),
        "gemma alone": single(gemma, PLAIN_CHAT_STOP),
        "UniTE+SAFE (3 models)": ens(three(), method="safe"),
        "UniTE+SAFE (3 models), smollm2 drafts": ens(three(1), method="safe"),
        "UniTE+SAFE (3 models), gemma drafts": ens(three(2), method="safe"),
        # issue 31: steering away from repetitions at the ensemble points (loop_steer, off by default)
        "UniTE+SAFE, loop steering": ens(pair, method="safe", aggregation="unite", loop_steer=LOOP_STEER),
        "GaC+SAFE, loop steering": ens(pair, method="safe", aggregation="gac", loop_steer=LOOP_STEER),
        "UniTE+SAFE (3 models), loop steering": ens(three(), method="safe", loop_steer=LOOP_STEER),
        # issue 46 item 3: a stronger drafter (llama.cpp only; named in --configs)
        "qwen1.5b alone": single(qwen15),
        "1.5B + SmolLM2, default": ens(ensemble(qwen15, smol)),  # today's defaults, nothing set
    }


_GEMMA_ROWS = (
    "gemma alone",
    "UniTE+SAFE (3 models)",
    "UniTE+SAFE (3 models), smollm2 drafts",
    "UniTE+SAFE (3 models), gemma drafts",
    "UniTE+SAFE (3 models), loop steering",
)
#: Rows with the 1.5B drafter: run only when named, and only in llama.cpp (float32 torch weights would need 6 GB).
_DRAFTER15_ROWS = ("qwen1.5b alone", "1.5B + SmolLM2, default")


def append_timing(path: Path, entry: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry) + "\n")


def task_files(out: Path, task: str) -> list[Path]:
    """A task's results: OUT/TASK.jsonl and the part files OUT/TASK.*.jsonl other processes appended to."""
    return [out / f"{task}.jsonl", *sorted(out.glob(f"{task}.*.jsonl"))]


def report(out: Path, task: str, title: str, extra: list[Path]) -> None:
    """OUT/TASK/results.{md,json,png} over all of a task's files (and ``extra`` ones), and OUT/timings.json."""
    files = dict.fromkeys(p.resolve() for p in [*task_files(out, task), *extra])
    write_report([r for f in files for r in load_records(f)], out / task, title=title)
    write_timings(out)


def write_timings(out: Path) -> Path:
    """OUT/timings.json: per task, the summed wall and CPU time of its runs (OUT/timings.jsonl, one line per
    invocation, model loading included) and of each row (its records' wall_time_s / cpu_time_s in
    OUT/TASK.jsonl and OUT/TASK.*.jsonl)."""
    runs = load_records(out / "timings.jsonl")
    summary: dict[str, Any] = {}
    for task in sorted({str(r["task"]) for r in runs}):
        mine = [r for r in runs if r["task"] == task]
        rows: dict[str, dict[str, float]] = {}
        for rec in (r for part in task_files(out, task) for r in load_records(part)):
            row = rows.setdefault(str(rec["config"]), {"n": 0, "wall_s": 0.0, "cpu_s": 0.0})
            row["n"] += 1
            row["wall_s"] += float(rec.get("wall_time_s") or 0.0)
            row["cpu_s"] += float(rec.get("cpu_time_s") or 0.0)
        summary[task] = {
            "runs": len(mine),
            "wall_s": round(sum(float(r["wall_s"]) for r in mine), 1),
            "cpu_s": round(sum(float(r["cpu_s"]) for r in mine), 1),
            "rows": {
                k: {"n": v["n"], "wall_s": round(v["wall_s"], 1), "cpu_s": round(v["cpu_s"], 1)}
                for k, v in rows.items()
            },
        }
    path = out / "timings.json"
    path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return path


def source_commit() -> str | None:
    """The commit of the code this run imports (a study pins it: PYTHONPATH at a checkout of one commit),
    with "+dirty" where its safe_engine differs from that commit."""
    import safe_engine

    def git(*argv: str) -> str | None:
        where = Path(safe_engine.__file__).resolve().parent.parent
        try:
            done = subprocess.run(["git", "-C", str(where), *argv], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    return head and head + ("+dirty" if git("status", "--porcelain", "safe_engine") else "")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="gsm8k", help="gsm8k, arc, bbh, mmlu-redux or math500")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--start", type=int, default=0, help="skip the first START problems (to split a run)")
    p.add_argument("--subtasks", nargs="+", default=list(BBH_SUBTASKS), help="bbh subtasks (default BBH_SUBTASKS)")
    p.add_argument("--max-new-tokens", type=int, help="default: MAX_NEW_TOKENS[task]")
    p.add_argument("--seed", type=int, default=0, help="first of the three seeds of the sampling rows")
    p.add_argument("--three", action="store_true", help="without --configs: also run the gemma-3-270m rows")
    p.add_argument("--configs", nargs="+", help="subset of configuration names to run")
    p.add_argument("--ids", help="file of problem ids, one per line: run only those of the selected problems")
    p.add_argument("--batch", type=int, default=16, help="problems per generate call for single-model rows")
    p.add_argument("--ensemble-batch", type=int, default=8, help="problems decoded at once by ensemble rows")
    p.add_argument("--threads", type=int, help="torch threads, which llama.cpp members use too (default: torch's)")
    p.add_argument(
        "--backend",
        choices=("torch", "llama.cpp"),
        default="torch",
        help="members as float32 torch weights de-quantised from the demo GGUFs (the study of issue 17) or the "
        "GGUFs as they are in llama.cpp (issue 46); single-model rows then run the engine's greedy `single`",
    )
    p.add_argument(
        "--positions",
        type=int,
        help="llama.cpp members: KV positions their context shares among the answers decoded at once (default: "
        "one window; too few and fewer answers run at once)",
    )
    p.add_argument("--out", default="benchmarks/results", help="folder of the report (and default JSONL)")
    p.add_argument("--jsonl", nargs="+", help="results file(s) (default OUT/TASK.jsonl); runs append to the first")
    p.add_argument("--report-only", action="store_true", help="only write the report over the --jsonl files")
    args = p.parse_args()
    subtasks = tuple(args.subtasks)
    if args.max_new_tokens is None:
        args.max_new_tokens = MAX_NEW_TOKENS.get(args.task, 512)
    out = Path(args.out)
    files = [Path(f) for f in args.jsonl] if args.jsonl else [out / f"{args.task}.jsonl"]
    title = describe(args.task, args.limit, subtasks)
    if args.report_only:
        report(out, args.task, title, files)
        return
    if args.threads:
        torch.set_num_threads(args.threads)

    problems = load_problems(args.task, args.limit, args.start, subtasks)
    if args.ids:
        wanted = set(Path(args.ids).read_text(encoding="utf-8").split())
        problems = [q for q in problems if q.id in wanted]
    factories = config_factories(problems, args)
    names = args.configs or [n for n in factories if (args.three or n not in _GEMMA_ROWS) and n not in _DRAFTER15_ROWS]
    unknown = [n for n in names if n not in factories]
    if unknown:
        p.error(f"unknown configuration(s) {unknown}; choose from {list(factories)}")
    large = [n for n in names if n in _DRAFTER15_ROWS]
    if large and args.backend != "llama.cpp":
        p.error(
            f"{large} run the 1.5B drafter, which only --backend llama.cpp runs here (as float32 torch weights it "
            "would need a 6 GB conversion)"
        )

    # `kill` stops a run as Ctrl-C does (the records so far and the run's times are kept); a shell ignores
    # SIGINT for background jobs, so SIGINT reaches a run started with `&` only if it listens itself
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    wall0, started = time.perf_counter(), datetime.now(UTC).isoformat(timespec="seconds")
    commit = source_commit()  # now: the checkout may move while the run goes on
    status = "interrupted"
    try:
        configs = {n: factories[n]() for n in names}
        run_eval(configs, problems, files[0])
        status = "finished"
    finally:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        append_timing(
            out / "timings.jsonl",
            {
                "task": args.task,
                "configs": names,
                "limit": args.limit,
                "start": args.start,
                "max_new_tokens": args.max_new_tokens,
                "batch": args.batch,
                "threads": torch.get_num_threads(),
                "backend": args.backend,
                "commit": commit,
                "cpu": cpu_model(),
                "jsonl": str(files[0]),
                "started": started,
                "status": status,
                "wall_s": round(time.perf_counter() - wall0, 1),
                "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),  # whole process, model loading included
                "max_rss_mib": round(usage.ru_maxrss / 1024),
                "argv": sys.argv[1:],
            },
        )
    report(out, args.task, title, files)


if __name__ == "__main__":
    main()
