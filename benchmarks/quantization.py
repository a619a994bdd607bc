"""Int8 members against float32 members, side by side in one run: resident memory of the loaded pair, the
drafter alone (transformers' `generate`), and SAFE over the pair, each configuration in its own process.

Rows: torch's default threads first (what a script that sets nothing gets), then one thread per process.
The configurations alternate (float32, int8, float32, int8, ...) so that a slow spell of the machine hits
both; each ratio is the median of the paired runs.

The report starts with one layer (896 -> 4864, Qwen2.5-0.5B's MLP) under each int8 option, timed and checked
for batch independence (is a row's output the same alone and beside a row of 8x its range?): float32,
PyTorch's dynamic int8 (one scale per input), torchao's int8 configs when torchao is importable (it is not a
dependency: PYTHONPATH a `pip install --target` copy to include it), and this engine's Int8Linear.

python benchmarks/quantization.py --out benchmarks/results/quantization.json
python benchmarks/quantization.py --tokens 64 --repeats 1                  # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from safe_engine.bench import print_json

MODELS = ["qwen2.5-coder-0.5b", "smollm2-135m"]
MESSAGES = [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def child(quantization: str | None, tokens: int, threads: int | None) -> dict[str, Any]:
    """One configuration in this process: load, then time the drafter alone and SAFE over the pair."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    from safe_engine import Ensemble
    from safe_engine.runtime.baseline import hf_generate
    from safe_engine.shaping.chat import chat_prompt_ids

    before = _rss_mib()
    ens = Ensemble.from_pretrained(MODELS, quantization=quantization, backend="torch")  # torch float32 vs int8
    loaded = _rss_mib()
    drafter = ens.members[0]
    prompt = [chat_prompt_ids(drafter, MESSAGES)]
    hf_generate(drafter, prompt, 4)  # warm-up
    hf = hf_generate(drafter, prompt, tokens, forced=True)
    ens.generate(messages=MESSAGES, max_new_tokens=4)  # warm-up
    res = ens.generate(messages=MESSAGES, max_new_tokens=tokens)
    return {
        "quantization": quantization or "float32",
        "torch_threads": torch.get_num_threads(),
        "rss_before_load_mib": round(before, 1),
        "rss_loaded_mib": round(loaded, 1),  # float32 weights are memory-mapped: read (resident) on first use
        "drafter_alone_tokens_per_s": round(tokens / hf.wall_s, 3),
        "drafter_alone_text": drafter.tokenizer.decode(hf.rows[0].ids, skip_special_tokens=True),
        "safe_tokens": res.stats.tokens,
        "safe_tokens_per_s": round(res.stats.tokens_per_s, 3),
        "safe_ensemble_rate": round(res.stats.ensemble_rate, 3),
        "safe_text": res.text,
        "rss_after_mib": round(_rss_mib(), 1),
    }


def layer_options() -> dict[str, Any]:
    """The int8 options for one linear layer, each a callable module (torchao's only when importable)."""
    import copy
    import warnings

    import torch
    from torch.ao.quantization import quantize_dynamic

    from safe_engine.runtime.quantization import Int8Linear

    torch.manual_seed(0)
    base = torch.nn.Linear(896, 4864)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        options: dict[str, Any] = {
            "float32": base,
            "torch quantize_dynamic (per-input scale)": quantize_dynamic(
                torch.nn.Sequential(copy.deepcopy(base)), {torch.nn.Linear}, dtype=torch.qint8
            ),
            "safe_engine Int8Linear (per-row scale)": Int8Linear(base),
        }
        try:
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_

            for name, config in [("torchao int8 weight-only", Int8WeightOnlyConfig()),
                                 ("torchao int8 dynamic", Int8DynamicActivationInt8WeightConfig())]:  # fmt: skip
                module = torch.nn.Sequential(copy.deepcopy(base))
                quantize_(module, config)
                options[name] = module
        except ImportError:
            options["torchao"] = None
    return options


def layer_probe(threads: int, repeats: int = 50) -> dict[str, Any]:
    """Milliseconds per call at 1 and 5 rows, and batch independence, for each int8 option of one layer."""
    import torch

    torch.set_num_threads(threads)
    out: dict[str, Any] = {"threads": threads, "layer": "896 -> 4864"}
    g = torch.Generator().manual_seed(1)
    for name, module in layer_options().items():
        if module is None:
            out[name] = "not importable here"
            continue
        row: dict[str, Any] = {}
        with torch.inference_mode():
            for rows in (1, 5):
                x = torch.randn(rows, 896, generator=g)
                module(x)
                start = time.perf_counter()
                for _ in range(repeats):
                    module(x)
                row[f"ms_{rows}_rows"] = round((time.perf_counter() - start) / repeats * 1e3, 4)
            x = torch.randn(2, 896, generator=g)
            x[1] *= 8
            row["row_independent"] = bool(torch.equal(module(x)[0], module(x[:1])[0]))
        out[name] = row
    base = out["float32"]
    for row in out.values():
        if isinstance(row, dict):
            row["speed_vs_float32_1_row"] = round(base["ms_1_rows"] / row["ms_1_rows"], 2)
    return out


def run_child(quantization: str | None, tokens: int, threads: int | None) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", quantization or "float32", "--tokens", str(tokens)]
    if threads:
        argv += ["--threads", str(threads)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"child {quantization} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(tokens: int, threads: int | None, repeats: int) -> dict[str, Any]:
    runs: dict[str, list[dict]] = {"float32": [], "int8": []}
    for _ in range(repeats):
        for q in (None, "int8"):
            row = run_child(q, tokens, threads)
            runs[row["quantization"]].append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("text")}), file=sys.stderr, flush=True)

    return {"threads": "torch default" if threads is None else threads, "tokens": tokens, "runs": runs, **summary(runs)}


def summary(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Medians of the paired int8 / float32 ratios. Memory is what the process holds once it has generated
    (the float32 checkpoint is memory-mapped, so right after loading little of it is resident yet)."""
    pairs = list(zip(runs["float32"], runs["int8"]))

    def ratio(value) -> float:
        return round(statistics.median(value(i) / value(f) for f, i in pairs), 3)

    return {
        "int8_vs_float32": {
            "members_resident_memory": ratio(lambda r: r["rss_after_mib"] - r["rss_before_load_mib"]),
            "process_rss": ratio(lambda r: r["rss_after_mib"]),
            "drafter_alone_speed": ratio(lambda r: r["drafter_alone_tokens_per_s"]),
            "safe_speed": ratio(lambda r: r["safe_tokens_per_s"]),
        },
        "same_drafter_text": [f["drafter_alone_text"] == i["drafter_alone_text"] for f, i in pairs],
    }


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128, help="new tokens per generation (default 128)")
    p.add_argument("--repeats", type=int, default=2, help="paired runs per thread setting (default 2)")
    p.add_argument("--out", help="also write the JSON report here")
    p.add_argument("--layer-only", action="store_true", help="only the one-layer comparison")
    p.add_argument("--from-json", help="no new run: recompute the summaries of this report (in place)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        for row in report["rows"]:
            row.update(summary(row["runs"]))
        Path(args.from_json).write_text(json.dumps(report, indent=2) + "\n")
        return report
    if args.child:
        print(json.dumps(child(None if args.child == "float32" else args.child, args.tokens, args.threads)))
        return None
    started = time.perf_counter()
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "models": MODELS,
        "cores": len(os.sched_getaffinity(0)),
        "layer": layer_probe(threads=1),
    }
    print(json.dumps(report["layer"]), file=sys.stderr, flush=True)
    if not args.layer_only:
        report["rows"] = [compare(args.tokens, None, args.repeats), compare(args.tokens, 1, args.repeats)]
    report["run_s"] = round(time.perf_counter() - started, 1)
    print_json(report, args.out)
    return report


if __name__ == "__main__":
    main()
