"""docs/llamacpp.md's batch-variance table is the committed measurement (benchmarks/results/llamacpp_variance.json):
a rerun of the benchmark that is not carried into the docs fails here."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def cell(numbers: dict) -> str:
    """How the docs write one comparison: largest / mean |Δlogit|, argmax differs of positions."""
    if numbers["max_abs"] == 0:
        return "bit-identical"
    return (
        f"{numbers['max_abs']:.2f} / {numbers['mean_abs']:.3f}, {numbers['argmax_differs']} of {numbers['positions']:,}"
    )


def test_the_variance_table_is_the_committed_measurement() -> None:
    measured = json.loads((ROOT / "benchmarks/results/llamacpp_variance.json").read_text(encoding="utf-8"))
    docs = (ROOT / "docs/llamacpp.md").read_text(encoding="utf-8")
    for model, numbers in measured["models"].items():
        row = f"| {model} | {cell(numbers['steps_vs_pass'])} | {cell(numbers['alone_vs_batched'])} | "
        row += f"{cell(numbers['redecode'])} |"
        assert row in docs, f"docs/llamacpp.md lacks the measured row {row!r}"
    total = sum(m["steps_vs_pass"]["positions"] for m in measured["models"].values())
    assert f"({total:,} in all)" in docs
