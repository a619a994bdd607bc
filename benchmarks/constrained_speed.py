"""What a grammar costs end to end: tokens/s of constrained vs free generation, side by side in one run.

    python benchmarks/constrained_speed.py --threads 1 --out benchmarks/results/constrained_speed.json

Qwen2.5-Coder-0.5B drafting, SmolLM2-135M verifying (`single` and SAFE), greedy, the same chat request: free
text, a JSON schema (`json_schema=`), and a required tool call (`tools=` + `tool_choice="required"`). Each pair
is run back to back `--repeats` times; the ratio is constrained / free tokens/s of the same repeat. Output
texts differ (that is the point of a constraint), so the ratio mixes the mask's cost with different
E/T; both are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from safe_engine import Ensemble
from safe_engine.bench import print_json
from safe_engine.runtime.members import load_member

QUESTION = "Describe a cat called Tom who is 3 years old: give its name, age and two hobbies."
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "hobbies"],
}
TOOL = {
    "type": "function",
    "function": {
        "name": "save_cat",
        "description": "Save a cat's record.",
        "parameters": SCHEMA,
    },
}
REQUESTS = {
    "free": {},
    "json_schema": {"json_schema": SCHEMA},
    "tool_call": {"tools": [TOOL], "tool_choice": "required"},
}


def run(ens: Ensemble, method: str, request: dict, max_new_tokens: int) -> dict:
    res = ens.generate(
        messages=[{"role": "user", "content": QUESTION}], method=method, max_new_tokens=max_new_tokens, **request
    )
    s = res.stats
    return {
        "tokens": s.tokens,
        "tokens_per_s": s.tokens_per_s,
        "ensemble_rate": s.ensemble_rate,
        "finish_reason": res.finish_reason,
        "valid": _valid(res, request),
        "text": res.text,
    }


def _valid(res, request: dict) -> bool | None:
    """Whether the output parses and validates against the schema (None for free text)."""
    import jsonschema  # a test dependency of the package

    try:
        if "json_schema" in request:
            jsonschema.validate(json.loads(res.text), SCHEMA)
            return True
        if "tools" in request:
            for call in res.tool_calls or []:
                jsonschema.validate(call["arguments"], SCHEMA)
            return bool(res.tool_calls) and not res.invalid_tool_calls
    except (ValueError, jsonschema.ValidationError):
        return False
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    ens = Ensemble([load_member("qwen2.5-coder-0.5b"), load_member("smollm2-135m")])
    ens.generate("warm up", max_new_tokens=2)
    result: dict = {"threads": args.threads, "max_new_tokens": args.max_new_tokens, "runs": {}}
    for method in ("single", "safe"):
        rows: dict = {name: [] for name in REQUESTS}
        for _ in range(args.repeats):
            for name, request in REQUESTS.items():
                rows[name].append(run(ens, method, request, args.max_new_tokens))
        ratios = {
            name: statistics.median(
                r["tokens_per_s"] / f["tokens_per_s"] for r, f in zip(rows[name], rows["free"], strict=True)
            )
            for name in REQUESTS
            if name != "free"
        }
        result["runs"][method] = {"rows": rows, "constrained_vs_free_tokens_per_s": ratios}
        print(json.dumps({method: ratios}), flush=True)
    print_json(result, args.out)


if __name__ == "__main__":
    main()
