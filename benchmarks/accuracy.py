"""Accuracy of single models vs every-token and SAFE ensembles on the real demo models, resumable.

    python benchmarks/accuracy.py --task gsm8k --limit 100 --out benchmarks/results

Members: Qwen2.5-Coder-0.5B-Instruct (drafter), SmolLM2-135M-Instruct, and with --three gemma-3-270m (a base
model: it joins the chat ensemble through a plain "Question/Answer" chat template). Rerunning the same command
skips finished (configuration, problem) pairs. Single-model rows answer `--batch` problems per transformers
`generate` call (greedy; see make_batched_single_config); ensembles decode one problem at a time.

On a small CPU machine, split the work over processes with one torch thread each (decoding is memory-bound, so
two 1-thread processes do almost twice the work of one 2-thread process), each appending to its own file:
    python benchmarks/accuracy.py --threads 1 --configs "qwen alone" "smollm2 alone" --jsonl a.jsonl
    python benchmarks/accuracy.py --threads 1 --configs UniTE+SAFE --jsonl b.jsonl
and write the report over all of them with `--report-only --jsonl a.jsonl b.jsonl`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from safe_engine import Ensemble, ModelSpec
from safe_engine.eval import (
    load_records,
    load_task,
    make_batched_single_config,
    make_ensemble_config,
    run_eval,
    write_report,
)
from safe_engine.members import load_member

PLAIN_CHAT = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}Question: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}Answer: {{ m['content'] }}\n{% endif %}{% endfor %}Answer:"
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="gsm8k")
    p.add_argument("--limit", type=int, default=100)
    p.add_argument("--start", type=int, default=0, help="skip the first START problems (to split a run)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--three", action="store_true", help="add gemma-3-270m as a third member")
    p.add_argument("--configs", nargs="+", help="subset of configuration names to run")
    p.add_argument("--batch", type=int, default=16, help="problems per generate call for single-model rows")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--out", default="benchmarks/results", help="folder of the report (and default JSONL)")
    p.add_argument("--jsonl", nargs="+", help="results file(s) (default OUT/TASK.jsonl); runs append to the first")
    p.add_argument("--report-only", action="store_true", help="only write the report over the --jsonl files")
    args = p.parse_args()
    out = Path(args.out)
    files = [Path(f) for f in args.jsonl] if args.jsonl else [out / f"{args.task}.jsonl"]
    title = f"{args.task}: first {args.limit} problems"
    if args.report_only:
        merged = out / f"{args.task}.jsonl"
        records = [r for f in files for r in load_records(f)]
        if files != [merged]:
            merged.parent.mkdir(parents=True, exist_ok=True)
            merged.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        write_report(merged, out / args.task, title=title)
        return
    if args.threads:
        torch.set_num_threads(args.threads)

    problems = load_task(args.task, limit=args.start + args.limit)[args.start :]
    qwen, smol = load_member("qwen2.5-coder-0.5b"), load_member("smollm2-135m")
    pair = Ensemble([qwen, smol])
    kw = {"max_new_tokens": args.max_new_tokens}
    configs = {
        "qwen alone": make_batched_single_config(qwen, problems, batch_size=args.batch, **kw),
        "smollm2 alone": make_batched_single_config(smol, problems, batch_size=args.batch, **kw),
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
    run_eval(configs, problems, files[0])
    if not args.jsonl:
        write_report(files[0], out / args.task, title=title)


if __name__ == "__main__":
    main()
