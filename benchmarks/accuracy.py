"""Accuracy of single models vs every-token and SAFE ensembles on the real demo models, resumable.

    python benchmarks/accuracy.py --task gsm8k --limit 100 --out benchmarks/results

Members: Qwen2.5-Coder-0.5B-Instruct (drafter), SmolLM2-135M-Instruct, and with --three gemma-3-270m (a base
model: it joins the chat ensemble through a plain "Question/Answer" chat template). Rerunning the same command
skips finished (configuration, problem) pairs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safe_engine import Ensemble, ModelSpec
from safe_engine.eval import load_task, make_ensemble_config, run_eval, write_report
from safe_engine.members import load_member

PLAIN_CHAT = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}Question: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}Answer: {{ m['content'] }}\n{% endif %}{% endfor %}Answer:"
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="gsm8k")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--three", action="store_true", help="add gemma-3-270m as a third member")
    p.add_argument("--configs", nargs="+", help="subset of configuration names to run")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()

    qwen, smol = load_member("qwen2.5-coder-0.5b"), load_member("smollm2-135m")
    pair = Ensemble([qwen, smol])
    kw = {"max_new_tokens": args.max_new_tokens}
    configs = {
        "qwen alone": make_ensemble_config(Ensemble([qwen]), method="single", **kw),
        "smollm2 alone": make_ensemble_config(Ensemble([smol]), method="single", **kw),
        "UniTE every token": make_ensemble_config(pair, method="every_token", aggregation="unite", **kw),
        "GaC every token": make_ensemble_config(pair, method="every_token", aggregation="gac", **kw),
        "UniTE+SAFE": make_ensemble_config(pair, method="safe", aggregation="unite", **kw),
        "GaC+SAFE": make_ensemble_config(pair, method="safe", aggregation="gac", **kw),
        "UniTE+SAFE sampling": make_ensemble_config(
            pair, method="safe", do_sample=True, temperature=0.7, seed=args.seed, **kw
        ),
    }
    if args.three:
        gemma = load_member(ModelSpec("gemma3-270m", chat_template=PLAIN_CHAT))
        configs["gemma alone"] = make_ensemble_config(Ensemble([gemma]), method="single", **kw)
        configs["UniTE+SAFE (3 models)"] = make_ensemble_config(Ensemble([qwen, smol, gemma]), method="safe", **kw)
    if args.configs:
        configs = {k: v for k, v in configs.items() if k in args.configs}
    problems = load_task(args.task, limit=args.limit)
    out = Path(args.out)
    jsonl = out / f"{args.task}.jsonl"
    run_eval(configs, problems, jsonl)
    write_report(jsonl, out / args.task, title=f"{args.task}: first {len(problems)} problems")


if __name__ == "__main__":
    main()
