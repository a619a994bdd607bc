"""Issue 46's rule for the default (docs/accuracy.md), as `benchmarks/accuracy_study.py` applies it: synthetic
rows whose verdict is known in advance, and the whole summary over synthetic records of all 500 problems."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SHARED, load_benchmark


@pytest.fixture(scope="module")
def study() -> Any:
    return load_benchmark("accuracy_study")


def row(accuracy: float, loops: float = 0.0, delta: float = 0.0, p: float = 1.0, cpu: float = 10.0) -> dict[str, Any]:
    return {
        "accuracy": accuracy,
        "loops": loops,
        "cpu_s_per_problem": cpu,
        "vs_best_member": {"member": "qwen alone", "delta": delta, "p": p},
    }


def tables(study: Any) -> dict[str, Any]:
    """Three tasks with the drafter at 40 % and 2 % loops, and every candidate at the drafter's accuracy."""
    drafter = {"accuracy": 0.40, "loops": 0.02, "cpu_s_per_problem": 5.0}
    return {
        task: {"n": 500, "rows": {"qwen alone": drafter} | {name: row(0.40) for name in study.CANDIDATES}}
        for task in study.TASKS
    }


def test_a_candidate_significantly_below_the_best_member_on_one_task_is_not_eligible(study: Any) -> None:
    tasks = tables(study)
    tasks["gsm8k"]["rows"]["GaC+SAFE"] = row(0.34, delta=-0.06, p=0.01)
    tasks["gsm8k"]["rows"]["UniTE+SAFE"] = row(0.36, delta=-0.04, p=0.06)  # below, but not significantly
    verdict = study.choose_default(tasks)
    assert "GaC+SAFE" in verdict["failing"] and "gsm8k" in verdict["failing"]["GaC+SAFE"][0]
    assert "UniTE+SAFE" not in verdict["failing"]


def test_loops_may_exceed_the_drafters_by_one_point_and_no_more(study: Any) -> None:
    tasks = tables(study)
    tasks["arc"]["rows"]["UniTE+SAFE"] = row(0.50, loops=0.03)  # drafter 2 % + 1 point: allowed
    tasks["arc"]["rows"]["GaC+SAFE"] = row(0.50, loops=0.032)
    verdict = study.choose_default(tasks)
    assert verdict["default"] == "UniTE+SAFE"
    assert "loops on 3.2 %" in verdict["failing"]["GaC+SAFE"][0]


def test_the_best_mean_accuracy_wins_and_a_tie_goes_to_fewer_loops_then_less_cpu(study: Any) -> None:
    tasks = tables(study)
    for task in study.TASKS:
        tasks[task]["rows"]["UniTE+SAFE"] = row(0.452, loops=0.025)
        tasks[task]["rows"]["GaC+SAFE"] = row(0.450, loops=0.020, cpu=12.0)  # within 0.5 points, fewer loops
        tasks[task]["rows"]["GaC+SAFE, loop steering"] = row(0.450, loops=0.020, cpu=11.0)  # and less CPU
    assert study.choose_default(tasks)["default"] == "GaC+SAFE, loop steering"
    for task in study.TASKS:
        tasks[task]["rows"]["UniTE+SAFE"] = row(0.47, loops=0.025)  # now clearly best
    assert study.choose_default(tasks)["default"] == "UniTE+SAFE"


def test_no_eligible_candidate_keeps_the_defaults(study: Any) -> None:
    tasks = tables(study)
    for name in study.CANDIDATES:
        tasks["mmlu-redux"]["rows"][name] = row(0.30, delta=-0.10, p=0.001)
    verdict = study.choose_default(tasks)
    assert verdict["default"] is None and set(verdict["failing"]) == set(study.CANDIDATES)


@pytest.mark.skipif(not (SHARED / "data").is_dir(), reason="needs the benchmark data in ../shared/data")
def test_the_summary_applies_the_rule_only_to_complete_rows(study: Any, tmp_path: Path) -> None:
    """Records of every row on the 500 problems of every task: the candidate that is right more often and
    loops no more wins; with one problem missing, the rule is not applied."""
    accuracy = __import__("accuracy")  # the study put benchmarks/ on sys.path
    correct_upto = {"qwen alone": 200, "smollm2 alone": 100, "UniTE+SAFE": 230, "GaC+SAFE": 210}
    for task in study.TASKS:
        ids = [p.id for p in accuracy.load_problems(task, study.FULL)]
        lines = []
        for name in study.ROWS:
            for k, pid in enumerate(ids):
                good = k < correct_upto.get(name, 150)
                text = "answer" if good else "wrong"
                lines.append(
                    {"config": name, "problem_id": pid, "correct": good, "prediction": text, "text": text}
                    | {"tokens": 100, "ensembled_tokens": 5, "cpu_time_s": 2.0, "finish_reason": "stop"}
                )
        (tmp_path / f"{task}.a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    summary = study.summarize(tmp_path)
    assert summary["rule"]["default"] == "UniTE+SAFE"
    assert "loop steering" in " ".join(summary["rule"]["failing"])  # 150 of 500 against the drafter's 200
    gsm8k = summary["tasks"]["gsm8k"]
    assert gsm8k["n"] == 500 and gsm8k["best_member"] == "qwen alone"
    assert gsm8k["rows"]["UniTE+SAFE"]["vs_best_member"]["delta"] == pytest.approx(30 / 500)

    lines = (tmp_path / "arc.a.jsonl").read_text(encoding="utf-8").splitlines()
    (tmp_path / "arc.a.jsonl").write_text("\n".join(lines[1:]) + "\n", encoding="utf-8")
    assert study.summarize(tmp_path)["rule"] is None
