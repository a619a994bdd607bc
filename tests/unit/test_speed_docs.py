"""The speed figures docs/speed.md, docs/llamacpp.md and the README quote are the committed benchmark JSON,
regenerated or read back (a drifted figure fails)."""

from __future__ import annotations

import json
from pathlib import Path

from safe_engine.bench import ratio_table
from tests.conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[2]


def test_the_per_cpu_speed_table_in_the_docs_is_the_committed_runs():
    files = sorted((ROOT / "benchmarks" / "results").glob("speed_measured_*.json"))
    assert files, "the measured-placement runs are committed under benchmarks/results/"
    results = [json.loads(f.read_text()) for f in files]
    assert all(r["cpu"]["model_name"] and r["cpu"]["flags"] for r in results)  # each names its CPU
    assert ratio_table(results) in (ROOT / "docs" / "speed.md").read_text()


def test_the_runtimes_side_by_side_in_the_docs_are_the_committed_runs():
    """docs/speed.md's llama.cpp / torch float32 / torch int8 table per CPU is `llamacpp_speed.py`'s committed
    JSON (`llamacpp_speed.json`, and one file per further CPU kind)."""
    files = sorted((ROOT / "benchmarks" / "results").glob("llamacpp_speed*.json"))
    assert len(files) >= 2
    for file in files:
        result = json.loads(file.read_text())
        assert result["cpu"]["model_name"] and result["cpu"]["flags"]
        table = load_benchmark("llamacpp_speed").runtime_table(result)
        assert table.startswith(f"| {result['cpu']['model_name']} |")
        runtimes = [line.split(" | ")[0].removeprefix("| ") for line in table.splitlines()[2:]]
        assert runtimes == ["llama.cpp", "torch float32", "torch int8"]
        assert table in (ROOT / "docs" / "speed.md").read_text(), file.name


def quoted_ratios(result: dict) -> tuple[float, ...]:
    """What the docs quote of a `llamacpp_speed.py` run: single, SAFE, SAFE over torch, batch and memory ratios,
    and SAFE's floor."""
    ratios = result["ratios"]
    return (
        ratios["engine single / llama-cpp-python (its faster thread count)"],
        ratios["SAFE llama.cpp / llama-cpp-python drafter alone"],
        ratios["SAFE llama.cpp / SAFE torch float32"],
        ratios["batch of 8 / one request (SAFE llama.cpp)"],
        ratios["resident memory llama.cpp / torch float32"],
        load_benchmark("llamacpp_speed").safe_floor(result["runs"]["engine SAFE"]),
    )


def test_the_llamacpp_ratios_quoted_in_the_readme_and_docs_are_the_committed_run():
    result = json.loads((ROOT / "benchmarks" / "results" / "llamacpp_speed.json").read_text())
    single, safe, over_torch, batch, memory, floor = quoted_ratios(result)
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"runs at {single:.2f}× llama-cpp-python's own generation" in readme
    assert f"members at {safe:.2f}× that and {over_torch:.1f}× SAFE over float32 torch members" in readme
    assert f"in {memory:.2f}× the memory" in readme
    said = " ".join((ROOT / "docs" / "llamacpp.md").read_text().split())
    assert f"the engine's `single` runs at {single:.2f}x llama-cpp-python's own generation" in said
    assert f"SAFE over the llama.cpp pair runs at {safe:.2f}x the llama.cpp drafter alone" in said
    assert f"drafter's passes, is {floor:.2f}" in said and f"and {over_torch:.2f}x SAFE over float32" in said
    assert f"a batch of 8 runs at {batch:.2f}x one request" in said and f"resident memory is {memory:.2f}x" in said


def test_the_amd_epyc_llamacpp_ratios_quoted_in_the_docs_are_its_committed_run():
    result = json.loads((ROOT / "benchmarks" / "results" / "llamacpp_speed_epyc.json").read_text())
    assert result["cpu"]["model_name"] == "AMD EPYC"
    single, safe, over_torch, batch, memory, floor = quoted_ratios(result)
    said = " ".join((ROOT / "docs" / "llamacpp.md").read_text().split())
    assert (
        f"`single` {single:.2f}x, SAFE {safe:.2f}x the drafter alone (floor {floor:.2f}) and {over_torch:.2f}x SAFE "
        f"over float32 torch members, a batch of 8 {batch:.2f}x one request, memory {memory:.2f}x (target ≤ 0.35: met"
    ) in said
    assert memory <= 0.35
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert (
        f"AMD EPYC with AVX2 only, with contexts that grow as their requests need: {single:.2f}×, {safe:.2f}× and "
        f"{over_torch:.1f}×, in {memory:.2f}× the memory" in readme
    )
    speed = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    assert f"llama.cpp SAFE is {over_torch:.2f}x (target ≥ 3: met here)" in speed
    assert f"larger here than on the Xeon ({over_torch:.2f}x against" in speed


def test_what_the_docs_say_of_rows_only_where_the_scan_reads_is_the_committed_run():
    result = json.loads((ROOT / "benchmarks" / "results" / "verifier_rows.json").read_text())
    pair, three = result["runs"]
    smollm2, gemma = pair["verification_passes"]["smollm2-135m"], three["verification_passes"]["gemma3-270m"]
    gemma_layer = result["output_layer_ms"]["gemma3-270m"]["2 threads"]
    said = " ".join((ROOT / "docs" / "speed.md").read_text().split())
    assert result["cpu"]["model_name"] == "Intel(R) Xeon(R) Processor" and "(`verifier_rows.json`, Intel Xeon" in said
    assert (
        f"SmolLM2 computed {smollm2['rows']} rows in {smollm2['passes']} passes, of which {smollm2['readable']} "
        f"could be read; with three members, gemma-3 computed {gemma['rows']} and {gemma['readable']} could be read"
    ) in said
    assert f"at 2 threads: {gemma_layer['3']:.0f} ms for 3 rows, {gemma_layer['4']:.0f} ms for 4" in said
    shares = pair["bound_share_of_wall"] * 100, three["bound_share_of_wall"] * 100
    assert f"{shares[0]:.1f} % of the pair's wall time and {shares[1]:.1f} % of the three members'" in said


def test_the_memory_the_llamacpp_docs_quote_is_the_committed_run():
    result = json.loads((ROOT / "benchmarks" / "results" / "member_memory_epyc.json").read_text())
    assert result["cpu"]["model_name"] == "AMD EPYC"
    mib = {name: round(m["mib"]) for name, m in result["resident_mib"].items()}
    fast = result["resident_mib"]["llama.cpp"]
    ratio = result["ratios"]["resident memory llama.cpp / torch float32"]
    said = " ".join((ROOT / "docs" / "llamacpp.md").read_text().split())
    assert (
        f"adds {mib['llama.cpp']:,} MiB with llama.cpp members, {mib['torch float32']:,} with float32 torch members "
        f"and {mib['torch int8']:,} with int8 ones: llama.cpp is {ratio:.2f}x float32"
    ) in said
    after = {name: round(result["resident_mib"][name]["mib_after_256"]) for name in ("llama.cpp", "torch float32")}
    long_ratio = result["ratios"]["resident memory llama.cpp / torch float32 after 256 tokens"]
    assert (
        f"pair holds {after['llama.cpp']:,} MiB against float32's {after['torch float32']:,}: {long_ratio:.2f}x" in said
    )
    assert f"ended after {result['resident_mib']['torch int8']['tokens_of_the_256']:.0f} tokens" in said
    assert f"Of the {mib['llama.cpp']:,} MiB, {fast['mib'] - fast['anonymous_mib']:.0f} are the GGUF files'" in said
    assert f"and {fast['anonymous_mib']:.0f} are anonymous" in said
    qwen, smol = mib["qwen2.5-coder-0.5b:load_tokenizer"], mib["smollm2-135m:load_tokenizer"]
    assert f"the Hugging Face tokenizers the engine encodes with, {qwen} + {smol} MiB" in said
    assert (
        f"Qwen2.5's tokenizer keeps {qwen} MiB against {mib['qwen2.5-coder-0.5b:AutoTokenizer']}, gemma-3's "
        f"{mib['gemma3-270m:load_tokenizer']} against {mib['gemma3-270m:AutoTokenizer']}, SmolLM2's {smol} either way"
    ) in said
    assert mib["smollm2-135m:AutoTokenizer"] == smol
    assert ratio <= 0.35 and long_ratio <= 0.35, "docs/llamacpp.md calls the target met"
