"""SAFE before and after a change of the engine, side by side in one run, on the real demo models.

    git worktree add /tmp/before <commit>          # the engine to compare against
    python benchmarks/fidelity.py --before /tmp/before --out benchmarks/results/fidelity.json

Each engine runs in its own process (`PYTHONPATH` = its checkout), one after the other, on the same prompts:
the demo's chat question (96 new tokens, as `make demo`) and the speed benchmark's prompt (256 new tokens),
with Qwen2.5-Coder-0.5B drafting and SmolLM2-135M verifying, greedy, UniTE and GaC. Printed per run: E/T,
replacements (and how many fell on the last drafted position of a round), drafter passes per kept token,
tokens/s, and the text, so what changed in the output can be read off the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

DEMO = "Explain in two sentences why the sky is blue."
RUNS = (("demo", 96), ("speed", 256))


def worker(threads: int) -> None:
    """Runs inside the engine under test (imported from PYTHONPATH); prints one JSON line per run."""
    import torch

    torch.set_num_threads(threads)
    from safe_engine import Ensemble
    from safe_engine.bench import PROMPT

    try:  # where the decoding loop lives: algorithm/ since the layers; safe_engine/ in older engines
        from safe_engine.algorithm import decoding
    except ImportError:
        from safe_engine import decoding  # type: ignore[attr-defined,no-redef]
    from safe_engine.runtime.members import load_member

    last_position = {"n": 0}
    try:  # the scan of a round is `Scanner.scan(round, ...)`; older engines: `Generation._scan_phase(draft, ...)`
        from safe_engine.algorithm.scan import Scanner

        owner, scan_name = Scanner, "scan"
    except ImportError:
        owner = decoding.Generation
        scan_name = "_scan_phase" if hasattr(decoding.Generation, "_scan_phase") else "_scan"
    scan = getattr(owner, scan_name)

    def counting_scan(self, first, *args):
        draft = getattr(first, "draft", first)  # a Round carries its draft
        kept, replacement = scan(self, first, *args)
        last_position["n"] += replacement is not None and kept == len(draft) - 1
        return kept, replacement

    setattr(owner, scan_name, counting_scan)
    ens = Ensemble([load_member("qwen2.5-coder-0.5b"), load_member("smollm2-135m")])
    ens.generate(PROMPT, max_new_tokens=2)  # warm-up
    for aggregation in ("unite", "gac"):
        for run, n in RUNS:
            last_position["n"] = 0
            if run == "demo":
                res = ens.generate(
                    messages=[{"role": "user", "content": DEMO}], max_new_tokens=n, aggregation=aggregation
                )
            else:
                res = ens.generate(PROMPT, max_new_tokens=n, aggregation=aggregation)
            s = res.stats
            drafter_passes = s.forward_passes[ens.names[0]]
            print(
                json.dumps(
                    {
                        "aggregation": aggregation,
                        "run": run,
                        "max_new_tokens": n,
                        "tokens": s.tokens,
                        "ensembled_tokens": s.ensembled_tokens,
                        "ensemble_rate": s.ensemble_rate,
                        "replaced_tokens": s.replaced_tokens,
                        "replaced_at_last_drafted_position": last_position["n"],
                        "discarded_draft_tokens": s.discarded_draft_tokens,
                        "deferred_positions": getattr(s, "deferred_positions", None),
                        "rounds": s.rounds,
                        "drafter_passes": drafter_passes,
                        "drafter_passes_per_token": drafter_passes / max(s.tokens, 1),
                        "verifier_passes": s.forward_passes[ens.names[1]],
                        "tokens_per_s": s.tokens_per_s,
                        "wall_s": s.wall_time_s,
                        "finish_reason": res.finish_reason,
                        "text": res.text,
                    },
                    ensure_ascii=False,
                ),
                flush=True,
            )


def run_engine(checkout: Path, threads: int) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import fidelity; fidelity.worker({threads})"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=checkout, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"engine at {checkout} failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="checkout of the engine to compare against")
    p.add_argument("--after", default=str(Path(__file__).resolve().parents[1]), help="default: this checkout")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="write the JSON here too")
    args = p.parse_args()
    result = {
        "before": run_engine(Path(args.before), args.threads),
        "after": run_engine(Path(args.after), args.threads),
    }
    for before, after in zip(result["before"], result["after"]):
        after["text_equal_to_before"] = before["text"] == after["text"]
        common = 0
        while common < min(len(before["text"]), len(after["text"])) and before["text"][common] == after["text"][common]:
            common += 1
        after["first_difference_at_char"] = None if after["text_equal_to_before"] else common
    from safe_engine.bench import print_json  # only now: the runs above import each checkout's own engine

    print_json(result, args.out)


if __name__ == "__main__":
    main()
