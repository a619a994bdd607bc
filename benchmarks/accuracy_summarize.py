"""The accuracy study's tables and figure: writes summary.md, summary.json and study.png next to this file.

    python benchmarks/accuracy_summarize.py [FOLDER]   # default: this file's folder

Reads every task's records (TASK.jsonl and the parts TASK.*.jsonl that other processes appended to; a
(row, problem) pair recorded twice keeps its last record). Per task:

- the members alone, each on all the problems it answered (the cheap rows run first, on more problems);
- the study table of the members and the core rows (`CORE`) on the problems every one of them answered (so
  rows are paired): accuracy with a 95 % percentile bootstrap interval, answers cut at the budget (and how
  many of those loop, see `loops`), no extractable answer, E/T, replaced drafter tokens per 100 generated
  tokens, tokens/s (all rows are batched: a batch's throughput shared over its problems), CPU seconds per
  problem;
- paired comparisons of each ensemble row with the best member (the best on those same problems, chosen
  after the fact) and with every-token ensembling of its aggregation: difference with a paired bootstrap
  interval, the discordant problems, McNemar's exact p;
- while some core rows have answered fewer problems than others (runs still going), the same table and
  comparisons again for the members and the core rows that have gone furthest, on their problems;
- where a task has extended rows (a gate alone, sampling, other drafters; run on fewer problems), the same
  table and comparisons over all rows on the problems all of them answered, each extended row also
  compared with the full method it varies; an extended row that has answered fewer problems than the
  longest one (a run still going) is listed with its count instead, so that it does not shrink that table;
- BBH per subtask.

study.png: accuracy (with the bootstrap interval) against E/T, one panel per task, one point per row.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent / "results" / "accuracy"  # the study's records
sys.path.insert(0, str(HERE.parents[1]))

from accuracy import task_files, write_timings  # noqa: E402

from safe_engine.eval import aggregate, bootstrap_difference, bootstrap_interval, load_records, mcnemar  # noqa: E402

TASKS = ("mmlu-redux", "arc", "gsm8k", "bbh")
MEMBERS = ("qwen alone", "smollm2 alone", "gemma alone")
CORE = ("UniTE every token", "UniTE+SAFE", "GaC+SAFE", "UniTE+SAFE (3 models)")  # the rows of every chosen task


def baseline(row: str) -> str | None:
    """The every-token row a SAFE row is compared with: its own aggregation over the same two members."""
    if "SAFE" not in row or "3 models" in row:
        return None
    return "GaC every token" if row.startswith("GaC") else "UniTE every token"


def task_records(folder: Path, task: str) -> dict[str, dict[str, dict[str, Any]]]:
    """row -> problem id -> record, over TASK.jsonl and TASK.*.jsonl."""
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for path in task_files(folder, task):
        for r in load_records(path):
            rows.setdefault(str(r["config"]), {})[str(r["problem_id"])] = r
    return rows


def baselines(recs: Sequence[dict[str, Any]], task: str) -> tuple[float | None, float | None]:
    """(chance, majority-class accuracy) over some problems; chance is None for free-form answers.

    The majority class is taken per BBH subtask (per task elsewhere: for ARC / MMLU-redux it is the most
    common answer letter, the score of a model that always picks that position)."""
    if task == "gsm8k" or not recs:
        return None, None
    part = (lambda r: str(r.get("subtask"))) if task == "bbh" else (lambda r: "")
    hits = sum(
        Counter(str(r["reference"]) for r in recs if part(r) == p).most_common(1)[0][1] for p in {part(r) for r in recs}
    )
    if task in ("arc", "mmlu-redux"):
        return 0.25, hits / len(recs)  # (almost) always four options
    binary = sum(1 for r in recs if str(r["reference"]).lower() in ("true", "false", "yes", "no"))
    return 0.5 * binary / len(recs), hits / len(recs)


def loops(text: str) -> bool:
    """Whether an answer ends in a loop: its last 40 characters occur 3 times or more in its last 1,500 (a
    greedy small model that repeats itself until the budget; no budget would end such an answer)."""
    tail = text[-40:]
    return len(tail) == 40 and text[-1500:].count(tail) >= 3


def row_numbers(recs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row's numbers over the given records: the eval report's aggregates plus what the study adds
    (interval, looping, no answer, replacements, CPU time)."""
    (row,) = aggregate(recs)
    correct = [bool(r["correct"]) for r in recs]
    cpu = [float(r["cpu_time_s"]) for r in recs if r.get("cpu_time_s") is not None]
    replaced = [int(r["replaced_tokens"]) for r in recs if r.get("replaced_tokens") is not None]
    return {
        "n": row.n,
        "accuracy": row.accuracy,
        "ci95": list(bootstrap_interval(correct)),
        "cut": row.truncated / row.n,
        "cut_looping": sum(1 for r in recs if r.get("finish_reason") == "length" and loops(str(r["text"]))) / row.n,
        "no_answer": sum(1 for r in recs if r.get("prediction") is None) / row.n,
        "tokens": row.tokens,
        "ensemble_rate": row.ensemble_rate or 0.0,
        "replaced_per_100_tokens": 100 * sum(replaced) / row.tokens if replaced and row.tokens else None,
        "tokens_per_s": row.tokens_per_s,
        "cpu_s_per_problem": sum(cpu) / len(cpu) if len(cpu) == row.n else None,
    }


def fmt(x: float | None, spec: str = ".1f", scale: float = 1.0) -> str:
    return "–" if x is None else format(x * scale, spec)


def answer_cells(row: str, x: dict[str, Any]) -> str:
    """The cells both tables share: row, n, accuracy with its interval, answers cut at the budget and those
    of them that loop, no answer (percent of the row's answers)."""
    return (
        f"| {row} | {x['n']} | {fmt(x['accuracy'], '.1f', 100)} | {fmt(x['ci95'][0], '.0f', 100)}–"
        f"{fmt(x['ci95'][1], '.0f', 100)} | {fmt(x['cut'], '.0f', 100)}, {fmt(x['cut_looping'], '.0f', 100)} | "
        f"{fmt(x['no_answer'], '.0f', 100)} |"
    )


def full_method(row: str) -> str | None:
    """The row an extended SAFE row varies (a gate left out, sampling, another drafter): SAFE with both gates,
    greedy, Qwen drafting, over the same members."""
    if row in CORE or "SAFE" not in row:
        return None
    return "UniTE+SAFE (3 models)" if "3 models" in row else "UniTE+SAFE"


def paired(rows: dict[str, dict[str, dict[str, Any]]], names: list[str], task: str) -> tuple[list[str], dict[str, Any]]:
    """The table of `names` on the problems all of them answered, and each ensemble row compared with the
    best member on those problems, its every-token baseline and (extended rows) the full method."""
    common = sorted(set.intersection(*(set(rows[n]) for n in names)))
    out: dict[str, Any] = {"common_problems": len(common), "rows": {}, "comparisons": []}
    members = [n for n in names if n in MEMBERS]
    if not common or len(members) == len(names):
        return [], out
    chance, majority = baselines([rows[names[0]][p] for p in common], task)
    out["chance"] = chance
    lines = [
        f"on the {len(common)} problems every one of them answered (chance {fmt(chance, '.1f', 100)} %, "
        f"majority class {fmt(majority, '.1f', 100)} %):",
        "",
        "| Row | n | Accuracy (%) | 95 % CI | Cut (%), looping | No answer (%) | E/T (%) | Replaced / 100 tok | "
        "Tokens/s (batched) | CPU s / problem |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    outcome: dict[str, list[bool]] = {}
    for row in names:
        recs = [rows[row][p] for p in common]
        outcome[row] = [bool(r["correct"]) for r in recs]
        x = row_numbers(recs)
        out["rows"][row] = x
        lines.append(
            f"{answer_cells(row, x)} {fmt(x['ensemble_rate'], '.1f', 100)} | {fmt(x['replaced_per_100_tokens'])} | "
            f"{fmt(x['tokens_per_s'])} | {fmt(x['cpu_s_per_problem'])} |"
        )
    best = max(members, key=lambda m: sum(outcome[m])) if members else None
    lines += [
        "",
        f"Paired comparisons on the same {len(common)} problems (Δ = row − other, points; 95 % paired bootstrap "
        "interval; 'only row / only other' = problems just one of the two solved; McNemar's exact p):",
        "",
        "| Row | vs | Δ (points) | 95 % CI | only row / only other | McNemar p |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in names:
        if row in MEMBERS:
            continue
        for other in (best, baseline(row), full_method(row)):
            if other is None or other not in outcome or other == row:
                continue
            lo, hi = bootstrap_difference(outcome[row], outcome[other])
            test = mcnemar(outcome[row], outcome[other])
            delta = (sum(outcome[row]) - sum(outcome[other])) / len(common)
            label = f"{other} (best member)" if other == best else other
            out["comparisons"].append(
                {"row": row, "other": other, "delta": delta, "ci95": [lo, hi]}
                | {"only_row": test.only_a, "only_other": test.only_b, "p_value": test.p_value}
            )
            lines.append(
                f"| {row} | {label} | {100 * delta:+.1f} | {100 * lo:+.1f} to {100 * hi:+.1f} | "
                f"{test.only_a} / {test.only_b} | {test.p_value:.3f} |"
            )
    if task == "bbh":
        subtasks = sorted({str(rows[names[0]][p]["subtask"]) for p in common})
        lines += ["", "BBH accuracy (%) per subtask, same problems:", ""]
        lines += ["| Row | " + " | ".join(subtasks) + " |", "|---|" + "---:|" * len(subtasks)]
        for row in names:
            cells = []
            for sub in subtasks:
                mine = [rows[row][p]["correct"] for p in common if rows[row][p]["subtask"] == sub]
                cells.append(f"{100 * sum(mine) / len(mine):.0f}" if mine else "–")
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return lines, out


def by_progress(rows: dict[str, Any], names: list[str]) -> tuple[int, list[str], list[str]]:
    """(the most problems any of `names` answered, the rows that answered that many, the rows still short of
    it: runs still going)."""
    most = max((len(rows[r]) for r in names), default=0)
    return most, [r for r in names if len(rows[r]) == most], [r for r in names if len(rows[r]) < most]


def study(folder: Path, task: str) -> tuple[list[str], dict[str, Any]]:
    """The Markdown lines and the numbers of one task: the members alone; the core rows paired on their
    common problems; the extended rows (run on fewer problems) paired with the core rows on theirs."""
    rows = task_records(folder, task)
    members = [m for m in MEMBERS if m in rows]
    core = members + [r for r in CORE if r in rows]
    extended = [r for r in rows if r not in core]
    budget = max(int(r.get("max_new_tokens") or 0) for recs in rows.values() for r in recs.values())
    lines = [f"## {task} (max_new_tokens {budget})", ""]
    out: dict[str, Any] = {"max_new_tokens": budget, "members": {}}

    lines += [
        "Members alone, each on every problem it answered:",
        "",
        "| Member | n | Accuracy (%) | 95 % CI | Cut (%), looping | No answer (%) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for m in members:
        x = row_numbers(list(rows[m].values()))
        out["members"][m] = x
        lines.append(answer_cells(m, x))
    table, numbers = paired(rows, core, task)
    out |= numbers
    if table:
        lines += ["", "The members and the core rows " + table[0], *table[1:]]
    _, ahead, behind = by_progress(rows, [r for r in core if r not in MEMBERS])
    if behind:
        table, numbers = paired(rows, members + ahead, task)
        if numbers["common_problems"] > out["common_problems"]:
            out["core_ahead"] = numbers
            lines += ["", f"While the other core rows run, the members and {', '.join(ahead)} " + table[0], *table[1:]]
    most, extended, running = by_progress(rows, extended)
    if extended:
        table, out["extended"] = paired(rows, core + extended, task)
        if table:
            lines += ["", "The extended rows, with the members and the core rows " + table[0], *table[1:]]
    if running:
        out["running"] = {r: len(rows[r]) for r in running}
        counts = ", ".join(f"{r} ({len(rows[r])} of {most} problems)" for r in running)
        note = f"Extended rows still running, left out of the tables until they reach {most} problems: {counts}."
        lines += ["", note]
    return [*lines, ""], out


def plot(numbers: dict[str, Any], path: Path) -> None:
    """Accuracy against E/T per task, the bootstrap intervals as error bars; members sit at E/T 0, extended
    rows (on fewer problems, so not strictly comparable) are hollow."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tasks = [t for t in TASKS if numbers.get(t, {}).get("rows")]
    if not tasks:
        return
    fig = Figure(figsize=(6.4 * len(tasks), 6.2), dpi=120)
    FigureCanvasAgg(fig)
    for i, task in enumerate(tasks, 1):
        ax = fig.add_subplot(1, len(tasks), i)
        core = numbers[task]["rows"]
        extended = numbers[task].get("extended", {})
        points = [(row, x, "") for row, x in core.items()]
        points += [
            (r, x, f", n = {extended['common_problems']}") for r, x in extended.get("rows", {}).items() if r not in core
        ]
        for row, x, fewer in points:  # extended rows (fewer problems) hollow
            et, acc = 100 * x["ensemble_rate"], 100 * x["accuracy"]
            err = [[acc - 100 * x["ci95"][0]], [100 * x["ci95"][1] - acc]]
            marker = "s" if row in MEMBERS else ("o" if "SAFE" in row else "^")
            style = {"markerfacecolor": "none"} if fewer else {}
            ax.errorbar([et], [acc], yerr=err, fmt=marker, capsize=3, label=f"{row} ({acc:.1f} %{fewer})", **style)
        if numbers[task].get("chance") is not None:
            ax.axhline(100 * numbers[task]["chance"], color="grey", linestyle=":", label="chance")
        ax.set_title(f"{task} (n = {numbers[task]['common_problems']})")
        ax.set_xlabel("E/T: ensembled / generated tokens (%)")
        ax.set_ylabel("accuracy (%), 95 % bootstrap interval")
        ax.grid(True, alpha=0.3)
        ax.margins(0.1)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)  # below: no point hidden
    fig.tight_layout()
    fig.savefig(path)


def main(folder: Path = HERE) -> None:
    write_timings(folder)
    timings = json.loads((folder / "timings.json").read_text(encoding="utf-8"))
    lines = [
        "# Accuracy study: the members alone, every-token and SAFE ensembles",
        "",
        "Written by `python benchmarks/accuracy_summarize.py` from the JSONL files here; commands, "
        "problems and budgets in README.md. Greedy decoding; all rows batched (tokens/s is a batch's "
        "throughput shared over its problems: members 16 per transformers `generate` call, ensembles 8 at once "
        "through the engine's continuous batching (the first mmlu-redux ensemble problems in batches of 8 that "
        "waited for their longest answer, the rest handed over 32 at a time); one-at-a-time speed is in "
        "benchmarks/results/speed.md).",
        "",
    ]
    numbers: dict[str, Any] = {}
    for task in TASKS:
        if not (folder / f"{task}.jsonl").exists():
            continue
        task_lines, numbers[task] = study(folder, task)
        t = timings.get(task, {})
        task_lines.insert(
            2,
            f"Runs of this task so far: wall {t.get('wall_s', 0) / 60:.0f} min, CPU {t.get('cpu_s', 0) / 60:.0f} min "
            f"over {t.get('runs', 0)} invocation(s), model loading included.\n",
        )
        lines += task_lines
    (folder / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (folder / "summary.json").write_text(json.dumps(numbers, indent=2) + "\n", encoding="utf-8")
    plot(numbers, folder / "study.png")
    print((folder / "summary.md").read_text(encoding="utf-8"))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
