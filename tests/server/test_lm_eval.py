"""lm-evaluation-harness, unmodified, drives the server: its `local-completions` model on the repository's
`gsm8k_local` task (a local JSONL copy of GSM8K, nothing from the hub) runs to a score on the tiny models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import KEY, MODEL
from .test_metrics import scrape

pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install 'langchain-safe[test]'")

ROOT = Path(__file__).resolve().parents[2]


def test_lm_eval_local_completions_scores_gsm8k_local(served, tmp_path):
    out = tmp_path / "lm_eval"
    ok = ("safe_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    before = scrape(served.url).get(ok, 0)
    command = [
        sys.executable,
        "-m",
        "lm_eval",
        "--model",
        "local-completions",
        "--model_args",
        f"model={MODEL},base_url={served.v1}/completions,tokenizer_backend=None,num_concurrent=2,max_retries=1",
        "--tasks",
        "gsm8k_local",
        "--include_path",
        "benchmarks/lm_eval",
        "--gen_kwargs",
        "max_gen_toks=12",
        "--limit",
        "2",
        "--output_path",
        str(out),
    ]
    env = {**os.environ, "OPENAI_API_KEY": KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["HF_DATASETS_CACHE"] = str(tmp_path / "datasets")  # the local JSONL, cached away from the user's cache
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]["gsm8k_local"]
    for metric in ("exact_match,strict-match", "exact_match,flexible-extract"):
        assert 0.0 <= results[metric] <= 1.0, results
    assert "gsm8k_local" in done.stdout and "exact_match" in done.stdout  # the harness's own score table
    assert scrape(served.url)[ok] >= before + 2  # one request per problem (at least), all answered
    served.wait_idle()
