"""The accuracy study's script runs every one of its rows on the real demo models, resumes without redoing a
pair, and its summary pairs the rows on the same problems (tiny budget: this checks the plumbing, not
accuracy)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BUDGET = 6


def study(out: Path, *args: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, *args]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def test_every_row_of_the_study_runs_resumes_and_is_summarised(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from accuracy import _DRAFTER15_ROWS, config_factories

    options = argparse.Namespace(
        max_new_tokens=BUDGET, batch=16, ensemble_batch=8, seed=0, backend="torch", positions=None
    )
    # the row names (the factories build nothing until called); the 1.5B rows run in llama.cpp only, and its
    # 1.1 GB file is not fetched in CI
    rows = [row for row in config_factories([], options) if row not in _DRAFTER15_ROWS]
    base = ["benchmarks/accuracy.py", "--task", "mmlu-redux", "--limit", "2", "--threads", "1"]
    base += ["--max-new-tokens", str(BUDGET), "--out", str(tmp_path)]
    study(tmp_path, *base, "--configs", *rows)
    records = [json.loads(line) for line in (tmp_path / "mmlu-redux.jsonl").read_text(encoding="utf-8").splitlines()]
    assert sorted({r["config"] for r in records}) == sorted(rows)
    assert len(records) == 2 * len(rows)  # each row answered both problems, once
    for r in records:
        assert 0 < r["tokens"] <= BUDGET and r["cpu_time_s"] > 0, r
        if r["config"].endswith("alone"):
            continue
        assert r["replaced_tokens"] >= 0 and sum(r["forward_passes"].values()) > 0, r
    by = {(r["config"], r["problem_id"]): r for r in records}
    first = records[0]["problem_id"]
    every = by["UniTE every token", first]
    assert every["ensembled_tokens"] == every["tokens"]  # every-token ensembling decides every position
    seeds = {by[f"UniTE+SAFE sampling (seed {s})", first]["seed"] for s in range(3)}
    assert len(seeds) == 3  # three different seeds per problem
    drafters = {"UniTE+SAFE": "qwen2.5-coder-0.5b", "UniTE+SAFE, smollm2 drafts": "smollm2-135m"}
    drafters |= {
        "UniTE+SAFE (3 models), smollm2 drafts": "smollm2-135m",
        "UniTE+SAFE (3 models), gemma drafts": "gemma3-270m",
    }
    for row, name in drafters.items():
        assert next(iter(by[row, first]["forward_passes"])) == name  # the drafter's passes come first

    lines = (tmp_path / "mmlu-redux.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    size = (tmp_path / "mmlu-redux.jsonl").stat().st_size
    study(tmp_path, *base, "--configs", "qwen alone", "UniTE+SAFE")  # resume: nothing left to run
    assert (tmp_path / "mmlu-redux.jsonl").stat().st_size == size

    part = tmp_path / "mmlu-redux.gac.jsonl"  # a second process's part file counts in the report too
    gac = [line for line in lines if '"config": "GaC+SAFE"' in line]
    part.write_text("".join(gac), encoding="utf-8")
    (tmp_path / "mmlu-redux.jsonl").write_text("".join(x for x in lines if x not in gac), encoding="utf-8")
    study(tmp_path, *base, "--report-only")
    assert "| GaC+SAFE" in (tmp_path / "mmlu-redux" / "results.md").read_text(encoding="utf-8")

    study(tmp_path, "benchmarks/accuracy_summarize.py", str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text(encoding="utf-8"))["mmlu-redux"]
    core = {"qwen alone", "smollm2 alone", "gemma alone", "UniTE every token", "UniTE+SAFE", "GaC+SAFE"}
    core |= {"UniTE+SAFE (3 models)"}
    assert summary["common_problems"] == 2 and set(summary["rows"]) == core
    assert summary["extended"]["common_problems"] == 2 and set(summary["extended"]["rows"]) == set(rows)
    compared = {(c["row"], c["other"]) for c in summary["comparisons"] + summary["extended"]["comparisons"]}
    assert ("UniTE+SAFE", "UniTE every token") in compared and ("GaC+SAFE", "GaC every token") in compared
    assert ("UniTE+SAFE consensus gate only", "UniTE+SAFE") in compared
    assert (tmp_path / "study.png").stat().st_size > 0 and "McNemar" in (tmp_path / "summary.md").read_text()


def test_kill_stops_a_study_run_at_once_and_keeps_its_records_and_times(tmp_path: Path) -> None:
    """`kill` (SIGTERM) ends a run mid-batch within seconds, as Ctrl-C does: the records written so far stay,
    the run's wall and CPU time are appended as "interrupted", and rerunning the command resumes."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = ["benchmarks/accuracy.py", "--task", "mmlu-redux", "--limit", "3", "--threads", "1", "--out", str(tmp_path)]
    args += ["--max-new-tokens", "200", "--batch", "1", "--configs", "smollm2 alone", "UniTE+SAFE"]
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    results = tmp_path / "mmlu-redux.jsonl"
    try:
        deadline = time.monotonic() + 600
        while not (results.exists() and results.read_text(encoding="utf-8").strip()):  # one record written
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # now the ensemble row decodes its batch
        assert proc.wait(timeout=60) != 0
    finally:
        proc.kill()
    (run,) = [json.loads(line) for line in (tmp_path / "timings.jsonl").read_text(encoding="utf-8").splitlines()]
    assert run["status"] == "interrupted" and run["cpu_s"] > 0
    kept = results.read_text(encoding="utf-8").splitlines()
    assert kept and all(json.loads(line)["config"] == "smollm2 alone" for line in kept)
