"""How much a batch can gain with llama.cpp members on this CPU: llama.cpp's own ceiling beside the engine's.

Why: issue 45 asks a batch of 8 SAFE requests for 2x one request's throughput. A batch gains only what
llama.cpp's kernels gain when one `llama_decode` carries B sequences instead of one, so this script measures
that ceiling, for the passes SAFE makes (the drafter's one-token steps, a verifier's 5-token passes), beside
the engine's batch of 8 against one request, in one process and one run:

- `decode`: per demo model, B sequences x k tokens in one `forward_many` (one `llama_decode`; the rows
  copied out as the engine reads them), B = 1, 2, 4, 8, k = 1 and 5, after a prompt of 24 tokens each;
  tokens/s and the ratio to B = 1;
- `engine`: SAFE over the llama.cpp pair (default configuration), one chat request alone, then 8 different
  ones with `generate_batch`, N new tokens each.

    .venv/bin/python benchmarks/llamacpp_batching.py --out benchmarks/results/llamacpp_batching.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from safe_engine import Ensemble
from safe_engine.bench import print_json
from safe_engine.runtime.llamacpp import LlamaCppMember
from safe_engine.runtime.members import Job
from safe_engine.runtime.placement import cpu_info

MODELS = ["qwen2.5-coder-0.5b", "smollm2-135m"]  # drafter first
TOPICS = ["a lighthouse keeper", "a robot gardener", "a lost violin", "a desert train", "a paper city",
          "a winter market", "a clockmaker's apprentice", "a whale that sings"]  # fmt: skip
PROMPT = list(range(1000, 1024))  # 24 prompt tokens per sequence


def decode_rate(member: LlamaCppMember, sequences: int, k: int, passes: int) -> float:
    """Tokens/s of `passes` passes of `sequences` x `k` tokens, each sequence cut back to its prompt first
    (the median pass)."""
    caches = [member.new_cache() for _ in range(sequences)]
    member.forward_many([Job(c, 0, PROMPT, 1, None) for c in caches])
    times = []
    for step in range(passes):
        jobs = [Job(c, len(PROMPT), [2000 + step + j for j in range(k)], k, None) for c in caches]
        start = time.perf_counter()
        member.forward_many(jobs)
        times.append(time.perf_counter() - start)
    for c in caches:
        member.release(c)
    return sequences * k / statistics.median(times)


def chat(topic: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long, detailed story about {topic}."}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128, help="new tokens per engine request")
    p.add_argument("--passes", type=int, default=12, help="timed passes per decode shape")
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args()

    ens = Ensemble.from_pretrained(MODELS, backend="llama.cpp")
    decode: dict[str, Any] = {}
    for member in ens.members:
        assert isinstance(member, LlamaCppMember)
        rates = {f"{b}x{k}": decode_rate(member, b, k, args.passes) for k in (1, 5) for b in (1, 2, 4, 8)}
        ratios = {shape: rate / rates[f"1x{shape.split('x')[1]}"] for shape, rate in rates.items()}
        decode[member.name] = {"tokens_per_s": rates, "ratio_to_one_sequence": ratios}

    ens.generate(messages=chat(TOPICS[0]), max_new_tokens=16)  # warm: placement measured, pages read
    one = ens.generate(messages=chat(TOPICS[0]), max_new_tokens=args.tokens)
    start = time.perf_counter()
    batch = ens.generate_batch([chat(t) for t in TOPICS], max_new_tokens=args.tokens)
    wall = time.perf_counter() - start
    batch_rate = sum(r.stats.tokens for r in batch) / wall
    print_json(
        {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "cpu": cpu_info(),
            "torch_threads": torch.get_num_threads(),
            "placement": ens.placement.describe() if ens.placement else None,
            "decode": decode,
            "engine": {
                "one_request_tokens_per_s": one.stats.tokens_per_s,
                "batch_of_8_tokens_per_s": batch_rate,
                "batch_of_8_over_one": batch_rate / one.stats.tokens_per_s,
                "tokens": [r.stats.tokens for r in batch],
            },
        },
        args.out,
    )


if __name__ == "__main__":
    main()
