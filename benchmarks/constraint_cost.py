"""Per-step token-mask cost of llguidance and xgrammar, side by side in one run (issue 16).

    python benchmarks/constraint_cost.py --out benchmarks/results/constraint_cost.json

What a constrained decoder pays per drafted token: compute the allowed-token mask for the next position,
then consume the chosen token. Fed here with a valid JSON document for a nested schema (objects, an enum,
arrays, an anyOf-null field, a long free-text string), token by token in the drafter's own tokenization:
~200 steps on Qwen2.5's 152k vocabulary, more on Llama-2's 32k. Both libraries get the same vocabulary,
spelled as the decoder spells it (`safe_engine.runtime.vocab.Vocab.token_bytes`), and the same JSON schema with
flexible whitespace. Reported per library and tokenizer:

- `tokenizer_ms`: building the library's per-vocabulary object (once per drafter, cached);
- `compile_ms`: compiling the schema against it (once per schema and vocabulary, cached);
- `matcher_ms`: a new per-request matcher from the compiled grammar;
- `mask_us`: mask computation per step (median, p90, mean, max), for a first request (cold lexer / caches)
  and later requests over the same compiled grammar (warm), and `mask_ms_per_document`: a warm request's
  mask time summed over all its steps (the median over 5 requests: robust to the shared machine's stalls);
- `consume_us`: consuming one token.

Then the chosen library through `safe_engine.shaping.constrained` as the decoder will call it (`engine` rows):
a step is `Constraint.mask_logits` on a float32 logits row of the model's width (152,064 for Qwen2.5) +
`consume`; `masked_fill_us` is the naive way to apply the same mask (a boolean `masked_fill`), for
comparison. Also a tool-call grammar (tool_choice="auto": free text, then a call), and `mask_distribution`
at an ensemble point: UniTE-sized candidate lists and GaC's whole union vocabulary (Qwen2.5 ∪ Llama-2).

Everything runs single-threaded in this process (xgrammar's compiler gets the machine's 2 cores). xgrammar
is optional here (`pip install --no-deps xgrammar apache-tvm-ffi`: its wheel requires triton, which the
CPU build of torch does not need); without it its rows say "skipped".
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path

import llguidance
import torch
from transformers import AutoTokenizer

from safe_engine.runtime.vocab import Vocab

SHARED = Path(os.environ.get("SAFE_SHARED_DIR", Path(__file__).resolve().parents[2] / "shared")) / "tokenizers"
FAMILIES = ("qwen2.5-7b-instruct", "llama2")
WARM_REQUESTS = 5  # later requests over the same compiled grammar, pooled

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city"],
        },
        "tags": {"type": "array", "items": {"type": "string"}},
        "scores": {"type": "array", "items": {"type": "number"}},
        "active": {"type": "boolean"},
        "bio": {"type": "string"},
    },
    "required": ["name", "age", "role", "address", "tags", "active", "bio"],
}
DOCUMENT = {
    "name": "Zoë Ångström",
    "age": 37,
    "email": None,
    "role": "editor",
    "address": {"street": "12 Rue de la Paix", "city": "Paris", "zip": "75002"},
    "tags": ["typography", "bicycles", "日本語", "open source"],
    "scores": [9.5, 7.25, -3, 1e3],
    "active": True,
    "bio": (
        "Zoë edits the weekly newsletter and maintains the style guide. Before that she repaired bicycles "
        "in Lyon for six years, which is why every second example in the guide is about gears, chains and "
        'brakes. She answers e-mail on Fridays, writes "no" more often than "yes", and keeps a list of '
        "words she refuses to print. Ask her about kerning only if you have an afternoon to spare."
    ),
}


def vocab_of(family: str) -> tuple[Vocab, list[int], int]:
    tokenizer = AutoTokenizer.from_pretrained(SHARED / family)
    vocab = Vocab(tokenizer)
    eos = sorted({tokenizer.eos_token_id} | ({tokenizer.convert_tokens_to_ids("<|endoftext|>")} - {None}))
    eos = [i for i in eos if i is not None and i < vocab.size and vocab.token_bytes[i] is None]
    return vocab, eos, vocab.size


def stats_us(samples_ns: list[int]) -> dict:
    us = sorted(s / 1000 for s in samples_ns)
    return {
        "median": round(statistics.median(us), 1),
        "p90": round(us[int(0.9 * (len(us) - 1))], 1),
        "mean": round(statistics.fmean(us), 1),
        "max": round(us[-1], 1),
    }


def per_document_ms(requests: list[list[int]]) -> float:
    """All the mask time of one request (the whole document), the median over the warm requests."""
    return round(statistics.median(sum(masks) for masks in requests) / 1e6, 3)


# -- llguidance -------------------------------------------------------------------------------------------
class _Wrapper:
    """The decoder's byte spelling of every id, as llguidance's TokenizerWrapper reads it."""

    def __init__(self, vocab: Vocab, eos: list[int]) -> None:
        self.vocab = vocab
        self.eos_token_id = eos[0]
        self.bos_token_id = None
        pieces = vocab.tokenizer.convert_ids_to_tokens(list(range(vocab.size)))
        self.tokens = [b if b is not None else f"<{pieces[i] or i}>".encode() for i, b in enumerate(vocab.token_bytes)]
        self.special_token_ids = [i for i, b in enumerate(vocab.token_bytes) if b is None]

    def __call__(self, data: bytes) -> list[int]:
        return self.vocab.encode(data)[0]


def run_llguidance(vocab: Vocab, eos: list[int], n: int, ids: list[int]) -> dict:
    start = time.perf_counter_ns()
    tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapper(vocab, eos)), eos_token=eos)
    tokenizer_ms = (time.perf_counter_ns() - start) / 1e6
    start = time.perf_counter_ns()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    error, _ = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
    assert not error
    first = llguidance.LLMatcher(tok, grammar)
    compile_ms = (time.perf_counter_ns() - start) / 1e6
    bitmask = torch.full(((n + 31) // 32,), -1, dtype=torch.int32)

    def one_request(matcher) -> tuple[list[int], list[int]]:
        masks, consumes = [], []
        for tid in [*ids, eos[0]]:
            start = time.perf_counter_ns()
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
            masks.append(time.perf_counter_ns() - start)
            assert bool((bitmask[tid // 32] >> (tid % 32)) & 1), "document token masked out"
            start = time.perf_counter_ns()
            ok = matcher.consume_token(tid)
            consumes.append(time.perf_counter_ns() - start)
            assert ok, matcher.get_error()
        return masks, consumes

    cold, consume = one_request(first)
    start = time.perf_counter_ns()
    second = llguidance.LLMatcher(tok, grammar)
    matcher_ms = (time.perf_counter_ns() - start) / 1e6
    requests = [one_request(llguidance.LLMatcher(tok, grammar))[0] for _ in range(WARM_REQUESTS)]
    warm = [t for masks in requests for t in masks]
    first.reset()
    start = time.perf_counter_ns()
    copy = first.deep_copy()
    copy_ms = (time.perf_counter_ns() - start) / 1e6
    copied, _ = one_request(copy)
    del second
    return {
        "library": "llguidance",
        "version": llguidance.__version__,
        "tokenizer_ms": round(tokenizer_ms, 1),
        "compile_ms": round(compile_ms, 2),
        "matcher_ms": round(matcher_ms, 3),
        "copy_ms": round(copy_ms, 4),
        "mask_us_cold": stats_us(cold),
        "mask_us_warm": stats_us(warm),
        "mask_ms_per_document": per_document_ms(requests),
        "mask_us_copy_of_used": stats_us(copied),
        "consume_us": stats_us(consume),
    }


# -- xgrammar ---------------------------------------------------------------------------------------------
def run_xgrammar(vocab: Vocab, eos: list[int], n: int, ids: list[int]) -> dict:
    import xgrammar

    start = time.perf_counter_ns()
    # RAW: the spellings are already plain bytes (byte-level BPE and SentencePiece decoded by Vocab);
    # control tokens get an empty spelling, which xgrammar treats as special.
    encoded = [b if b is not None else b"" for b in vocab.token_bytes]
    info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.RAW, vocab_size=n, stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    tokenizer_ms = (time.perf_counter_ns() - start) / 1e6
    start = time.perf_counter_ns()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True, strict_mode=False)
    compile_ms = (time.perf_counter_ns() - start) / 1e6
    bitmask = xgrammar.allocate_token_bitmask(1, n)

    def one_request(matcher) -> tuple[list[int], list[int]]:
        masks, consumes = [], []
        for tid in [*ids, eos[0]]:
            start = time.perf_counter_ns()
            matcher.fill_next_token_bitmask(bitmask)
            masks.append(time.perf_counter_ns() - start)
            assert bool((bitmask[0, tid // 32] >> (tid % 32)) & 1), "document token masked out"
            start = time.perf_counter_ns()
            ok = matcher.accept_token(tid)
            consumes.append(time.perf_counter_ns() - start)
            assert ok
        return masks, consumes

    cold, consume = one_request(xgrammar.GrammarMatcher(compiled))
    start = time.perf_counter_ns()
    xgrammar.GrammarMatcher(compiled)
    matcher_ms = (time.perf_counter_ns() - start) / 1e6
    requests = [one_request(xgrammar.GrammarMatcher(compiled))[0] for _ in range(WARM_REQUESTS)]
    warm = [t for masks in requests for t in masks]
    return {
        "library": "xgrammar",
        "version": _version("xgrammar"),
        "tokenizer_ms": round(tokenizer_ms, 1),
        "compile_ms": round(compile_ms, 2),
        "matcher_ms": round(matcher_ms, 3),
        "mask_us_cold": stats_us(cold),
        "mask_us_warm": stats_us(warm),
        "mask_ms_per_document": per_document_ms(requests),
        "consume_us": stats_us(consume),
    }


# -- the engine: safe_engine.shaping.constrained -----------------------------------------------------------------
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {"name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}},
]
TOOL_REPLY = (
    "I will look up the current weather for both cities you asked about, then compare them for you.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Reykjavík", "unit": "celsius"}}\n</tool_call>'
)


def run_engine(family: str, vocab: Vocab, eos: list[int], width: int, grammar, text: bytes, what: str) -> dict:
    from types import SimpleNamespace

    from safe_engine.shaping.constrained import Constraint

    drafter = SimpleNamespace(
        vocab=vocab, token_bytes=vocab.token_bytes + [None] * (width - vocab.size), eos_ids=frozenset(eos)
    )
    ids, _ = vocab.encode(text)
    start = time.perf_counter_ns()
    constraint = Constraint(grammar, drafter)
    first_ms = (time.perf_counter_ns() - start) / 1e6
    logits = torch.randn(width)
    steps, fills, consumes = [], [], []
    for request in range(1 + WARM_REQUESTS):
        start = time.perf_counter_ns()
        constraint = Constraint(grammar, drafter)
        next_ms = (time.perf_counter_ns() - start) / 1e6
        for tid in [*ids, eos[0]]:
            start = time.perf_counter_ns()
            masked = constraint.mask_logits(logits)
            elapsed = time.perf_counter_ns() - start
            assert masked[tid] > float("-inf")
            start = time.perf_counter_ns()
            constraint.consume([tid])
            consume_ns = time.perf_counter_ns() - start
            if request:  # the first request warms the lexer; later ones are what a service sees
                steps.append(elapsed)
                consumes.append(consume_ns)
                allowed = torch.from_numpy(constraint_allowed_before(constraint, tid))
                start = time.perf_counter_ns()
                logits.masked_fill(~allowed, float("-inf"))
                fills.append(time.perf_counter_ns() - start)
        assert constraint.is_finished()
    return {
        "library": "engine",
        "what": what,
        "tokenizer": family,
        "vocab": width,
        "steps": len(ids) + 1,
        "first_constraint_ms": round(first_ms, 1),
        "next_constraint_ms": round(next_ms, 3),
        "mask_logits_us": stats_us(steps),
        "masked_fill_us": stats_us(fills),
        "consume_us": stats_us(consumes),
    }


def constraint_allowed_before(constraint, tid: int):
    """The mask the step just used (rolled back one id, read, consumed again): for the masked_fill baseline."""
    constraint.rollback(1)
    allowed = constraint.allowed().copy()
    constraint.consume([tid])
    return allowed


def run_ensemble_point(vocabs: dict[str, tuple[Vocab, list[int], int]]) -> list[dict]:
    from types import SimpleNamespace

    from safe_engine.shaping.constrained import Candidates, Constraint, Grammar, mask_distribution

    qwen, qwen_eos, _ = vocabs["qwen2.5-7b-instruct"]
    llama = vocabs["llama2"][0]
    drafter = SimpleNamespace(vocab=qwen, token_bytes=qwen.token_bytes + [None] * 399, eos_ids=frozenset(qwen_eos))
    union = list(dict.fromkeys([b"", *(b for v in (qwen, llama) for b in v.token_bytes if b)]))  # as UnionVocab
    start = time.perf_counter_ns()
    table = Candidates(union, drafter)
    table_ms = (time.perf_counter_ns() - start) / 1e6
    grammar = Grammar.json_schema(SCHEMA)
    generator = torch.Generator().manual_seed(0)
    unite = [union[i] for i in torch.randint(1, len(union), (20,), generator=generator).tolist()]
    out = []
    for state, prefix in [("structure", '{"name": "Zoë", "age": '), ("in a string", '{"name": "Zo')]:
        constraint = Constraint(grammar, drafter)
        constraint.consume(qwen.encode(prefix.encode())[0])
        probs = torch.rand(len(union), generator=generator, dtype=torch.float64)
        timings = {"unite_20": [], "gac_union": []}
        for _ in range(20):
            start = time.perf_counter_ns()
            mask_distribution(unite, probs[:20], constraint)
            timings["unite_20"].append(time.perf_counter_ns() - start)
            start = time.perf_counter_ns()
            mask_distribution(table, probs, constraint)
            timings["gac_union"].append(time.perf_counter_ns() - start)
        out.append(
            {
                "library": "engine",
                "what": f"mask_distribution at an ensemble point, {state}",
                "tokenizer": "qwen2.5-7b-instruct drafter, union with llama2",
                "union_strings": len(union),
                "union_not_one_drafter_token": len(table.multi_at),
                "candidates_table_ms": round(table_ms, 1),
                "unite_20_candidates_us": stats_us(timings["unite_20"]),
                "gac_union_us": stats_us(timings["gac_union"]),
            }
        )
    return out


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/constraint_cost.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    text = json.dumps(DOCUMENT, ensure_ascii=False).encode()
    rows = []
    vocabs = {}
    for family in FAMILIES:
        vocab, eos, n = vocabs[family] = vocab_of(family)
        ids, _ = vocab.encode(text)
        assert b"".join(vocab.token_bytes[i] for i in ids) == text
        for run in (run_llguidance, run_xgrammar):
            gc.collect()
            try:
                result = run(vocab, eos, n, ids)
            except ImportError as err:  # xgrammar is optional: measured where installed
                result = {"library": run.__name__.removeprefix("run_"), "skipped": str(err)}
            rows.append({"tokenizer": family, "vocab": n, "steps": len(ids) + 1, **result})
            print(json.dumps(rows[-1]), flush=True)
    from safe_engine.shaping.constrained import Grammar

    for family in FAMILIES:
        vocab, eos, n = vocabs[family]
        width = 152064 if family.startswith("qwen") else n  # the model's logits row (Qwen2.5 pads its vocabulary)
        for grammar, reply, what in [
            (Grammar.json_schema(SCHEMA), text, "json_schema, the same document"),
            (Grammar.tool_calls(TOOLS, "auto"), TOOL_REPLY.encode(), "tool_calls auto: text, then two calls"),
        ]:
            rows.append(run_engine(family, vocab, eos, width, grammar, reply, what))
            print(json.dumps(rows[-1]), flush=True)
    for row in run_ensemble_point(vocabs):
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {
        "what": "per-step token-mask cost, JSON schema, a valid document fed token by token",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "document_bytes": len(text),
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
