"""transformers' own greedy `generate` of one member: the baseline behind every speed ratio ("over HF
`generate` of the drafter alone") and the single-model rows of the accuracy study.

Why one function: five copies of it (the benchmarks, `bench`, the study's runner) drifted in how they
padded, counted tokens and stopped; a ratio is only comparable with another when both divide by the same
thing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .members import Member


@dataclass(frozen=True)
class HFRow:
    ids: list[int]  # the new tokens, up to the first EOS (not included)
    tokens: int  # tokens generated, the EOS included (as the engine's stats count them)
    finish: str  # "eos" | "length"


@dataclass(frozen=True)
class HFBatch:
    rows: list[HFRow]
    wall_s: float  # the generate call's wall time
    cpu_s: float  # this process's CPU time during it, all threads


@torch.inference_mode()
def hf_generate(
    member: Member, prompts: Sequence[list[int]], max_new_tokens: int, *, forced: bool = False, **generate: Any
) -> HFBatch:
    """Greedy `generate` over one left-padded batch of token-id prompts. `forced`: exactly `max_new_tokens`
    a row (EOS suppressed), for timing; `generate`: more `generate` keywords (e.g. `stop_strings`)."""
    eos = sorted(member.eos_ids)
    pad = member.tokenizer.pad_token_id if member.tokenizer.pad_token_id is not None else eos[0]
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=member.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=member.device)
    greedy = {"max_new_tokens": max_new_tokens, "do_sample": False, "eos_token_id": eos, "pad_token_id": pad}
    if forced:
        greedy["min_new_tokens"] = max_new_tokens
    start, cpu_start = time.perf_counter(), time.process_time()
    out = member.model.generate(input_ids=ids, attention_mask=mask, **greedy, **generate)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    rows = []
    for row in out[:, width:].tolist():
        ended = next((i for i, t in enumerate(row) if t in member.eos_ids), None)
        if ended is None:
            rows.append(HFRow(row, len(row), "length"))
        else:
            rows.append(HFRow(row[:ended], ended + 1, "eos"))
    return HFBatch(rows, wall, cpu)
