"""Smoke tests: the LangChain examples run offline with the real demo models and say what they should."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def run_example(name: str, *args: str, timeout: int = 900) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_langchain_rag_example():
    out = run_example("langchain_rag.py")
    lines = out.splitlines()
    assert lines[0] == "Question: Which port does the Orbit API server listen on?"
    retrieved = next(line for line in lines if line.startswith("Retrieved: "))
    assert "orbit-network" in retrieved.split(": ", 1)[1].split(", ")
    answer = next(line for line in lines if line.startswith("Answer: "))
    assert "7421" in answer
    stats = next(line for line in lines if line.startswith("Stats: "))
    assert re.search(r"safe:qwen2\.5-coder-0\.5b\+smollm2-135m \| \d+ tokens, \d+ ensembled \(E/T [\d.]+%\)", stats)


def test_langchain_agent_example():
    out = run_example("langchain_agent.py")
    assert "Question: What is 1234 * 5678? Use the multiply tool." in out
    assert re.search(r"Tool call: multiply\(\{'a': 1234, 'b': 5678\}\)", out), out
    assert "Tool result: multiply -> 7006652" in out
    answer = next(line for line in out.splitlines() if line.startswith("Answer: "))
    assert "7006652" in answer.replace(",", ""), out
