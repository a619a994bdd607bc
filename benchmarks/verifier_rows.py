"""What a verifier would save by computing logits only at the positions a round can read, measured before
building it.

A verification pass keeps a row of logits after every verifier token from the first new one to the end of the
draft. With the boundary gate (the default) the scan reads a verifier's row only where every tokenizer starts
a token and the drafter drafted one; the rest (non-shared boundaries, the row after the draft's end) are
computed and never read. Two measurements, one process:

1. Each member's own output layer (its real weights) applied to 1..10 rows, at one thread and at all cores:
   what a row more or less costs, by shape (torch's CPU kernels change regime past 3 rows).
2. SAFE runs of the demo pair and of the three members (torch float32, greedy, engine defaults, the
   raw prompt of `benchmarks/speed.py`: gemma-3-270m has no chat template), the scan
   watched: per verification pass, the rows computed and the rows a scan could read.

The bound: Σ over passes of cost(rows computed) − cost(rows readable), with the all-cores table, over the
run's wall time. It is an upper bound on the gain (the whole output layer is charged; the rest of the pass
is the same whichever rows are kept).

    .venv/bin/python benchmarks/verifier_rows.py --out benchmarks/results/verifier_rows.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from safe_engine import Ensemble
from safe_engine.algorithm import scan as scan_module
from safe_engine.bench import PROMPT, print_json
from safe_engine.runtime.placement import available_cores, cpu_info

PAIR = ["qwen2.5-coder-0.5b", "smollm2-135m"]
THREE = [*PAIR, "gemma3-270m"]
MAX_ROWS = 10


def output_layer_ms(head: torch.nn.Linear, threads: int, repeats: int) -> dict[int, float]:
    """Median milliseconds of `head` over 0..MAX_ROWS rows at `threads` threads (0 rows: not run)."""
    torch.set_num_threads(threads)
    hidden = head.weight.shape[1]
    out = {0: 0.0}
    with torch.inference_mode():
        for rows in range(1, MAX_ROWS + 1):
            h = torch.randn(1, rows, hidden)
            head(h)  # warm
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                head(h)
                times.append(time.perf_counter() - start)
            out[rows] = round(statistics.median(times) * 1000, 2)
    return out


def watched_run(ens: Ensemble, tokens: int) -> tuple[list[tuple[str, int, int]], Any]:
    """A SAFE generation with each verification pass recorded as (member, rows computed, rows readable)."""
    passes: list[tuple[str, int, int]] = []
    scan = scan_module.Scanner.scan

    def watching(self: Any, rnd: Any, start: int, stats: Any) -> Any:
        drafted, offset = set(), start
        for piece in rnd.draft.pieces[: rnd.seen]:
            drafted.add(offset)
            offset += len(piece)
        readable = drafted.intersection(*(c.at for c in rnd.checks))
        for c in rnd.checks:
            passes.append((c.track.member.name, len(c.rows), len({c.at[o][0] for o in readable})))
        return scan(self, rnd, start, stats)

    scan_module.Scanner.scan = watching
    try:
        result = ens.generate(PROMPT, max_new_tokens=tokens)
    finally:
        scan_module.Scanner.scan = scan
    return passes, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cores = available_cores()
    report: dict[str, Any] = {"cpu": cpu_info(), "torch_threads_default": torch.get_num_threads(), "runs": []}
    report["cpu"].pop("flags")
    ens3 = Ensemble.from_pretrained(THREE, backend="torch")
    layers: dict[str, dict[str, dict[int, float]]] = {}
    for member in ens3.members:
        head = member.model.get_output_embeddings()
        layers[member.name] = {
            "1 thread": output_layer_ms(head, 1, args.repeats),
            f"{cores} threads": output_layer_ms(head, cores, args.repeats),
        }
    torch.set_num_threads(report["torch_threads_default"])
    report["output_layer_ms"] = layers
    for names in (PAIR, THREE):
        ens = Ensemble(ens3.members[: len(names)])
        passes, result = watched_run(ens, args.tokens)
        by_member: dict[str, dict[str, int]] = defaultdict(
            lambda: dict.fromkeys(("passes", "rows", "readable", "most_rows"), 0)
        )
        saved_ms = 0.0
        for name, rows, readable in passes:
            m = by_member[name]
            m["passes"] += 1
            m["rows"] += rows
            m["readable"] += readable
            m["most_rows"] = max(m["most_rows"], rows)  # rows past MAX_ROWS are charged as MAX_ROWS
            table = layers[name][f"{cores} threads"]
            saved_ms += table[min(rows, MAX_ROWS)] - table[min(readable, MAX_ROWS)]
        wall = result.stats.wall_time_s
        report["runs"].append({
            "members": names, "tokens": result.stats.tokens, "rounds": result.stats.rounds, "wall_s": round(wall, 2),
            "verification_passes": dict(by_member), "output_layer_bound_s": round(saved_ms / 1000, 3),
            "bound_share_of_wall": round(saved_ms / 1000 / wall, 4),
        })  # fmt: skip
    print_json(report, args.out)


if __name__ == "__main__":
    main()
