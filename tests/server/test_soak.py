"""The soak benchmark on the tiny models, bounded: 1,024 mixed requests (streams, plain, disconnects, client
cancellations, malformed bodies, seeded sampling, tools, json_schema, stop) through a real `safe-engine serve`
process in 8 waves of 128; its memory plateaus from the first wave, its threads stay the same, everything is
answered."""

from __future__ import annotations

from tests.conftest import load_benchmark


def load_soak():
    return load_benchmark("soak")


def test_a_thousand_mixed_requests_leave_the_server_as_it_was(model_dirs, tmp_path):
    soak = load_soak()
    out = tmp_path / "soak.json"
    # no warm-up wave: since finished requests hold no logits (docs/serve.md, "Memory over weeks") the size
    # holds from the first wave; before, it grew by ~550 MB over the first waves and then swung ±150 MB
    argv = ["--models", *model_dirs, "--waves", "8", "--clients", "128", "--tokens", "4"]
    argv += ["--hang-s", "90"]
    report = soak.main([*argv, "--out", str(out)])
    assert out.is_file()
    assert report["requests"] == 1024 and len(report["per_wave"]) == 8
    outcomes = report["outcomes"]
    assert sum(outcomes.values()) == report["requests"]
    kinds = {"ok stream", "ok plain", "ok sampling", "ok tools", "ok json_schema", "ok stop"}
    assert kinds <= set(outcomes), outcomes  # every kind of request was answered
    assert outcomes["400"] == report["requests"] // 4  # every malformed body, and nothing else, was a 400
    assert outcomes["disconnected"] > 0 and outcomes["cancelled"] > 0, outcomes
    targets = report["targets"]
    assert targets["no_hang_no_5xx"], outcomes
    assert targets["no_open_requests"] and targets["clean_exit"], report
    assert targets["threads_constant_from_second_wave"], report["threads_per_wave"]
    assert targets["rss_last_within_10pct_or_100mb_of_second"], report["rss_mb_per_wave"]
    assert report["passed"]
