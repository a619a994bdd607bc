"""`make demo`'s speed against its drafter alone, both as a user gets them: fresh processes, torch's default
threads, engine defaults.

Each pair runs the demo's own command (`safe-engine generate --chat`, as the Makefile has it, with --json for
the stats) and then transformers' greedy `generate` of the drafter alone on the same chat prompt, forced to
the same number of new tokens as the demo's answer, each in a process of its own. Both times include what a
fresh process pays on its first forwards; model loading is outside both. The ratio of each pair is the
demo's tokens/s over the drafter's; the JSON reports every pair and their median.

    python benchmarks/demo_speed.py --pairs 3 --out benchmarks/results/demo_speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from safe_engine.bench import print_json
from safe_engine.runtime.placement import available_cores

DRAFTER, VERIFIER = "qwen2.5-coder-0.5b", "smollm2-135m"
PROMPT = "Explain in two sentences why the sky is blue."
MAX_NEW_TOKENS = 96

HF_ALONE = """
import json, sys, torch
from safe_engine.runtime.baseline import hf_generate
from safe_engine.runtime.members import load_member
from safe_engine.shaping.chat import chat_prompt_ids
member = load_member(sys.argv[1])
n = int(sys.argv[3])
wall = hf_generate(member, [chat_prompt_ids(member, [{"role": "user", "content": sys.argv[2]}])], n, forced=True).wall_s
print(json.dumps({"tokens": n, "wall_s": wall, "tokens_per_s": n / wall, "torch_threads": torch.get_num_threads()}))
"""


def run_demo() -> dict:
    """The demo's command in a fresh process: its reply's stats."""
    cli = [sys.executable, "-m", "safe_engine", "generate", "--chat", "--json", "-m", DRAFTER, "-m", VERIFIER]
    out = subprocess.run([*cli, "--max-new-tokens", str(MAX_NEW_TOKENS), PROMPT], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the demo failed: {out.stderr[-2000:]}")
    reply = json.loads(out.stdout.strip().splitlines()[-1])
    stats = reply["stats"]
    return {"tokens": stats["tokens"], "wall_s": stats["wall_time_s"], "tokens_per_s": stats["tokens_per_s"],
            "rounds": stats["rounds"], "forward_passes": stats["forward_passes"], "text": reply["text"]}  # fmt: skip


def run_drafter_alone(tokens: int) -> dict:
    """transformers' greedy generate of the drafter, same prompt, `tokens` new tokens, in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", HF_ALONE, DRAFTER, PROMPT, str(tokens)], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"the drafter alone failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--out", help="write the JSON here as well as to stdout")
    args = p.parse_args()
    env_threads = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ}
    pairs = []
    for i in range(args.pairs):
        demo = run_demo()
        alone = run_drafter_alone(demo["tokens"])
        pairs.append({"demo": demo, "drafter_alone": alone, "ratio": demo["tokens_per_s"] / alone["tokens_per_s"]})
        print(json.dumps({"pair": i, "ratio": round(pairs[-1]["ratio"], 3)}), file=sys.stderr, flush=True)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cores": available_cores(),
        "thread_environment": env_threads or "none (torch's default)",
        "command": f"safe-engine generate --chat -m {DRAFTER} -m {VERIFIER} --max-new-tokens {MAX_NEW_TOKENS}",
        "pairs": pairs,
        "median_ratio": statistics.median(p["ratio"] for p in pairs),
    }
    print_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
