"""The safe-engine CLI on tiny models saved to disk: output shapes and one-line errors."""

from __future__ import annotations

import json

import pytest

from safe_engine.cli import main


def test_generate_json(model_dirs, capsys):
    rc = main(["generate", "-m", model_dirs[0], "-m", model_dirs[1], "--max-new-tokens", "6", "--json", "Hello"])
    out = capsys.readouterr().out
    assert rc == 0
    result = json.loads(out)
    assert result["finish_reason"] == "length" and result["stats"]["tokens"] == 6
    assert 0 <= result["stats"]["ensemble_rate"] <= 1


def test_generate_writes_the_trace_as_json_lines(model_dirs, capsys, tmp_path):
    path = tmp_path / "trace.jsonl"
    base = ["generate", "-m", model_dirs[0], "-m", model_dirs[1], "--max-new-tokens", "12", "--json"]
    assert main([*base, "--trace", str(path), "Hello"]) == 0
    result = json.loads(capsys.readouterr().out)
    points = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(points) == result["stats"]["ensembled_tokens"] > 0
    assert {"offset", "drafted", "chosen", "replaced", "member_probs", "candidates", "gates"} <= set(points[0])
    assert main([*base, "--method", "every_token", "--trace", "-", "Hello"]) == 0
    out = capsys.readouterr().out.splitlines()
    stats = json.loads(out[0])["stats"]
    assert stats["gates"] == [] and len(out) - 1 == stats["ensembled_tokens"] == stats["tokens"]
    assert main([*base, "--gates", "boundary", "Hello"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["gates"] == ["boundary"]


def test_generate_json_reports_logprobs_and_takes_penalties_and_a_logit_bias(model_dirs, capsys):
    base = ["generate", "-m", model_dirs[0], "-m", model_dirs[1], "--max-new-tokens", "8", "--json"]
    assert main([*base, "--logprobs", "2", "--repetition-penalty", "1.3", "--frequency-penalty", "0.5", "Hi"]) == 0
    result = json.loads(capsys.readouterr().out)
    content = result["logprobs"]["content"]
    assert "".join(bytes(e["bytes"]).decode("utf-8", errors="replace") for e in content) == result["text"]
    assert all(e["source"] in ("drafter", "ensemble") and len(e["top_logprobs"]) <= 2 for e in content)
    assert main([*base, "--logit-bias", '{"100": -100}', "Hi"]) == 0
    assert "logprobs" not in json.loads(capsys.readouterr().out)


def test_generate_stream_prints_text_and_stats(model_dirs, capsys):
    rc = main(["generate", "-m", model_dirs[0], "-m", model_dirs[1], "--max-new-tokens", "6", "--stream", "Hi"])
    captured = capsys.readouterr()
    assert rc == 0 and captured.out.strip()
    assert "E/T" in captured.err and "forward passes" in captured.err
    # where the forwards run: measured and chosen at load, repeated on the stats line
    assert "[loaded " in captured.err and "threads: " in captured.err.splitlines()[-1]
    placement = next(line for line in captured.err.splitlines() if line.startswith("[loaded "))
    assert "drafter alone" in placement or "every forward" in placement  # the engine's, or the user's threads


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "-m", "/no/such/dir", "hi"], "not a model directory"),
        (["generate", "-m", "{0}", "--method", "fastest", "hi"], "unknown method"),
        (["generate", "-m", "{0}", "-m", "{1}", "--chat", "hi"], "no chat template"),
        (["generate", "-m", "{0}", "--max-new-tokens", "0", "hi"], "max_new_tokens"),
        (["generate", "-m", "{0}", "--logprobs", "2", "hi"], "--logprobs is reported in the JSON output only"),
        (["generate", "-m", "{0}", "--json", "--logprobs", "30", "hi"], "logprobs must be in [0, 20]"),
        (["generate", "-m", "{0}", "--json", "--presence-penalty", "3", "hi"], "presence_penalty must be"),
        (["generate", "-m", "{0}", "--json", "--logit-bias", '{{"a": 1}}', "hi"], "logit_bias keys must be token ids"),
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
    names = {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert names <= {line.split()[0] for line in out.splitlines()}


def test_models_fetch_leaves_the_large_drafter_out_unless_named_and_gguf_skips_the_conversion(monkeypatch, capsys):
    from safe_engine.runtime import demo_models

    calls = []
    monkeypatch.setattr(demo_models, "model_dir", lambda name, verify: calls.append(("convert", name)) or name)
    monkeypatch.setattr(demo_models, "fetch", lambda name: calls.append(("fetch", name)) or name)
    monkeypatch.setattr(demo_models, "tokenizer_dir", lambda path, sha: calls.append(("tokenizer", path, sha)))
    assert main(["models", "fetch"]) == 0
    assert calls == [("convert", n) for n in ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")]
    calls.clear()
    assert main(["models", "fetch", "--gguf", "qwen2.5-coder-1.5b"]) == 0  # the option before or after the names
    assert main(["models", "fetch", "qwen2.5-coder-1.5b", "--gguf"]) == 0
    sha = demo_models.DEMO_MODELS["qwen2.5-coder-1.5b"].sha256
    assert calls == [("fetch", "qwen2.5-coder-1.5b"), ("tokenizer", "qwen2.5-coder-1.5b", sha)] * 2
    assert capsys.readouterr().out.startswith("smollm2-135m: ")


def test_bench_reports_ratios_next_to_floors_and_plots(model_dirs, tmp_path, capsys):
    out, png = tmp_path / "speed.json", tmp_path / "speed.png"
    argv = ["bench", "-m", model_dirs[0], "-m", model_dirs[1], "--lengths", "4", "8", "--threads", "1"]
    assert main([*argv, "--out", str(out), "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    (run,) = result["runs"]
    assert run["members"] == [m.rsplit("/", 1)[-1] for m in model_dirs] and set(run["t5_s"]) == set(run["members"])
    from safe_engine.bench import CONFIGS

    for n in ("4", "8"):
        row = run["lengths"][n]
        assert set(row["configs"]) == set(CONFIGS)
        single = row["configs"]["single"]
        assert single["tokens"] == int(n) and single["ensemble_rate"] == 0 and single["floor_vs_drafter_alone"] is None
        for name in ("safe rounds", "safe + adaptive draft", "safe + overlap", "safe default"):
            r = row["configs"][name]
            assert 0 < r["floor_vs_drafter_alone"] <= 1 and r["vs_drafter_alone"] > 0
            assert r["diverges_from_rounds_at_char"] is None  # every schedule: the same greedy text
        assert 0 < row["floor_every_token_vs_drafter_alone"] < 1
    assert png.stat().st_size > 10_000
    png.unlink()
    md = tmp_path / "speed.md"
    assert main(["bench", "--from-json", str(out), "--plot", str(png), "--markdown", str(md)]) == 0
    assert png.stat().st_size > 10_000
    table = md.read_text().splitlines()
    assert len(table) == 2 + 2 * (1 + len(CONFIGS)) and table[2].startswith(f"| {' + '.join(run['members'])} | 4 |")
    floor = run["lengths"]["8"]["configs"]["safe rounds"]["floor_vs_drafter_alone"]
    assert any(f"({floor:.2f})" in line and "safe rounds" in line for line in table[-len(CONFIGS) :])
