"""Summary of the single-model rows of the accuracy study: writes summary.md (and timings.json) next to this file.

    python benchmarks/results/accuracy/summarize.py

Per task and row: n, accuracy with a 95 % Wilson interval, answers cut at the budget, answers with no
extractable answer, tokens/s (a batch's share, see the reports), the row's wall and CPU time; per BBH subtask
accuracy; the chance and majority-class baselines; and the spread (max - min accuracy) of the three members
per task, the first cut at "where are the members closest".
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "benchmarks"))

from accuracy import write_timings  # noqa: E402

from safe_engine.eval import load_records  # noqa: E402

TASKS = ("gsm8k", "arc", "bbh", "mmlu-redux")
ROWS = ("qwen alone", "smollm2 alone", "gemma alone")


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return 0.0, 0.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def baselines(recs: Sequence[dict[str, Any]], task: str) -> tuple[float | None, float | None]:
    """(chance, majority-class accuracy) over one row's problems; chance is None for free-form answers.

    The majority class is taken per BBH subtask (per task elsewhere: for ARC / MMLU-redux it is the most
    common answer letter, the score of a model that always picks that position)."""
    refs = [str(r["reference"]) for r in recs]
    if task == "gsm8k":
        return None, None  # free-form numbers
    parts = Counter(str(r.get("subtask")) if task == "bbh" else "" for r in recs)
    hits = sum(
        Counter(
            str(r["reference"]) for r in recs if (str(r.get("subtask")) if task == "bbh" else "") == part
        ).most_common(1)[0][1]
        for part in parts
    )
    majority = hits / len(refs) if refs else 0.0
    if task in ("arc", "mmlu-redux"):
        return 0.25, majority  # ARC-Challenge and MMLU-redux: (almost) always four options
    if task == "bbh":
        binary = sum(1 for x in refs if x.lower() in ("true", "false", "yes", "no"))
        return (0.5 * binary / len(refs) if refs else None), majority
    return None, majority


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def main() -> None:
    write_timings(HERE)
    timings = json.loads((HERE / "timings.json").read_text(encoding="utf-8"))
    lines = ["# Accuracy study: single-model rows", ""]
    spreads: dict[str, float] = {}
    for task in TASKS:
        records = load_records(HERE / f"{task}.jsonl")
        if not records:
            continue
        by_row = {row: [r for r in records if r["config"] == row] for row in ROWS}
        n_common = len(set.intersection(*({r["problem_id"] for r in v} for v in by_row.values())))
        chance, majority = baselines(by_row["qwen alone"], task)
        budget = max((int(r.get("max_new_tokens") or 0) for r in records), default=0)
        t = timings.get(task, {})
        lines += [
            f"## {task} (max_new_tokens {budget}; {n_common} problems answered by all three rows)",
            "",
            f"Chance {pct(chance)} %, majority class {pct(majority)} %. Whole runs of this task: wall "
            f"{t.get('wall_s', 0) / 60:.1f} min, CPU {t.get('cpu_s', 0) / 60:.1f} min over {t.get('runs', 0)} "
            "invocation(s), model loading included.",
            "",
            "| Row | n | Accuracy (%) | 95 % CI | Cut at budget (%) | No answer (%) | Tokens/s † | "
            "Row wall (min) | Row CPU (min) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        accs = []
        for row, recs in by_row.items():
            n = len(recs)
            if not n:
                continue
            k = sum(1 for r in recs if r["correct"])
            lo, hi = wilson(k, n)
            cut = sum(1 for r in recs if r.get("finish_reason") == "length") / n
            none = sum(1 for r in recs if r.get("prediction") is None) / n
            tokens = sum(int(r.get("tokens") or 0) for r in recs)
            wall = sum(float(r.get("wall_time_s") or 0) for r in recs)
            cpu = sum(float(r.get("cpu_time_s") or 0) for r in recs)
            accs.append(k / n)
            lines.append(
                f"| {row} | {n} | {100 * k / n:.1f} | {100 * lo:.0f}–{100 * hi:.0f} | {100 * cut:.0f} | "
                f"{100 * none:.0f} | {tokens / wall if wall else 0:.1f} | {wall / 60:.1f} | {cpu / 60:.1f} |"
            )
        if len(accs) == len(ROWS):
            spreads[task] = max(accs) - min(accs)
        if task == "bbh":
            subtasks = sorted({str(r["subtask"]) for r in records})
            lines += ["", "| Row | " + " | ".join(subtasks) + " |", "|---|" + "---:|" * len(subtasks)]
            for row, recs in by_row.items():
                cells = []
                for sub in subtasks:
                    mine = [r for r in recs if r["subtask"] == sub]
                    cells.append(f"{100 * sum(r['correct'] for r in mine) / len(mine):.0f}" if mine else "–")
                lines.append(f"| {row} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "† batched rows: tokens/s is a batch's throughput divided over its problems (not one-at-a-time speed).",
        "",
        "## Spread of the three members' accuracies (max - min, points)",
        "",
        "| Task | Spread |",
        "|---|---:|",
    ]
    lines += [f"| {task} | {100 * s:.1f} |" for task, s in sorted(spreads.items(), key=lambda kv: kv[1])]
    (HERE / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print((HERE / "summary.md").read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
