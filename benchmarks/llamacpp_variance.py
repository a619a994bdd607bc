"""What batch variance does to SAFE with llama.cpp members, measured on the demo models.

Why: llama.cpp's quantized kernels are not batch-invariant. A drafter drafts its k tokens one at a time and
a verifier scores them in one k-token pass, so the two read slightly different logits for the same text, and
a request's rows change with the other requests that share its `llama_decode`. This script says by how
much, what stays exact, and what it does to an ensemble of two copies of one model.

For each demo model (llama.cpp, GGUF as shipped), the texts are the model's own greedy answers to the
first GSM8K questions of ../shared/data (chat template; gemma3-270m has none and gets "Question: ...\nAnswer:"),
drafted as SAFE drafts them: per round, k = 5 one-token steps from the cached prefix (greedy, each step's
argmax is the next token), then the same k tokens after rolling the cache back to the prefix:
1. as one k-token pass with rows at all k positions (one-token steps vs k-token pass);
2. as that pass inside one `forward_many` with 4 other requests' k-token passes (alone vs batched);
3. as the same pass once more after another rollback (re-decoding: should be bit-identical).
Each comparison gives the largest |logit difference|, the mean |difference| over all logits, and how many
positions' argmax differ. Then two copies of one GGUF are ensembled greedily (method="safe") and compared
with method="single" of the same ensemble and with llama-cpp-python's own greedy decode (`Llama.eval`, then
the argmax of its logits) of the same prompt ids.

    .venv/bin/python benchmarks/llamacpp_variance.py   # writes benchmarks/results/llamacpp_variance.json

The defaults (8 texts x 40 positions per model, 1 llama.cpp thread) took 10 minutes on a 2-core VM that another
process kept busy (two threads there spin against it and run several times slower); --texts and
--tokens-per-text measure more positions, --threads sets llama.cpp's threads.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from safe_engine import Ensemble
from safe_engine.bench import print_json
from safe_engine.runtime.llamacpp import LlamaCppMember, load_llamacpp_member
from safe_engine.runtime.members import Job, ModelSpec, crop_cache
from safe_engine.runtime.placement import cpu_info
from safe_engine.shaping.chat import chat_prompt_ids

MODELS = ("qwen2.5-coder-0.5b", "smollm2-135m", "gemma3-270m")
K = 5  # the default draft length
OTHERS = 4  # other requests in the batched pass
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k_test.jsonl"
ROOT = Path(__file__).resolve().parents[1]


def questions(n: int, skip: int = 0) -> list[str]:
    lines = DATA.read_text().splitlines()[skip : skip + n]
    return [json.loads(line)["question"] for line in lines]


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def prompt_ids(member: LlamaCppMember, question: str) -> list[int]:
    """The question in the member's chat template; a base model (gemma3-270m has no template) gets it raw."""
    if member.chat_template:
        return chat_prompt_ids(member, chat(question))
    return member.prompt_ids(f"Question: {question}\nAnswer:")


class Diff:
    """|a - b| over rows of logits: the largest, the mean over every logit, and argmax disagreements."""

    def __init__(self) -> None:
        self.positions = self.argmax_differs = 0
        self.max_abs = self.sum_abs = 0.0
        self.logits = 0

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        d = (a - b).abs()
        self.max_abs = max(self.max_abs, float(d.max()))
        self.sum_abs += float(d.double().sum())
        self.logits += d.numel()
        self.positions += a.shape[0]
        self.argmax_differs += int((a.argmax(-1) != b.argmax(-1)).sum())

    def to_dict(self) -> dict[str, Any]:
        return {
            "positions": self.positions,
            "max_abs": self.max_abs,
            "mean_abs": self.sum_abs / max(self.logits, 1),
            "argmax_differs": self.argmax_differs,
        }


def measure(member: LlamaCppMember, prompts: list[str], others: list[str], tokens_per_text: int) -> dict:
    """Comparisons 1-3 over the member's own greedy answers to `prompts` (see the module docstring)."""
    steps_vs_pass, alone_vs_batched, redecode = Diff(), Diff(), Diff()
    other_jobs = []
    for text in others:  # each re-decodes its prompt's last K tokens in every batched pass
        ids = prompt_ids(member, text)
        cache = member.new_cache()
        member.forward(ids, cache, 1)
        other_jobs.append(Job(cache, len(ids) - K, ids[-K:], K, None))
    for text in prompts:
        cache = member.new_cache()
        prompt = prompt_ids(member, text)
        token = int(member.forward(prompt, cache, 1)[0].argmax())
        pos, done = len(prompt), False
        while not done and pos - len(prompt) < tokens_per_text:
            ids, rows = [], []
            for _ in range(K):  # the drafter: one-token steps
                ids.append(token)
                rows.append(member.forward([token], cache, 1)[0])
                token = int(rows[-1].argmax())
                if ids[-1] in member.eos_ids:
                    done = True
                    break
            steps = torch.stack(rows)
            crop_cache(cache, pos)
            batched = member.forward_many([Job(cache, pos, ids, len(ids), None), *other_jobs])[0]
            crop_cache(cache, pos)
            one_pass = member.forward(ids, cache, len(ids))
            crop_cache(cache, pos)
            again = member.forward(ids, cache, len(ids))  # the cache goes on from this pass, as a verifier's
            steps_vs_pass.add(steps, one_pass)
            alone_vs_batched.add(one_pass, batched)
            redecode.add(one_pass, again)
            pos += len(ids)
        member.release(cache)
    for job in other_jobs:
        member.release(job.cache)
    return {
        "steps_vs_pass": steps_vs_pass.to_dict(),
        "alone_vs_batched": alone_vs_batched.to_dict(),
        "redecode": redecode.to_dict(),
    }


def llama_greedy(llm: Any, prompt: list[int], eos: frozenset[int], max_new_tokens: int) -> list[int]:
    """llama-cpp-python's own greedy decode: `Llama.eval`, then the argmax of its last row."""
    llm.reset()
    llm.eval(prompt)
    out: list[int] = []
    while len(out) < max_new_tokens:
        row = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
        token = int(row.argmax())
        if token in eos:
            break
        out.append(token)
        llm.eval([token])
    return out


def two_copies(name: str, prompts: list[str], max_new_tokens: int) -> dict:
    """Two copies of one GGUF ensembled greedily, against `method="single"` and llama-cpp-python's greedy."""
    from llama_cpp import Llama

    ens = Ensemble.from_pretrained([name, name], backend="llama.cpp")
    drafter = ens.members[0]
    threads = torch.get_num_threads()
    llm = Llama(
        str(drafter.gguf), n_ctx=4096, n_threads=threads, n_threads_batch=threads, flash_attn=False, verbose=False
    )
    rows = []
    for text in prompts:
        t0 = time.perf_counter()
        safe = ens.generate(messages=chat(text), max_new_tokens=max_new_tokens)
        single = ens.generate(messages=chat(text), max_new_tokens=max_new_tokens, method="single")
        own = llama_greedy(llm, chat_prompt_ids(drafter, chat(text)), drafter.eos_ids, max_new_tokens)
        llama_text = b"".join(drafter.token_bytes[t] or b"" for t in own).decode("utf-8", errors="replace")
        rows.append(
            {
                "tokens": safe.stats.tokens,
                "ensembled_tokens": safe.stats.ensembled_tokens,
                "replaced_tokens": safe.stats.replaced_tokens,
                "finish": [safe.finish_reason, single.finish_reason],
                "safe_equals_single": safe.text == single.text,
                "single_equals_llama_cpp_python": single.text == llama_text,
                "wall_s": time.perf_counter() - t0,
            }
        )
    return {
        "prompts": len(rows),
        "tokens": sum(r["tokens"] for r in rows),
        "ensembled_tokens": sum(r["ensembled_tokens"] for r in rows),
        "replaced_tokens": sum(r["replaced_tokens"] for r in rows),
        "safe_equals_single": sum(r["safe_equals_single"] for r in rows),
        "single_equals_llama_cpp_python": sum(r["single_equals_llama_cpp_python"] for r in rows),
        "per_prompt": rows,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--texts", type=int, default=8, help="greedy answers per model")
    p.add_argument("--tokens-per-text", type=int, default=40)
    p.add_argument("--copies-prompts", type=int, default=10, help="prompts for smollm2-135m x2")
    p.add_argument("--copies-prompts-qwen", type=int, default=2, help="prompts for qwen2.5-coder-0.5b x2")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads (members use torch's count)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "llamacpp_variance.json"))
    args = p.parse_args()
    import llama_cpp

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    # at the start: the tree may move during a run of the better part of an hour
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    prompts, others = questions(args.texts), questions(OTHERS, skip=args.texts)
    models = {}
    for name in MODELS:
        t0 = time.perf_counter()
        member = load_llamacpp_member(ModelSpec(name))
        models[name] = measure(member, prompts, others, args.tokens_per_text) | {"wall_s": time.perf_counter() - t0}
        print(json.dumps({name: models[name]}), file=sys.stderr, flush=True)
        del member
    copies_prompts = questions(args.copies_prompts, skip=100)
    copies = {"smollm2-135m x2": two_copies("smollm2-135m", copies_prompts, args.max_new_tokens)}
    if args.copies_prompts_qwen:
        qwen = two_copies("qwen2.5-coder-0.5b", copies_prompts[: args.copies_prompts_qwen], args.max_new_tokens)
        copies["qwen2.5-coder-0.5b x2"] = qwen
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_info()["model_name"],
        "threads": torch.get_num_threads(),
        "llama_cpp_python": llama_cpp.__version__,
        "commit": commit,
        "k": K,
        "other_requests_in_batch": OTHERS,
        "texts": (
            f"each model's greedy answers (<= {args.tokens_per_text} tokens) to GSM8K test questions 0-"
            f"{args.texts - 1} (chat template; gemma3-270m has none: 'Question: ...\\nAnswer:'); the batch's "
            f"other requests: questions {args.texts}-{args.texts + OTHERS - 1}; two copies: questions 100-"
            f"{99 + args.copies_prompts}"
        ),
        "models": models,
        "two_copies": copies,
        "wall_s": time.perf_counter() - started,
    }
    print_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
