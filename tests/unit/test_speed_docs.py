"""docs/speed.md's table of ratios per CPU is the committed benchmark JSON, regenerated (a drifted figure fails)."""

from __future__ import annotations

import json
from pathlib import Path

from safe_engine.bench import ratio_table
from tests.conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def test_the_per_cpu_speed_table_in_the_docs_is_the_committed_runs():
    files = sorted((ROOT / "benchmarks" / "results").glob("speed_measured_*.json"))
    assert files, "the measured-placement runs are committed under benchmarks/results/"
    results = [json.loads(f.read_text()) for f in files]
    assert all(r["cpu"]["model_name"] and r["cpu"]["flags"] for r in results)  # each names its CPU
    assert ratio_table(results) in (ROOT / "docs" / "speed.md").read_text()


def test_the_runtimes_side_by_side_in_the_docs_are_the_committed_run():
    """docs/speed.md's llama.cpp / torch float32 / torch int8 table is `llamacpp_speed.py`'s committed JSON."""
    result = json.loads((ROOT / "benchmarks" / "results" / "llamacpp_speed.json").read_text())
    assert result["cpu"]["model_name"] and result["cpu"]["flags"]
    table = load_benchmark("llamacpp_speed").runtime_table(result)
    runtimes = [line.split(" | ")[0].removeprefix("| ") for line in table.splitlines()[2:]]
    assert runtimes == ["llama.cpp", "torch float32", "torch int8"]
    assert table in (ROOT / "docs" / "speed.md").read_text()
