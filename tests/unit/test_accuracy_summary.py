"""The accuracy study's summary pairs its rows on the problems every row answered, picks the best member on
those problems, and counts cut and looping answers (synthetic records: the numbers are known in advance)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import load_benchmark


@pytest.fixture(scope="module")
def summarize() -> Any:
    return load_benchmark("accuracy_summarize")


def record(config: str, problem: int, correct: bool, **extra: Any) -> dict[str, Any]:
    reference = "ABCD"[problem % 4]
    return {
        "config": config,
        "problem_id": f"p{problem}",
        "task": "mmlu-redux",
        "reference": reference,
        "prediction": reference if correct else "A" if reference != "A" else "B",
        "correct": correct,
        "tokens": 100,
        "ensembled_tokens": 0,
        "wall_time_s": 2.0,
        "cpu_time_s": 1.5,
        "finish_reason": "stop",
        "max_new_tokens": 512,
        "text": "The answer is",
    } | extra


def write(folder: Path, name: str, records: list[dict[str, Any]]) -> None:
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


def test_the_study_table_pairs_rows_on_common_problems_and_compares_with_the_best_member(
    tmp_path: Path, summarize: Any
) -> None:
    loop = "x" + "the same sentence again and again, " * 60
    write(tmp_path, "mmlu-redux.jsonl", [record("qwen alone", p, p < 10) for p in range(20)])
    write(tmp_path, "mmlu-redux.members.jsonl", [record("smollm2 alone", p, p < 12) for p in range(25)])
    every = [
        record("UniTE every token", p, p < 5, ensembled_tokens=100, replaced_tokens=0)
        | ({"finish_reason": "length", "text": loop if p < 17 else "cut mid-way"} if p >= 15 else {})
        for p in range(20)
    ]
    safe = [record("UniTE+SAFE", p, p < 14 or p == 20, ensembled_tokens=13, replaced_tokens=4) for p in range(21)]
    write(tmp_path, "mmlu-redux.ensembles.jsonl", every + safe)

    lines, numbers = summarize.study(tmp_path, "mmlu-redux")

    assert numbers["common_problems"] == 20  # p20 (SAFE only) and p20-24 (SmolLM2 only) are left out of pairs
    assert numbers["members"]["smollm2 alone"]["n"] == 25  # ... but members count all they answered
    assert numbers["chance"] == 0.25
    rows = numbers["rows"]
    assert rows["qwen alone"]["accuracy"] == 0.5 and rows["smollm2 alone"]["accuracy"] == 0.6
    assert rows["UniTE+SAFE"]["accuracy"] == 0.7 and rows["UniTE every token"]["accuracy"] == 0.25
    assert rows["UniTE every token"]["cut"] == 0.25 and rows["UniTE every token"]["cut_looping"] == 0.1
    assert rows["UniTE every token"]["ensemble_rate"] == 1.0 and rows["UniTE+SAFE"]["ensemble_rate"] == 0.13
    assert rows["UniTE+SAFE"]["replaced_per_100_tokens"] == 4.0 and rows["qwen alone"]["tokens_per_s"] == 50.0
    lo, hi = rows["UniTE+SAFE"]["ci95"]
    assert lo < 0.7 < hi

    compared = {(c["row"], c["other"]): c for c in numbers["comparisons"]}
    assert set(compared) == {
        ("UniTE every token", "smollm2 alone"),
        ("UniTE+SAFE", "smollm2 alone"),
        ("UniTE+SAFE", "UniTE every token"),
    }
    vs_best = compared["UniTE+SAFE", "smollm2 alone"]
    assert (vs_best["only_row"], vs_best["only_other"]) == (2, 0)
    assert vs_best["delta"] == pytest.approx(0.1) and vs_best["p_value"] == 0.5  # 2 discordant: within noise
    vs_every = compared["UniTE+SAFE", "UniTE every token"]
    assert (vs_every["only_row"], vs_every["only_other"]) == (9, 0) and vs_every["p_value"] < 0.01
    assert any("smollm2 alone (best member)" in line for line in lines)


def test_extended_rows_on_fewer_problems_get_their_own_table_and_leave_the_core_table_whole(
    tmp_path: Path, summarize: Any
) -> None:
    write(
        tmp_path, "mmlu-redux.jsonl", [record(m, p, p < 10) for m in ("qwen alone", "smollm2 alone") for p in range(20)]
    )
    core = [
        record(row, p, p < 8, ensembled_tokens=10) for row in ("UniTE every token", "UniTE+SAFE") for p in range(20)
    ]
    write(tmp_path, "mmlu-redux.ensembles.jsonl", core)
    gate = [record("UniTE+SAFE boundary gate only", p, p < 2, ensembled_tokens=40) for p in range(12)]
    write(tmp_path, "mmlu-redux.ablation.jsonl", gate)

    lines, numbers = summarize.study(tmp_path, "mmlu-redux")

    assert numbers["common_problems"] == 20 and "UniTE+SAFE boundary gate only" not in numbers["rows"]
    extended = numbers["extended"]
    assert extended["common_problems"] == 12 and extended["rows"]["UniTE+SAFE boundary gate only"]["accuracy"] == 2 / 12
    assert extended["rows"]["UniTE+SAFE"]["accuracy"] == 8 / 12  # the core rows again, on the 12 shared problems
    compared = {(c["row"], c["other"]): c for c in extended["comparisons"]}
    vs_full = compared["UniTE+SAFE boundary gate only", "UniTE+SAFE"]  # the ablation against both gates
    assert vs_full["delta"] == pytest.approx(-0.5) and (vs_full["only_row"], vs_full["only_other"]) == (0, 6)
    assert ("UniTE+SAFE boundary gate only", "UniTE every token") in compared
    assert any(line.startswith("The extended rows") for line in lines)


def test_an_extended_row_still_running_is_listed_and_does_not_shrink_the_extended_table(
    tmp_path: Path, summarize: Any
) -> None:
    write(tmp_path, "mmlu-redux.jsonl", [record(m, p, p < 10) for m in ("qwen alone", "UniTE+SAFE") for p in range(20)])
    gate = [record("UniTE+SAFE boundary gate only", p, p < 2) for p in range(12)]
    sampling = [record("UniTE+SAFE sampling (seed 0)", p, p < 3) for p in range(5)]
    write(tmp_path, "mmlu-redux.extended.jsonl", gate + sampling)

    lines, numbers = summarize.study(tmp_path, "mmlu-redux")

    assert numbers["extended"]["common_problems"] == 12
    assert "UniTE+SAFE sampling (seed 0)" not in numbers["extended"]["rows"]
    assert numbers["running"] == {"UniTE+SAFE sampling (seed 0)": 5}
    assert any("UniTE+SAFE sampling (seed 0) (5 of 12 problems)" in line for line in lines)


def test_core_rows_that_have_gone_further_get_a_table_on_their_problems(tmp_path: Path, summarize: Any) -> None:
    members = [record(m, p, p < 10) for m in ("qwen alone", "smollm2 alone") for p in range(30)]
    safe = [record("UniTE+SAFE", p, p < 12, ensembled_tokens=10) for p in range(30)]
    every = [record("UniTE every token", p, p < 2, ensembled_tokens=100) for p in range(8)]
    write(tmp_path, "gsm8k.jsonl", members + safe + every)

    lines, numbers = summarize.study(tmp_path, "gsm8k")

    assert numbers["common_problems"] == 8 and "UniTE every token" in numbers["rows"]
    ahead = numbers["core_ahead"]
    assert ahead["common_problems"] == 30 and set(ahead["rows"]) == {"qwen alone", "smollm2 alone", "UniTE+SAFE"}
    vs_best = next(c for c in ahead["comparisons"] if c["row"] == "UniTE+SAFE")
    assert vs_best["other"] == "qwen alone" and vs_best["delta"] == pytest.approx(2 / 30)
    assert any(line.startswith("While the other core rows run, the members and UniTE+SAFE on the 30") for line in lines)


def test_core_rows_level_with_each_other_get_no_second_table(tmp_path: Path, summarize: Any) -> None:
    rows = [record(m, p, p < 5) for m in ("qwen alone", "UniTE+SAFE", "UniTE every token") for p in range(10)]
    write(tmp_path, "gsm8k.jsonl", rows)

    lines, numbers = summarize.study(tmp_path, "gsm8k")

    assert "core_ahead" not in numbers and not any(line.startswith("While") for line in lines)


# (start, limit) of each part; bbh's start counts per subtask (5 subtasks: --limit 30 is 6 of each)
SPLITS = ((0, 60), (60, 15), (75, 75))


@pytest.mark.parametrize(
    "task, parts", [("mmlu-redux", SPLITS), ("arc", SPLITS), ("gsm8k", SPLITS), ("bbh", ((0, 30), (6, 120)))]
)
def test_a_run_split_with_start_answers_each_problem_of_the_whole_run_once(task: str, parts: tuple) -> None:
    """Runs split with `--start` must cover the problems of the whole run, each once; mmlu-redux's subset is
    stratified over subjects, so its first S+L problems are not its first S followed by the next L in order."""
    accuracy = load_benchmark("accuracy")
    whole = [p.id for p in accuracy.load_problems(task, 150)]
    split = [p.id for start, n in parts for p in accuracy.load_problems(task, n, start)]
    assert len(whole) == len(set(whole)) == 150
    assert sorted(split) == sorted(whole)
