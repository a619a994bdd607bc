"""docs/speed.md's table of ratios per CPU is the committed benchmark JSON, regenerated (a drifted figure fails)."""

from __future__ import annotations

import json
from pathlib import Path

from safe_engine.bench import ratio_table

ROOT = Path(__file__).resolve().parents[2]


def test_the_per_cpu_speed_table_in_the_docs_is_the_committed_runs():
    files = sorted((ROOT / "benchmarks" / "results").glob("speed_measured_*.json"))
    assert files, "the measured-placement runs are committed under benchmarks/results/"
    results = [json.loads(f.read_text()) for f in files]
    assert all(r["cpu"]["model_name"] and r["cpu"]["flags"] for r in results)  # each names its CPU
    assert ratio_table(results) in (ROOT / "docs" / "speed.md").read_text()
