"""The safe-engine CLI on tiny models saved to disk: output shapes and one-line errors."""

from __future__ import annotations

import json

import pytest

from safe_engine.cli import main
from tests.conftest import tiny_member


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = []
    for family, seed in (("qwen2.5-7b-instruct", 1), ("gpt2", 2)):
        member = tiny_member(family, seed)
        path = tmp_path_factory.mktemp(family)
        member.model.save_pretrained(path)
        member.tokenizer.save_pretrained(path)
        dirs.append(str(path))
    return dirs


def test_generate_json(model_dirs, capsys):
    rc = main(["generate", "-m", model_dirs[0], "-m", model_dirs[1], "--max-new-tokens", "6", "--json", "Hello"])
    out = capsys.readouterr().out
    assert rc == 0
    result = json.loads(out)
    assert result["finish_reason"] == "length" and result["stats"]["tokens"] == 6
    assert 0 <= result["stats"]["ensemble_rate"] <= 1


def test_generate_stream_prints_text_and_stats(model_dirs, capsys):
    rc = main(["generate", "-m", model_dirs[0], "-m", model_dirs[1], "--max-new-tokens", "6", "--stream", "Hi"])
    captured = capsys.readouterr()
    assert rc == 0 and captured.out.strip()
    assert "E/T" in captured.err and "forward passes" in captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "-m", "/no/such/dir", "hi"], "not a model directory"),
        (["generate", "-m", "{0}", "--method", "fastest", "hi"], "unknown method"),
        (["generate", "-m", "{0}", "-m", "{1}", "--chat", "hi"], "no chat template"),
        (["generate", "-m", "{0}", "--max-new-tokens", "0", "hi"], "max_new_tokens"),
    ],
)
def test_user_errors_are_one_line_without_traceback(model_dirs, capsys, argv, message):
    rc = main([a.format(*model_dirs) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [line for line in err.splitlines() if line.startswith("safe-engine: error:")]
    assert len(lines) == 1 and message in lines[0]
    assert "Traceback" not in err


def test_models_list(capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"} <= {line.split()[0] for line in out.splitlines()}
