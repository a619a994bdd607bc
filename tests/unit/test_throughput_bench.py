"""benchmarks/throughput.py end to end on tiny models: JSON shape, target ratios, batch = solo equality."""

from __future__ import annotations

import json

from tests.conftest import load_benchmark, tiny_member


def load_script():
    return load_benchmark("throughput")


def test_the_throughput_benchmark_runs_end_to_end_and_renders_from_its_json(tmp_path):
    bench = load_script()
    members = [tiny_member("qwen2.5-7b-instruct", 1), tiny_member("mistral-7b-instruct-v0.3", 2)]
    out, md, png = tmp_path / "t.json", tmp_path / "t.md", tmp_path / "t.png"
    argv = ["--prompts", "3", "--batch-sizes", "1", "2", "--max-new-tokens", "8", "--target-batch-size", "2"]
    argv += ["--out", str(out), "--markdown", str(md), "--plot", str(png)]
    assert bench.main(argv, members=members) == 0

    result = json.loads(out.read_text())
    configs = ["hf", "single", "safe:unite", "safe:gac", "every_token:unite"]
    assert [(r["config"], r["batch_size"]) for r in result["rows"]] == [(c, b) for b in (1, 2) for c in configs]
    for r in result["rows"]:
        assert len(r["requests"]) == 3 and r["tokens"] == sum(q["tokens"] for q in r["requests"]) > 0
        assert r["tokens_per_s"] > 0 and 0 < r["latency_p50_s"] <= r["latency_p95_s"] <= r["wall_s"] + 1e-6
        assert r["peak_rss_mib"] >= r["rss_start_mib"] > 0
        drafter = r["profile"][members[0].name]
        assert drafter["calls"] > 0 and drafter["seconds"] > 0
        assert drafter["seconds"] - 1e-6 <= r["forward_busy_s"] <= r["wall_s"]
        if r["config"] not in ("hf", "single"):
            assert r["profile"][members[1].name]["calls"] > 0
            assert r["mean_ensemble_rate"] is not None and set(r["forward_passes"]) == {m.name for m in members}

    names = {t["target"] for t in result["targets"]}
    assert names == {
        "safe:unite B=2 / safe:unite B=1",
        "safe:unite B=2 / hf B=2",
        "safe:gac B=2 / safe:gac B=1",
        "safe:gac B=2 / hf B=2",
        "single B=2 / hf B=2",
    }
    for t in result["targets"]:
        assert t["ratio"] > 0 and t["passed"] == (t["ratio"] >= t["goal"])

    # every configuration's batch-of-2 texts equal its solo texts (the engine's guarantee; hf too here)
    assert {e["config"] for e in result["equality"]} == set(configs)
    for e in result["equality"]:
        assert (e["compared"], e["equal"], e["rate"], e["differences"]) == (3, 3, 1.0, [])

    text = md.read_text()
    assert "| 3 | safe:unite | 2 |" in text and "## Targets" in text and "3 / 3 | 100.0% |" in text
    assert png.stat().st_size > 0

    md2, png2 = tmp_path / "again.md", tmp_path / "again.png"
    assert bench.main(["--from-json", str(out), "--markdown", str(md2), "--plot", str(png2)]) == 0
    assert md2.read_text() == text and png2.stat().st_size > 0


def test_a_difference_is_located_at_its_first_token_with_the_drafter_gap_there():
    bench = load_script()
    member = tiny_member("qwen2.5-7b-instruct", 1)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    d = bench.divergence(member, messages, "The answer is 4.", "The answer is 5.")
    assert d["token_index"] == len(member.vocab.encode_text("The answer is "))  # Qwen splits " " from digits
    assert d["solo_token"] == "4" and d["batch_token"] == "5"
    assert d["top2_gap"] >= 0 and d["chosen_gap"] >= 0
    ended = bench.divergence(member, messages, "The answer", "The answer is")
    assert ended["solo_token"] == "<|im_end|>" and ended["batch_token"] == " is"


def test_a_batch_text_that_differs_from_its_solo_text_is_reported_with_its_gaps_and_flag():
    bench = load_script()
    members = [tiny_member("qwen2.5-7b-instruct", 1), tiny_member("mistral-7b-instruct-v0.3", 2)]
    messages = {"a": [{"role": "user", "content": "What is 2 + 2?"}], "b": [{"role": "user", "content": "Hi"}]}

    def row(batch_size: int, texts: list[str]):
        requests = [bench.Request(i, t, 5, 1.0, "length", 0.1) for i, t in zip("ab", texts)]
        return bench.make_row(
            2,
            "safe:unite",
            batch_size,
            2.0,
            requests,
            replaced_tokens=0,
            discarded_draft_tokens=0,
            forward_passes={},
            profile={},
            forward_busy_s=0.0,
            rss_start_mib=1.0,
            peak_rss_mib=1.0,
        )

    rows = [row(1, ["The answer is 4.", "Hello"]), row(2, ["The answer is 5.", "Hello"])]
    [e] = bench.equality(rows, members, messages)
    assert (e["compared"], e["equal"], e["rate"]) == (2, 1, 0.5)
    [d] = e["differences"]
    assert d["id"] == "a" and d["char"] == len("The answer is ") and set(d["members"]) == {m.name for m in members}
    assert d["near_tie"] == (d["drafter_top2_gap"] < bench.NEAR_TIE) and e["all_near_ties"] == d["near_tie"]
    result = {
        "date": "",
        "members": [],
        "max_new_tokens": 5,
        "torch_threads": 1,
        "latency": "",
        "rows": [],
        "target_batch_size": 2,
        "equality": [e],
    }
    text = bench.markdown(result)
    assert "1 / 2 requests (50.0%)" in text and "Differences:" in text and "'4' vs '5'" in text
    assert bench.parse_options(["schedule=rounds", "draft_length=4"]) == {"schedule": "rounds", "draft_length": 4}
    assert bench.parse_batch_sizes_for(["16:8,16"]) == {16: [8, 16]}
