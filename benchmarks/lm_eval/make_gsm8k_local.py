"""Write the local GSM8K copy the lm-evaluation-harness task `gsm8k_local` reads (no hub needed).

    python benchmarks/lm_eval/make_gsm8k_local.py [path/to/gsm8k_test.jsonl]

Reads GSM8K's test split as JSONL (`{"question", "answer"}` rows; default ../shared/data/gsm8k_test.jsonl,
where safe_engine.eval.tasks finds it) and writes its first 3 problems as the few-shot examples and the next
40 as the test problems, beside this script.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FEWSHOT, TEST = 3, 40


def main(source: Path) -> None:
    rows = [json.loads(line) for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [{"question": r["question"], "answer": r["answer"]} for r in rows]
    for name, part in (("fewshot", rows[:FEWSHOT]), ("test", rows[FEWSHOT : FEWSHOT + TEST])):
        path = HERE / f"gsm8k_local_{name}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part), encoding="utf-8")
        print(f"{path}: {len(part)} problems")


if __name__ == "__main__":
    default = HERE.parents[2] / "shared" / "data" / "gsm8k_test.jsonl"
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else default)
