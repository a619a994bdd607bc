"""Where the demo ensemble's resident memory goes: each load alone in a fresh process, side by side in one run.

`llamacpp_speed.py` loads its three ensembles in one process (llama.cpp first); here nothing one load freed is
reused by the next, and the parts are split out:

- the demo pair (Qwen2.5-Coder-0.5B drafting, SmolLM2-135M verifying) on each runtime: llama.cpp, torch
  float32, torch int8. The resident set grown by loading it and running 8 tokens of a chat answer (what
  `llamacpp_speed.py` reports), its anonymous part (the rest is mapped weights: the GGUF files, or the
  safetensors torch reads), and the ratios to float32; then the same after a second answer of 256 tokens
  (KV caches grow with what the requests hold, on every runtime);
- the pair's tokenizers and gemma-3-270m's as the engine loads them (`demo_models.load_tokenizer`: the
  tokenizer.json read as it is) against the family's class that `AutoTokenizer` picks (Qwen2Tokenizer and
  GemmaTokenizer keep a Python parse of the file).

    .venv/bin/python benchmarks/member_memory.py --out benchmarks/results/member_memory_epyc.json

Memory does not depend on what else runs on the machine, unlike the speed benchmarks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODELS = ["qwen2.5-coder-0.5b", "smollm2-135m"]  # drafter first, as llamacpp_speed.py
CHAT = [{"role": "user", "content": "Write a long, detailed story about a lighthouse keeper."}]
RUNTIMES = {"llama.cpp": ("llama.cpp", None), "torch float32": ("torch", None), "torch int8": ("torch", "int8")}
TOKENIZER_MODELS = [*MODELS, "gemma3-270m"]
TOKENIZER_LOADERS = ("load_tokenizer", "AutoTokenizer")
LONG = 256  # tokens of the second answer, as the speed benchmarks'


def _resident() -> tuple[float, float]:
    """This process's resident set and its anonymous part, MiB."""
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) / 1024
    return fields["Rss"], fields["Anonymous"]


def _ensemble(runtime: str) -> dict[str, float]:
    """The demo pair on `runtime`, loaded and run for 8 tokens: the resident memory that added."""
    from safe_engine import Ensemble

    backend, quantization = RUNTIMES[runtime]
    rss, anon = _resident()  # after the imports, which every load pays alike
    ens = Ensemble.from_pretrained(MODELS, backend=backend, quantization=quantization)
    ens.generate(messages=CHAT, max_new_tokens=8)  # (loading ends by giving the freed heap back to the OS)
    rss2, anon2 = _resident()
    assert {m.backend for m in ens.members} == {backend}, "install the llamacpp extra"
    long = ens.generate(messages=CHAT, max_new_tokens=LONG)  # the caches grow with an answer, on each runtime
    rss3, anon3 = _resident()
    return {
        "mib": rss2 - rss,
        "anonymous_mib": anon2 - anon,
        f"mib_after_{LONG}": rss3 - rss,
        f"anonymous_mib_after_{LONG}": anon3 - anon,
        f"tokens_of_the_{LONG}": long.stats.tokens,
    }


def _tokenizer(model: str, loader: str) -> dict[str, float]:
    """Demo model `model`'s tokenizer loaded by `loader`: the resident memory it keeps."""
    from transformers import AutoTokenizer

    from safe_engine.engine.memory import release_free_memory
    from safe_engine.runtime import demo_models

    directory = demo_models.tokenizer_dir(
        demo_models.fetch(model, progress=False), demo_models.DEMO_MODELS[model].sha256
    )
    load = demo_models.load_tokenizer if loader == "load_tokenizer" else AutoTokenizer.from_pretrained
    rss, anon = _resident()
    tokenizer = load(directory)
    release_free_memory()  # as the engine does once its members are loaded: what parsing freed goes back
    rss2, anon2 = _resident()
    assert tokenizer.encode("hello")
    return {"mib": rss2 - rss, "anonymous_mib": anon2 - anon}


def measure(kind: str, name: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, name], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2, help="fresh processes per measurement (medians)")
    p.add_argument("--out")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, name = args.child
        print(json.dumps(_ensemble(name) if kind == "ensemble" else _tokenizer(*name.split(":"))))
        return 0

    from safe_engine.bench import print_json
    from safe_engine.runtime.placement import cpu_info

    jobs = [("ensemble", r) for r in RUNTIMES] + [
        ("tokenizer", f"{m}:{loader}") for m in TOKENIZER_MODELS for loader in TOKENIZER_LOADERS
    ]
    runs: dict[str, list[dict[str, float]]] = {name: [] for _, name in jobs}
    for _ in range(args.repeats):  # in turns, as the speed benchmarks
        for kind, name in jobs:
            runs[name].append(measure(kind, name))
    mib = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    float32 = mib["torch float32"]["mib"]
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "cpu": cpu_info(),
        "models": MODELS,
        "repeats": args.repeats,
        "resident_mib": mib,
        "ratios": {
            "resident memory llama.cpp / torch float32": mib["llama.cpp"]["mib"] / float32,
            "resident memory torch int8 / torch float32": mib["torch int8"]["mib"] / float32,
            f"resident memory llama.cpp / torch float32 after {LONG} tokens": mib["llama.cpp"][f"mib_after_{LONG}"]
            / mib["torch float32"][f"mib_after_{LONG}"],
            **{
                f"{m} tokenizer load_tokenizer / AutoTokenizer": mib[f"{m}:load_tokenizer"]["mib"]
                / mib[f"{m}:AutoTokenizer"]["mib"]
                for m in TOKENIZER_MODELS
            },
        },
        "runs": runs,
    }
    print_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
