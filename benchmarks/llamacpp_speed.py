"""llama.cpp members against llama-cpp-python's own generation and against float32 torch members, in one process.

What a user comparing `ChatSafe` with `ChatOllama` / `ChatLlamaCpp` sees: the demo pair (Qwen2.5-Coder-0.5B
drafting, SmolLM2-135M verifying), a chat prompt, greedy, up to 256 new tokens, engine defaults (the backend
"auto" picks llama.cpp for the demo GGUF files). Side by side, in turns (`--repeats`, medians):

- llama-cpp-python's own `Llama.create_completion` of the drafter's GGUF, at 1 thread and at all cores (the
  faster one is the baseline: a user would pick it);
- the engine's `method="single"` over the llama.cpp drafter, and SAFE over the llama.cpp pair;
- the drafter alone and SAFE over the torch members of the same files (backend="torch"), float32 and
  `quantization="int8"`: the three runtimes side by side. Each runtime's two rows share the first story topic
  on which both answers run the whole length (`long_answer_topic`): the int8 pair's greedy SAFE answer to the
  first one is a 13-token refusal, and a row over 13 tokens times mostly the prompt's pass;
- a batch of 8 different chat requests through SAFE over llama.cpp members, against one request's speed.

Memory: the process's resident set grown by loading each ensemble and running it once (llama.cpp maps the GGUF;
its pages count once read).

    .venv/bin/python benchmarks/llamacpp_speed.py --repeats 3 --out benchmarks/results/llamacpp_speed.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Any

import llama_cpp
import torch

from safe_engine import Ensemble
from safe_engine.bench import _rss_mib, print_json
from safe_engine.runtime.placement import available_cores, cpu_info

MODELS = ["qwen2.5-coder-0.5b", "smollm2-135m"]  # drafter first
TOPICS = ["a lighthouse keeper", "a robot gardener", "a lost violin", "a desert train", "a paper city",
          "a winter market", "a clockmaker's apprentice", "a whale that sings"]  # fmt: skip
N = 256  # new tokens (--tokens)


def chat(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long, detailed story about {topic}."}]


def own_generation(llm: llama_cpp.Llama, ids: list[int], n: int) -> dict[str, Any]:
    llm.reset()  # no prefix reuse between runs: each run decodes the prompt as the engine does
    start = time.perf_counter()
    out = llm.create_completion(ids, max_tokens=n, temperature=0.0, repeat_penalty=1.0)
    wall = time.perf_counter() - start
    tokens = out["usage"]["completion_tokens"]
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "text": out["choices"][0]["text"]}


def engine(ens: Ensemble, n: int, topic: str = TOPICS[0], **options: Any) -> dict[str, Any]:
    result = ens.generate(messages=chat(topic), max_new_tokens=n, **options)
    s = result.stats
    return {"tokens": s.tokens, "wall_s": s.wall_time_s, "tokens_per_s": s.tokens_per_s, "text": result.text,
            "ensembled_tokens": s.ensembled_tokens, "rounds": s.rounds,
            "drafter_passes": s.forward_passes[ens.drafter.name]}  # fmt: skip


def batch(ens: Ensemble, n: int) -> dict[str, Any]:
    start = time.perf_counter()
    results = ens.generate_batch([chat(t) for t in TOPICS], max_new_tokens=n)
    wall = time.perf_counter() - start
    tokens = sum(r.stats.tokens for r in results)
    return {"requests": len(results), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def loaded(backend: str, quantization: str | None = None) -> tuple[Ensemble, float]:
    """The ensemble, and the resident memory its loading and a first short run added (MiB)."""
    before = _rss_mib()
    ens = Ensemble.from_pretrained(MODELS, backend=backend, quantization=quantization)
    ens.generate(messages=chat(TOPICS[0]), max_new_tokens=8)
    return ens, _rss_mib() - before


def long_answer_topic(ens: Ensemble, n: int) -> str:
    """The first topic on which the drafter alone and SAFE both answer with `n` new tokens (else the first)."""
    runs_whole = (t for t in TOPICS if all(engine(ens, n, t, method=m)["tokens"] >= n for m in ("safe", "single")))
    return next(runs_whole, TOPICS[0])


def median(runs: list[dict[str, Any]], key: str = "tokens_per_s") -> float:
    return statistics.median(r[key] for r in runs)


# runtime -> (its drafter-alone row, its SAFE row, its resident-memory entry)
RUNTIMES = {
    "llama.cpp": ("engine single", "engine SAFE", "llama.cpp members"),
    "torch float32": ("torch single", "torch SAFE", "torch float32 members"),
    "torch int8": ("torch int8 single", "torch int8 SAFE", "torch int8 members"),
}


def safe_floor(runs: list[dict[str, Any]]) -> float:
    """SAFE's floor over its runs (median): the answer's tokens over the drafter's forward passes."""
    return statistics.median(r["tokens"] / r["drafter_passes"] for r in runs)


def runtime_table(result: dict[str, Any]) -> str:
    """Markdown: the drafter alone and SAFE per runtime (median tokens/s, the new tokens of the answer), over
    llama-cpp-python's own generation of the drafter's GGUF and SAFE over its own drafter alone, with the
    members' resident memory, and SAFE's floor: its tokens over its drafter's forward passes, the ratio SAFE /
    its drafter alone would reach if verifying cost nothing (a replaced token discards the draft past it, so
    the drafter makes more passes than tokens kept). docs/speed.md holds it as generated from the committed
    JSON (tests/unit/test_speed_docs.py regenerates it)."""
    medians, runs = result["medians_tokens_per_s"], result["runs"]
    own = max(v for k, v in medians.items() if k.startswith("llama-cpp-python"))  # its faster thread count
    lines = [
        f"| {result['cpu']['model_name']} | story about | drafter alone tok/s (tokens) | SAFE tok/s (tokens) "
        "| drafter alone / llama-cpp-python | SAFE / llama-cpp-python | SAFE / its drafter alone | SAFE's floor "
        "| resident MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for runtime, (single, safe, memory) in RUNTIMES.items():
        a, b, mib = medians[single], medians[safe], result["resident_mib"][memory]
        cells = [result["topics"][runtime], f"{a:.1f} ({runs[single][0]['tokens']})"]
        cells.append(f"{b:.1f} ({runs[safe][0]['tokens']})")
        cells += [f"{a / own:.2f}", f"{b / own:.2f}", f"{b / a:.2f}", f"{safe_floor(runs[safe]):.2f}", f"{mib:,.0f}"]
        lines.append(f"| {runtime} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=N)
    p.add_argument("--out")
    args = p.parse_args()
    n_new = args.tokens

    # runtime -> (its ensemble, the resident memory its loading added), in RUNTIMES' order
    ensembles = dict(zip(RUNTIMES, (loaded("auto"), loaded("torch"), loaded("torch", "int8"))))
    (fast, fast_mib), slow_mib = ensembles["llama.cpp"], ensembles["torch float32"][1]
    assert [m.backend for m in fast.members] == ["llama.cpp", "llama.cpp"], "install the llamacpp extra"
    drafter = fast.drafter
    ids = fast.request(messages=chat(TOPICS[0])).encode(drafter)
    counts = sorted({1, available_cores()})
    own = {n: llama_cpp.Llama(str(drafter.gguf), n_ctx=4096, n_threads=n, verbose=False) for n in counts}

    topics = {name: long_answer_topic(ens, n_new) for name, (ens, _) in ensembles.items()}
    rows = [row for single, safe, _ in RUNTIMES.values() for row in (single, safe)]
    names = [*(f"llama-cpp-python {n}t" for n in counts), *rows, "batch of 8"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for _ in range(args.repeats):  # in turns: a machine whose speed drifts moves them all alike
        for n, llm in own.items():
            runs[f"llama-cpp-python {n}t"].append(own_generation(llm, ids, n_new))
        for name, (ens, _) in ensembles.items():
            single, safe, _ = RUNTIMES[name]
            runs[single].append(engine(ens, n_new, topics[name], method="single"))
            runs[safe].append(engine(ens, n_new, topics[name]))
        runs["batch of 8"].append(batch(fast, n_new))

    best_own = max(median(runs[f"llama-cpp-python {n}t"]) for n in counts)
    single, safe, torch_safe = (median(runs[k]) for k in ("engine single", "engine SAFE", "torch SAFE"))
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "cpu": cpu_info(),
        "llama_cpp_python": llama_cpp.__version__,
        "torch_threads": torch.get_num_threads(),
        "placement": {name: e.placement.describe() if e.placement else None for name, (e, _) in ensembles.items()},
        "models": MODELS,
        "max_new_tokens": n_new,
        "topics": topics,
        "repeats": args.repeats,
        "medians_tokens_per_s": {k: median(v) for k, v in runs.items()},
        "ratios": {
            "engine single / llama-cpp-python (its faster thread count)": single / best_own,
            "SAFE llama.cpp / llama-cpp-python drafter alone": safe / best_own,
            "SAFE llama.cpp / SAFE torch float32": safe / torch_safe,
            "batch of 8 / one request (SAFE llama.cpp)": median(runs["batch of 8"]) / safe,
            "resident memory llama.cpp / torch float32": fast_mib / slow_mib,
        },
        "resident_mib": {RUNTIMES[name][2]: mib for name, (_, mib) in ensembles.items()},
        "single equals llama-cpp-python's text": all(
            r["text"] == o["text"] for r, o in zip(runs["engine single"], runs[f"llama-cpp-python {counts[-1]}t"])
        ),
        "runs": runs,
    }
    print_json(result, args.out)
    print(runtime_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
