"""Where SAFE's time goes on the real demo models: forward passes per member vs. the decoder's own Python.

    python benchmarks/profile_safe.py --tokens 128 --out benchmarks/results/profile_safe

Runs one SAFE generation (Qwen2.5-Coder-0.5B drafts, SmolLM2-135M verifies; the speed benchmark's prompt)
under pyinstrument, and times every member's `score` call (one forward pass) separately. Prints JSON: time
in drafter passes, verifier passes and everything else, passes per kept token, and the drafted tokens thrown
away after ensemble replacements; writes the pyinstrument call tree next to it (OUT.txt).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from pyinstrument import Profiler

from safe_engine import Ensemble
from safe_engine.bench import PROMPT
from safe_engine.runtime.members import Member, load_member


def timed_score(member: Member, spent: dict[str, float]) -> None:
    """Wrap the member's `score` (one forward pass) to add its wall time to spent[member.name]."""
    score = member.score

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return score(*args, **kwargs)
        finally:
            spent[member.name] += time.perf_counter() - start

    member.score = wrapper  # type: ignore[method-assign]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b", "smollm2-135m"], help="drafter first")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--method", default="safe", help="safe | every_token | single")
    p.add_argument("--aggregation", default="unite")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="write OUT.json and OUT.txt (the call tree)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    members = [load_member(m) for m in args.models]
    ens = Ensemble(members)
    ens.generate(PROMPT, max_new_tokens=4)  # warm-up
    spent = {m.name: 0.0 for m in members}
    for m in members:
        timed_score(m, spent)
    profiler = Profiler(interval=0.005)
    with profiler:
        res = ens.generate(PROMPT, max_new_tokens=args.tokens, method=args.method, aggregation=args.aggregation)
    s = res.stats
    drafter, verifiers = members[0].name, [m.name for m in members[1:]]
    wall = s.wall_time_s
    passes = s.forward_passes
    report = {
        "method": args.method,
        "models": ens.names,
        "tokens": s.tokens,
        "rounds": s.rounds,
        "ensemble_rate": s.ensemble_rate,
        "replaced_tokens": s.replaced_tokens,
        "discarded_draft_tokens": s.discarded_draft_tokens,
        "forward_passes": passes,
        "drafter_passes_per_token": passes[drafter] / s.tokens,
        "wall_s": wall,
        "share": {
            "drafter_forward": spent[drafter] / wall,
            "verifier_forward": sum(spent[v] for v in verifiers) / wall,
            "decoder_python": 1 - sum(spent.values()) / wall,
        },
        "s_per_pass": {name: spent[name] / passes[name] for name in spent if passes.get(name)},
        "discarded_share_of_drafter_time": s.discarded_draft_tokens / passes[drafter] * spent[drafter] / wall,
        "threads": torch.get_num_threads(),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(text + "\n")
        out.with_suffix(".txt").write_text(profiler.output_text(unicode=False, color=False, show_all=False))


if __name__ == "__main__":
    main()
