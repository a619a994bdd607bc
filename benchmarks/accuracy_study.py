"""Issue 46's study: every figure recomputed from the raw records, and the written rule applied to them.

    python benchmarks/accuracy_study.py   # writes results/accuracy/study-46/summary.{md,json} and timings.json

Reads the llama.cpp rows in `study-46/` (appended by `benchmarks/accuracy_study.sh`) and, for the check that
llama.cpp members reproduce the float32 study, the float32 rows of the same problems: the members alone from the
issue-17 files, UniTE + SAFE and GaC + SAFE from `rerun-31/` (token healing, today's engine), and their loop-steering
rows as `accuracy_loops.py` composes them (`copies-31/`'s answers where loop steering could act, the healed ones
elsewhere). The rule is the one written in docs/accuracy.md before the 500-problem rows (`choose_default`); it is
applied only once every row has answered every one of the 500 problems of every task.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent / "results" / "accuracy"
STUDY = HERE / "study-46"
sys.path.insert(0, str(HERE.parents[1]))

from accuracy import load_problems, write_timings  # noqa: E402
from accuracy_loops import looping, records, steerable  # noqa: E402
from accuracy_summarize import row_numbers  # noqa: E402

from safe_engine.eval import bootstrap_difference, mcnemar  # noqa: E402

TASKS = ("mmlu-redux", "arc", "gsm8k")
DRAFTER = "qwen alone"
MEMBERS = (DRAFTER, "smollm2 alone")
CANDIDATES = ("UniTE+SAFE", "GaC+SAFE", "UniTE+SAFE, loop steering", "GaC+SAFE, loop steering")
ROWS = (*MEMBERS, *CANDIDATES)
FULL = 500  # problems per task the rule reads
CHECK = 150  # the earlier study's problems: llama.cpp against float32 there
LOOP_MARGIN = 0.01  # a candidate may loop on at most the drafter's share + 1 percentage point
ALPHA = 0.05  # "significantly below": McNemar's exact two-sided p under this, with lower accuracy
TIE = 0.005  # mean accuracies this close are tied: fewer loops, then less CPU time, decides


def float32_rows(task: str) -> dict[str, dict[str, dict[str, Any]]]:
    """The float32 torch rows of the earlier studies, by the llama.cpp study's row names."""
    members, healed, steered = records(HERE, task), records(HERE / "rerun-31", task), records(HERE / "copies-31", task)
    out = {m: members[m] for m in MEMBERS if m in members}
    for row in ("UniTE+SAFE", "GaC+SAFE"):
        if row not in healed:
            continue
        out[row] = healed[row]
        decoded = steered.get(f"{row}, loop steering", {})
        redo = {i for i, r in healed[row].items() if steerable(r, digits_equal=True)}
        if redo and redo <= decoded.keys():
            out[f"{row}, loop steering"] = {i: decoded[i] if i in redo else r for i, r in healed[row].items()}
    return out


def reproduction(task: str, study: Mapping[str, Mapping[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each row on the first CHECK problems, llama.cpp against float32: accuracy, McNemar, differing answers."""
    ids = [p.id for p in load_problems(task, CHECK)]
    out = []
    for row, old in float32_rows(task).items():
        new = study.get(row, {})
        both = [i for i in ids if i in old and i in new]
        if not both:
            continue
        a, b = [bool(new[i]["correct"]) for i in both], [bool(old[i]["correct"]) for i in both]
        test = mcnemar(a, b)
        out.append(
            {
                "task": task,
                "row": row,
                "n": len(both),
                "accuracy_llamacpp": sum(a) / len(both),
                "accuracy_float32": sum(b) / len(both),
                "delta_ci95": list(bootstrap_difference(a, b)),
                "p": test.p_value,
                "texts_differ": sum(new[i]["text"] != old[i]["text"] for i in both),
                "predictions_differ": sum(new[i]["prediction"] != old[i]["prediction"] for i in both),
                "loops_llamacpp": sum(looping(new[i]) for i in both),
                "loops_float32": sum(looping(old[i]) for i in both),
            }
        )
    return out


def task_rows(task: str, study: Mapping[str, Mapping[str, dict[str, Any]]]) -> dict[str, Any]:
    """The rows on the problems every one of them answered (paired), with each candidate against the best member."""
    present = [row for row in ROWS if study.get(row)]
    order = [p.id for p in load_problems(task, FULL)]
    ids = [i for i in order if all(i in study[row] for row in present)] if present else []
    if not ids:
        return {"n": 0, "rows": {}}
    rows: dict[str, dict[str, Any]] = {}
    for row in present:
        recs = [study[row][i] for i in ids]
        rows[row] = {**row_numbers(recs), "loops": sum(looping(r) for r in recs) / len(ids)}
    members = [m for m in MEMBERS if m in rows]
    best = max(members, key=lambda m: rows[m]["accuracy"]) if members else None
    for row in rows:
        if best is None or row in MEMBERS:
            continue
        a, b = [bool(study[row][i]["correct"]) for i in ids], [bool(study[best][i]["correct"]) for i in ids]
        test = mcnemar(a, b)
        rows[row]["vs_best_member"] = {
            "member": best,
            "delta": (sum(a) - sum(b)) / len(ids),
            "ci95": list(bootstrap_difference(a, b)),
            "only_row": test.only_a,
            "only_member": test.only_b,
            "p": test.p_value,
        }
    return {"n": len(ids), "best_member": best, "rows": rows}


def eligible(row: str, tasks: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Why a candidate fails the rule on the given tasks' rows (empty: it is eligible)."""
    reasons = []
    for task, table in tasks.items():
        mine, drafter = table["rows"][row], table["rows"][DRAFTER]
        versus = mine["vs_best_member"]
        if versus["delta"] < 0 and versus["p"] < ALPHA:
            reasons.append(
                f"{task}: {100 * versus['delta']:+.1f} points below {versus['member']} (p = {versus['p']:.3f})"
            )
        if mine["loops"] > drafter["loops"] + LOOP_MARGIN + 1e-12:
            reasons.append(
                f"{task}: loops on {100 * mine['loops']:.1f} % of answers, the drafter alone on "
                f"{100 * drafter['loops']:.1f} %"
            )
    return reasons


def choose_default(tasks: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """docs/accuracy.md's rule: among the eligible candidates the best mean accuracy over the tasks; within TIE
    of it, the fewest loops summed over the tasks, then the least CPU time per problem."""
    verdicts = {row: eligible(row, tasks) for row in CANDIDATES}
    passing = [row for row, reasons in verdicts.items() if not reasons]

    def mean(row: str, key: str) -> float:
        return sum(float(t["rows"][row][key] or 0.0) for t in tasks.values()) / len(tasks)

    winner = None
    if passing:
        top = max(mean(row, "accuracy") for row in passing)
        tied = [row for row in passing if mean(row, "accuracy") >= top - TIE]
        winner = min(tied, key=lambda row: (mean(row, "loops"), mean(row, "cpu_s_per_problem")))
    return {
        "default": winner,
        "failing": {row: reasons for row, reasons in verdicts.items() if reasons},
        "mean_accuracy": {row: mean(row, "accuracy") for row in CANDIDATES},
    }


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        "# Issue 46: the study that chooses the default",
        "",
        "Written by `python benchmarks/accuracy_study.py` from the records in this folder; the rule is in "
        "docs/accuracy.md. Loops: answers cut at the budget whose tail repeats. Δ: the row minus the best member "
        "on the same problems, points, with the paired 95 % bootstrap interval and McNemar's exact p.",
        "",
        "## llama.cpp against float32 on the earlier study's problems",
        "",
        "| task | row | n | llama.cpp % | float32 % | Δ (95 % CI) | p | texts differ | predictions differ | "
        "loops llama.cpp / float32 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in summary["reproduction"]:
        low, high = c["delta_ci95"]
        lines.append(
            f"| {c['task']} | {c['row']} | {c['n']} | {pct(c['accuracy_llamacpp'])} | {pct(c['accuracy_float32'])} | "
            f"{pct(c['accuracy_llamacpp'] - c['accuracy_float32'])} ({pct(low)}, {pct(high)}) | {c['p']:.2f} | "
            f"{c['texts_differ']} | {c['predictions_differ']} | {c['loops_llamacpp']} / {c['loops_float32']} |"
        )
    for task, table in summary["tasks"].items():
        if not table["rows"]:
            lines += ["", f"## {task}: no problems answered by every row yet"]
            continue
        lines += [
            "",
            f"## {task}: {table['n']} problems answered by every row",
            "",
            "| row | accuracy % (95 % CI) | Δ vs best member (95 % CI), p | loops % | cut % | E/T % | "
            "CPU s / problem |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for row, x in table["rows"].items():
            versus = x.get("vs_best_member")
            delta = "–"
            if versus:
                low, high = versus["ci95"]
                delta = f"{pct(versus['delta'])} ({pct(low)}, {pct(high)}), {versus['p']:.3f}"
            cpu = "–" if x["cpu_s_per_problem"] is None else f"{x['cpu_s_per_problem']:.1f}"
            lines.append(
                f"| {row} | {pct(x['accuracy'])} ({pct(x['ci95'][0])}, {pct(x['ci95'][1])}) | {delta} | "
                f"{pct(x['loops'])} | {pct(x['cut'])} | {pct(x['ensemble_rate'])} | {cpu} |"
            )
    lines += ["", "## The rule", ""]
    verdict = summary["rule"]
    if verdict is None:
        lines.append(f"Not applied yet: it reads {FULL} problems of every row on every task ({summary['progress']}).")
    else:
        lines.append(f"Default: **{verdict['default'] or 'no candidate qualifies; the defaults stay'}**.")
        for row, reasons in verdict["failing"].items():
            lines.append(f"- {row} fails: {'; '.join(reasons)}")
    return "\n".join(lines) + "\n"


def summarize(folder: Path = STUDY) -> dict[str, Any]:
    tasks, reproduced = {}, []
    for task in TASKS:
        study = records(folder, task)
        reproduced += reproduction(task, study)
        tasks[task] = task_rows(task, study)
    complete = all(t["n"] >= FULL and set(ROWS) <= t["rows"].keys() for t in tasks.values())
    return {
        "reproduction": reproduced,
        "tasks": tasks,
        "progress": ", ".join(f"{task} {t['n']}" for task, t in tasks.items()),
        "rule": choose_default(tasks) if complete else None,
    }


def main(argv: Sequence[str] = sys.argv[1:]) -> None:
    folder = Path(argv[0]) if argv else STUDY
    if (folder / "timings.jsonl").exists():
        write_timings(folder)  # the runs' and rows' summed times, an interrupted run's included
    summary = summarize(folder)
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (folder / "summary.md").write_text(markdown(summary), encoding="utf-8")
    print(markdown(summary))


if __name__ == "__main__":
    main()
