"""The int8 pair against the float32 pair on the same MMLU-redux problems (issue 30): accuracy of each, the
paired difference with its bootstrap interval, McNemar's exact test, answers cut in a loop, CPU time.

    python benchmarks/accuracy_int8.py > benchmarks/results/accuracy/int8_vs_float.json

Both rows are UniTE+SAFE over Qwen2.5-Coder-0.5B + SmolLM2-135M with token healing, one torch thread: the
float32 row from the issue-31 re-run (`rerun-31/mmlu-redux.jsonl`), the int8 row from `int8/mmlu-redux.jsonl`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from accuracy_summarize import loops

from safe_engine.eval.runner import load_records
from safe_engine.eval.significance import bootstrap_difference, mcnemar

HERE = Path(__file__).resolve().parent / "results" / "accuracy"  # the study's records
FLOAT = (HERE / "rerun-31" / "mmlu-redux.jsonl", "UniTE+SAFE")
INT8 = (HERE / "int8" / "mmlu-redux.jsonl", "UniTE+SAFE, int8 members")


def rows(path: Path, config: str) -> dict[str, dict]:
    return {str(r["problem_id"]): r for r in load_records(path) if r["config"] == config}


def main() -> int:
    f32, int8 = rows(*FLOAT), rows(*INT8)
    ids = sorted(set(f32) & set(int8))
    if not ids:
        print("no problem is in both rows yet", file=sys.stderr)
        return 1
    a = [bool(int8[i]["correct"]) for i in ids]
    b = [bool(f32[i]["correct"]) for i in ids]
    test = mcnemar(a, b)
    low, high = bootstrap_difference(a, b)

    def side(recs: dict[str, dict]) -> dict:
        chosen = [recs[i] for i in ids]
        return {
            "correct": sum(bool(r["correct"]) for r in chosen),
            "accuracy": sum(bool(r["correct"]) for r in chosen) / len(ids),
            "cut_in_a_loop": sum(r.get("finish_reason") == "length" and loops(str(r["text"])) for r in chosen),
            "cpu_s": sum(float(r.get("cpu_time_s") or 0.0) for r in chosen),
            "tokens": sum(int(r.get("tokens") or 0) for r in chosen),
        }

    same_text = sum(int8[i]["text"] == f32[i]["text"] for i in ids)
    out = {
        "problems": len(ids),
        "float32": {"file": str(FLOAT[0].relative_to(HERE)), **side(f32)},
        "int8": {"file": str(INT8[0].relative_to(HERE)), **side(int8)},
        "difference_int8_minus_float32": sum(a) / len(ids) - sum(b) / len(ids),
        "difference_ci95": [low, high],
        "mcnemar": {"only_int8": test.only_a, "only_float32": test.only_b, "p_value": test.p_value},
        "same_answer_text": same_text,
    }
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
