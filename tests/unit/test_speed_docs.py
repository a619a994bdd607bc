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


def test_what_the_docs_say_of_rows_only_where_the_scan_reads_is_the_committed_run():
    result = json.loads((ROOT / "benchmarks" / "results" / "verifier_rows.json").read_text())
    pair, three = result["runs"]
    smollm2, gemma = pair["verification_passes"]["smollm2-135m"], three["verification_passes"]["gemma3-270m"]
    gemma_layer = result["output_layer_ms"]["gemma3-270m"]["2 threads"]
    said = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    assert result["cpu"]["model_name"] == "Intel(R) Xeon(R) Processor" and "(`verifier_rows.json`, Intel Xeon" in said
    assert (
        f"SmolLM2 computed {smollm2['rows']} rows in {smollm2['passes']} passes, of which {smollm2['readable']} "
        f"could be read; with three members, gemma-3 computed {gemma['rows']} and {gemma['readable']} could be read"
    ) in said
    assert f"at 2 threads: {gemma_layer['3']:.0f} ms for 3 rows, {gemma_layer['4']:.0f} ms for 4" in said
    shares = pair["bound_share_of_wall"] * 100, three["bound_share_of_wall"] * 100
    assert f"{shares[0]:.1f} % of the pair's wall time and {shares[1]:.1f} % of the three members'" in said
