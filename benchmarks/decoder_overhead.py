"""The decoder's own costs per round, old way and new way side by side in one run (no model forward).

    python benchmarks/decoder_overhead.py --out benchmarks/results/decoder_overhead.json

1. Re-tokenization: a verifier re-encodes the generated text every round. Encoding all of it costs time
   linear in the output length (so a whole generation is quadratic); encoding only after the frozen prefix
   (alignment.Verification) stays flat. Timed at 2, 8 and 32 KB of generated text for each tokenizer.
2. Next-token rows: turning a 152k-vocabulary logits row into log-probabilities with top-p < 1. A full sort
   (the old way) against the top-1024 probe (rows.next_token_logprobs), and the lazy rows of a verification
   pass that reads 2 of its 6 rows (the old way normalised all 6 on the CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from safe_engine.algorithm.alignment import FREEZE_MARGIN
from safe_engine.bench import print_json
from safe_engine.runtime.rows import LocalRow, next_token_logprobs
from safe_engine.runtime.vocab import Vocab

SHARED = Path(os.environ.get("SAFE_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared")) / "tokenizers"
FAMILIES = ("qwen2.5-7b-instruct", "llama2", "gpt2")
SAMPLE = (
    "The bicycle's frame holds everything together: the wheels turn on hubs, the chain carries the force of "
    "your legs from the pedals to the rear wheel, and the gears change how far one turn of the pedals moves "
    "you. Brakes squeeze the rim or a disc. Riding keeps you balanced because steering into a fall moves the "
    "wheels back under you.\n\n"
)


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def retokenization(sizes_kb: tuple[int, ...], repeats: int) -> list[dict]:
    out = []
    for family in FAMILIES:
        vocab = Vocab(AutoTokenizer.from_pretrained(SHARED / family))
        for kb in sizes_kb:
            text = (SAMPLE * (kb * 1024 // len(SAMPLE) + 1))[: kb * 1024].encode()
            ids, starts = vocab.encode(text)
            frozen = starts[-(FREEZE_MARGIN + 40)]  # a frozen prefix ends a few words before the text does
            tail = text[frozen:]
            whole_s = timed(lambda: vocab.encode(text), repeats)  # noqa: B023
            tail_s = timed(lambda: vocab.encode(tail), repeats)  # noqa: B023
            out.append(
                {
                    "tokenizer": family,
                    "text_kb": kb,
                    "tokens": len(ids),
                    "whole_text_ms": whole_s * 1e3,
                    "after_frozen_prefix_ms": tail_s * 1e3,
                    "tail_bytes": len(tail),
                    "speedup": whole_s / tail_s,
                }
            )
    return out


def old_top_p(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The engine's former top-p: a full-vocabulary sort on the CPU."""
    logprobs = torch.log_softmax(logits.cpu() / temperature, dim=-1)
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
    outside = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp() >= top_p
    logprobs = logprobs.scatter(-1, order, sorted_lp.masked_fill(outside, float("-inf")))
    return torch.log_softmax(logprobs, dim=-1)


def rows(vocab_size: int, repeats: int) -> dict:
    torch.manual_seed(0)
    logits = torch.randn(6, vocab_size) * 3  # six rows of one verification pass
    sort_s = timed(lambda: old_top_p(logits[0], 0.7, 0.9), repeats)
    probe_s = timed(lambda: next_token_logprobs(logits[0], True, 0.7, 0.9), repeats)
    same = torch.equal(
        torch.isfinite(old_top_p(logits[0], 0.7, 0.9)), torch.isfinite(next_token_logprobs(logits[0], True, 0.7, 0.9))
    )

    def read(made: list) -> None:
        for row in made[:2]:  # the scan reads a couple of rows before it stops
            row.logprob([1, 2, 3])
            row.top(10)

    def eager_pass():  # the old way: every row copied to the CPU and normalised there
        values = torch.log_softmax(logits.cpu(), dim=-1)
        made = [LocalRow(row) for row in values]
        for row in made:
            row._values, row._logits = row._logits, None
        read(made)

    def lazy_pass():
        read([LocalRow(row) for row in logits])

    return {
        "vocab_size": vocab_size,
        "top_p_full_sort_ms": sort_s * 1e3,
        "top_p_probe_ms": probe_s * 1e3,
        "top_p_speedup": sort_s / probe_s,
        "top_p_same_kept_set": same,
        "verification_rows_eager_ms": timed(eager_pass, repeats) * 1e3,
        "verification_rows_lazy_2_of_6_ms": timed(lazy_pass, repeats) * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-kb", type=int, nargs="+", default=[2, 8, 32])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    result = {
        "retokenization": retokenization(tuple(args.sizes_kb), args.repeats),
        "rows": rows(151_936, args.repeats),
    }
    print_json(result, args.out)


if __name__ == "__main__":
    main()
