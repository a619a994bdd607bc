"""Throughput under continuous batching (issue 13): aggregate tokens/s and per-request latency against B.

One invocation measures every configuration on the same GSM8K chat prompts, checks the three throughput
targets, and checks that batching does not change greedy text (a request's text in a batch of B equals its
solo B = 1 text, and where it does not, the difference starts at a near-tie):

    python benchmarks/throughput.py --threads 1 --prompts 8 16 --batch-sizes 1 2 4 8 \\
        --batch-sizes-for 16:8,16 --max-new-tokens 256 --out benchmarks/results/throughput.json \\
        --markdown benchmarks/results/throughput.md --plot benchmarks/results/throughput.png

Configurations (`--configs`): `hf` is transformers' `generate` on the drafter alone, B prompts per call
(static batches, left padding, greedy, the drafter's own chat template with exactly the engine's prompt ids);
the others are `Ensemble(members, max_batch_size=B).generate_batch(all prompts, method=..., aggregation=...)`.

Measures per (prompt set, configuration, B):
- aggregate tokens/s = Σ tokens of all requests / wall time of the whole set. Tokens count up to and
  including the EOS, as the engine's stats do.
- latency of a request, including queueing: hf, end of its static batch − start of the run; engine,
  `stats.wall_time_s` (from the request's creation to its end; `generate_batch` creates every request before
  any decoding starts, so it is measured from the call's start).
- mean E/T, replaced and discarded draft tokens, forward passes per member (Σ over requests, the engine's
  count), peak RSS, and a profile: per member, the model forward calls really made (a batched call counts
  once), the tokens they were fed and the seconds spent inside them (module hooks), and the time during which
  no forward ran (the decoder's own time). Where a target misses, the Markdown note prints both rows' profiles.

Targets (at B = --target-batch-size): SAFE(B) ≥ 3 × SAFE(1), SAFE(B) ≥ 0.75 × hf(B), single(B) ≥ hf(B), for
each SAFE aggregation and prompt set (a set without a B = 1 row uses another set's). Equality: every row with
B > 1 against the same configuration's B = 1 texts of the same prompts; each difference gets the first
differing character and, per member, the first differing token and the top-2 logit gap there (one forward
over prompt ids + that member's ids of the common text). `--batch-sizes-for 16:8,16` leaves out the big
set's costly B = 1 rows (its first 8 prompts are compared with the 8-prompt set's solo texts); with
`16:1,8,16` its B = 1 rows run only prompts 9-16 and reuse the 8-prompt set's results for the first 8
(B = 1 decodes one request after another, so that is the same row).

Rows run set by set, B by B, configuration by configuration, so neighbouring jobs on a shared machine load
every configuration of a B alike. The JSON is rewritten after every row: an interrupted run keeps its rows.
`--option KEY=VALUE` passes a GenerationConfig field to every engine row (e.g. `schedule=rounds`: with a spare
core the engine's default overlaps a lone request's verifier with its drafter, so B = 1 rows may use 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from safe_engine import Ensemble
from safe_engine.bench import PeakRSS
from safe_engine.config import GenerationConfig
from safe_engine.eval import load_task
from safe_engine.eval.prompts import chat_messages
from safe_engine.runtime.baseline import hf_generate
from safe_engine.runtime.members import Member, load_member
from safe_engine.shaping.chat import chat_prompt_ids

DEFAULT_MODELS = ("qwen2.5-coder-0.5b", "smollm2-135m")
DEFAULT_CONFIGS = ("hf", "single", "safe:unite", "safe:gac", "every_token:unite")
NEAR_TIE = 1e-3  # a batch/solo difference is explained when the drafter's top-2 logit gap there is below this
Message = dict[str, str]


# -- measuring -------------------------------------------------------------------------------------------


@dataclass
class ForwardProfile:
    """One member's model forward calls during a run: how many, how many input tokens, how long."""

    calls: int = 0
    tokens: int = 0  # input positions fed (padding included for hf)
    seconds: float = 0.0


class Profiler:
    """Times every top-level model forward of each member (module hooks; CPU, so no device sync needed).

    Why: it splits a run's wall time into model compute and the decoder's own time, and counts batched
    calls, which is what explains a throughput ratio that misses its target. Forwards of different members
    may run at once (the engine's overlap schedule runs verifiers on a spare core beside the drafter), so
    `busy_s`, the time during which at least one forward ran, is kept beside each member's own seconds."""

    def __init__(self, members: Sequence[Member]) -> None:
        self.members = list(members)
        self.profiles = {m.name: ForwardProfile() for m in self.members}
        self.busy_s = 0.0
        self._lock = threading.Lock()
        self._running = 0
        self._busy_since = 0.0
        self._started: dict[tuple[str, int], float] = {}  # (member, thread) -> start of its forward
        self._handles: list[Any] = []

    def __enter__(self) -> Profiler:
        for m in self.members:
            self._handles.append(m.model.register_forward_pre_hook(partial(self._before, m.name), with_kwargs=True))
            self._handles.append(m.model.register_forward_hook(partial(self._after, m.name), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()

    def _before(self, name: str, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        now = time.perf_counter()
        with self._lock:
            self.profiles[name].tokens += int(ids.numel()) if ids is not None else 0
            self._started[(name, threading.get_ident())] = now
            if self._running == 0:
                self._busy_since = now
            self._running += 1

    def _after(self, name: str, module, args, kwargs, output) -> None:
        now = time.perf_counter()
        with self._lock:
            prof = self.profiles[name]
            prof.seconds += now - self._started.pop((name, threading.get_ident()))
            prof.calls += 1
            self._running -= 1
            if self._running == 0:
                self.busy_s += now - self._busy_since


@dataclass
class Request:
    """One request's outcome in a row."""

    id: str
    text: str
    tokens: int
    latency_s: float
    finish_reason: str
    ensemble_rate: float | None = None


@dataclass
class Row:
    """One (prompt set, configuration, B) measurement over the whole prompt set."""

    prompts: int
    config: str
    batch_size: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    latency_p50_s: float
    latency_p95_s: float
    mean_ensemble_rate: float | None
    replaced_tokens: int
    discarded_draft_tokens: int
    forward_passes: dict[str, int]  # engine stats, Σ over requests (hf: none)
    profile: dict[str, ForwardProfile]
    forward_busy_s: float  # wall time during which at least one model forward ran
    rss_start_mib: float
    peak_rss_mib: float
    requests: list[Request] = field(default_factory=list)
    reused_requests: int = 0  # B = 1 only: the first requests' results come from a smaller set's B = 1 row


def make_row(prompts: int, config: str, batch_size: int, wall: float, requests: list[Request], **extra: Any) -> Row:
    latencies = [r.latency_s for r in requests]
    tokens = sum(r.tokens for r in requests)
    rates = [r.ensemble_rate for r in requests if r.ensemble_rate is not None]
    return Row(
        prompts=prompts,
        config=config,
        batch_size=batch_size,
        tokens=tokens,
        wall_s=wall,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        latency_p50_s=float(np.percentile(latencies, 50)),
        latency_p95_s=float(np.percentile(latencies, 95)),
        mean_ensemble_rate=float(np.mean(rates)) if rates else None,
        requests=requests,
        **extra,
    )


def hf_texts(member: Member, prompt_ids: list[list[int]], max_new_tokens: int) -> list[tuple[str, int, str]]:
    """transformers' greedy `generate` over one left-padded static batch: (text, tokens, finish) per row."""
    rows = hf_generate(member, prompt_ids, max_new_tokens).rows
    spelled = [b"".join(member.token_bytes[t] or b"" for t in row.ids) for row in rows]
    return [(text.decode("utf-8", errors="replace"), row.tokens, row.finish) for text, row in zip(spelled, rows)]


def run_hf(member: Member, ids: list[str], messages: list[list[Message]], batch_size: int, max_new_tokens: int) -> Row:
    """The drafter alone, B prompts per `generate` call; a request's latency is its batch's end − the run's start."""
    prompt_ids = [chat_prompt_ids(member, m) for m in messages]
    hf_texts(member, prompt_ids[:1], 2)  # warm-up
    requests: list[Request] = []
    with PeakRSS() as mem, Profiler([member]) as prof:
        start = time.perf_counter()
        for lo in range(0, len(prompt_ids), batch_size):
            outs = hf_texts(member, prompt_ids[lo : lo + batch_size], max_new_tokens)
            end = time.perf_counter() - start
            requests += [Request(i, t, n, end, f) for i, (t, n, f) in zip(ids[lo:], outs)]
        wall = time.perf_counter() - start
    return make_row(
        len(ids),
        "hf",
        batch_size,
        wall,
        requests,
        replaced_tokens=0,
        discarded_draft_tokens=0,
        forward_passes={},
        profile=prof.profiles,
        forward_busy_s=prof.busy_s,
        rss_start_mib=mem.start,
        peak_rss_mib=mem.peak,
    )


def run_engine(
    ens: Ensemble,
    config: str,
    ids: list[str],
    messages: list[list[Message]],
    max_new_tokens: int,
    extra: dict[str, Any] | None = None,
) -> Row:
    """All prompts through `generate_batch`: at most B decode together, the rest queue for a free slot.
    `extra`: more GenerationConfig fields for every engine row (e.g. schedule="rounds")."""
    method, _, aggregation = config.partition(":")
    options = {**(extra or {}), "method": method, "aggregation": aggregation or "unite"}
    ens.generate(messages=messages[0], max_new_tokens=2, **options)  # warm-up (and GaC's union vocabulary)
    members = ens.members if method != "single" else [ens.drafter]
    with PeakRSS() as mem, Profiler(members) as prof:
        start = time.perf_counter()
        results = ens.generate_batch(messages, max_new_tokens=max_new_tokens, **options)
        wall = time.perf_counter() - start
    requests = [
        Request(
            i,
            r.text,
            r.stats.tokens,
            r.stats.wall_time_s,
            r.finish_reason,
            r.stats.ensemble_rate if method != "single" else None,
        )
        for i, r in zip(ids, results)
    ]
    passes: dict[str, int] = {}
    for r in results:
        for name, n in r.stats.forward_passes.items():
            passes[name] = passes.get(name, 0) + n
    return make_row(
        len(ids),
        config,
        ens.max_batch_size,
        wall,
        requests,
        replaced_tokens=sum(r.stats.replaced_tokens for r in results),
        discarded_draft_tokens=sum(r.stats.discarded_draft_tokens for r in results),
        forward_passes=passes,
        profile=prof.profiles,
        forward_busy_s=prof.busy_s,
        rss_start_mib=mem.start,
        peak_rss_mib=mem.peak,
    )


# -- analysis ----------------------------------------------------------------------------------------------


def find_row(rows: Sequence[dict], config: str, batch_size: int, prompts: int) -> tuple[dict | None, str]:
    """The row of this set, else the same configuration and B from another set (B = 1 is often run on the
    small set only: its per-request speed does not depend on how many requests wait)."""
    same = [r for r in rows if r["config"] == config and r["batch_size"] == batch_size]
    for r in same:
        if r["prompts"] == prompts:
            return r, ""
    if same:
        return same[0], f" (B = {batch_size} row of the {same[0]['prompts']}-prompt set)"
    return None, ""


def targets(rows: Sequence[dict], batch_size: int = 8) -> list[dict]:
    """The issue's three throughput targets for every prompt set (SAFE ones for each aggregation run)."""
    configs = {r["config"] for r in rows}
    goals = []
    for safe in sorted((c for c in configs if c.startswith("safe:")), key=lambda c: (c != "safe:unite", c)):
        goals.append((f"{safe} B={batch_size} / {safe} B=1", safe, batch_size, safe, 1, 3.0))
        goals.append((f"{safe} B={batch_size} / hf B={batch_size}", safe, batch_size, "hf", batch_size, 0.75))
    goals.append((f"single B={batch_size} / hf B={batch_size}", "single", batch_size, "hf", batch_size, 1.0))
    out = []
    for prompts in sorted({r["prompts"] for r in rows}):
        for name, num_config, num_b, den_config, den_b, goal in goals:
            num = next(
                (r for r in rows if (r["prompts"], r["config"], r["batch_size"]) == (prompts, num_config, num_b)), None
            )
            den, where = find_row(rows, den_config, den_b, prompts)
            if num is None or den is None or not den["tokens_per_s"]:
                continue
            ratio = num["tokens_per_s"] / den["tokens_per_s"]
            out.append(
                {
                    "prompts": prompts,
                    "target": name,
                    "goal": goal,
                    "ratio": ratio,
                    "passed": ratio >= goal,
                    "numerator": [num["prompts"], num["config"], num["batch_size"]],
                    "denominator": [den["prompts"], den["config"], den["batch_size"]],
                    "denominator_from": where,  # set when the denominator row is another prompt set's
                    "profile": [] if ratio >= goal else [explain(num), explain(den)],  # why it missed
                }
            )
    return out


def explain(row: dict) -> str:
    """A row's profile in one line: where its wall time went (forwards per member, the decoder's own time)."""
    parts = []
    for name, p in row["profile"].items():
        per_call = p["seconds"] / p["calls"] if p["calls"] else 0.0
        width = p["tokens"] / p["calls"] if p["calls"] else 0.0
        parts.append(
            f"{name} {p['seconds']:.1f} s in {p['calls']} calls ({per_call * 1000:.0f} ms/call, {width:.1f} input "
            f"tokens/call, {p['calls'] / max(row['tokens'], 1):.2f} calls/token)"
        )
    wall, busy = row["wall_s"], row["forward_busy_s"]
    overlap = sum(p["seconds"] for p in row["profile"].values()) - busy
    line = (
        f"  - {row['config']} B={row['batch_size']} ({row['prompts']} prompts): {row['tokens_per_s']:.2f} tok/s, "
        f"{row['tokens']} tokens in {wall:.1f} s; forwards: " + " + ".join(parts)
    )
    if overlap > 0.05 * busy:
        line += f", {overlap:.1f} s of them concurrent"
    line += f"; {wall - busy:.1f} s ({(wall - busy) / max(wall, 1e-9):.1%}) with no forward running (decoder, Python)"
    if row["config"] not in ("hf", "single"):
        line += (
            f"; E/T {row['mean_ensemble_rate'] or 0:.1%}, {row['replaced_tokens']} replaced → "
            f"{row['discarded_draft_tokens']} discarded draft tokens; request-passes {row['forward_passes']}"
        )
    return line


def common_prefix(a: Sequence, b: Sequence) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@torch.inference_mode()
def divergence(member: Member, messages: list[Message], solo: str, batch: str) -> dict:
    """Where two texts part in this member's own tokenization, and how close its choice was there.

    One plain forward over prompt ids + the member's ids of the common text gives the logits of the first
    differing token: `top2_gap` (best − second best logit) near zero means float noise from a different
    batch could flip the greedy choice; `chosen_gap` is the gap between the two texts' tokens (a text that
    ended there continues with the member's EOS)."""
    a, b = member.vocab.encode_text(solo), member.vocab.encode_text(batch)
    k = common_prefix(a, b)
    ids = chat_prompt_ids(member, messages) + a[:k]
    logits = member.model(input_ids=torch.tensor([ids], device=member.device), use_cache=False).logits[0, -1].float()
    top = logits.topk(2)
    eos = max(member.eos_ids, key=lambda i: float(logits[i]))
    ta, tb = (a[k] if k < len(a) else eos), (b[k] if k < len(b) else eos)

    def piece(i: int) -> str:
        return member.tokenizer.decode([i])

    return {
        "token_index": k,
        "solo_token": piece(ta),
        "batch_token": piece(tb),
        "top1_token": piece(int(top.indices[0])),
        "top2_gap": float(top.values[0] - top.values[1]),
        "chosen_gap": abs(float(logits[ta] - logits[tb])),
    }


def equality(rows: Sequence[Row], members: Sequence[Member], messages: dict[str, list[Message]]) -> list[dict]:
    """For every row with B > 1: which requests' texts equal their solo (B = 1, same configuration) text.

    A request's solo text may come from any prompt set's B = 1 row (the sets share their first prompts). For
    each difference: the first differing character, and per member (the drafter alone for hf / single) the
    first differing token and the top-2 logit gap there; `near_tie` is the drafter's gap < NEAR_TIE."""
    solo = {(r.config, q.id): q.text for r in rows if r.batch_size == 1 for q in r.requests}
    out = []
    for row in rows:
        if row.batch_size == 1:
            continue
        scored = [q for q in row.requests if (row.config, q.id) in solo]
        if not scored:
            continue
        diffs = []
        for q in scored:
            alone = solo[(row.config, q.id)]
            if q.text == alone:
                continue
            char = common_prefix(alone, q.text)
            checked = members if row.config not in ("hf", "single") else members[:1]
            gaps = {m.name: divergence(m, messages[q.id], alone, q.text) for m in checked}
            drafter_gap = gaps[members[0].name]["top2_gap"]
            diffs.append(
                {
                    "id": q.id,
                    "char": char,
                    "solo": alone[max(0, char - 30) : char + 30],
                    "batch": q.text[max(0, char - 30) : char + 30],
                    "members": gaps,
                    "drafter_top2_gap": drafter_gap,
                    "near_tie": drafter_gap < NEAR_TIE,
                }
            )
        out.append(
            {
                "prompts": row.prompts,
                "config": row.config,
                "batch_size": row.batch_size,
                "compared": len(scored),
                "equal": len(scored) - len(diffs),
                "rate": (len(scored) - len(diffs)) / len(scored),
                "all_near_ties": all(d["near_tie"] for d in diffs),
                "differences": diffs,
            }
        )
    return out


# -- running -------------------------------------------------------------------------------------------------


def parse_batch_sizes_for(specs: Sequence[str]) -> dict[int, list[int]]:
    """`16:8,16` → {16: [8, 16]}: the B values of one prompt set (e.g. no expensive B = 1 for the big set)."""
    out = {}
    for spec in specs:
        n, _, sizes = spec.partition(":")
        out[int(n)] = [int(b) for b in sizes.split(",") if b]
    return out


def parse_options(specs: Sequence[str]) -> dict[str, Any]:
    """`schedule=rounds`, `draft_length=4` → GenerationConfig fields (values read as JSON where they parse)."""
    out: dict[str, Any] = {}
    for spec in specs:
        key, _, value = spec.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def benchmark(members: Sequence[Member], args: argparse.Namespace) -> dict:
    """Every row, then the targets and the equality check; the JSON is written after every row."""
    problems = load_task("gsm8k", limit=max(args.prompts))
    messages = {p.id: chat_messages(p) for p in problems}
    per_set = parse_batch_sizes_for(args.batch_sizes_for or [])
    options = parse_options(args.option or [])
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_start": list(os.getloadavg()),
        "members": [m.name for m in members],
        "drafter": members[0].name,
        "max_new_tokens": args.max_new_tokens,
        "prompts": list(args.prompts),
        "prompt_ids": [p.id for p in problems],
        "configs": list(args.configs),
        "engine_options": options,
        "target_batch_size": args.target_batch_size,
        "latency": "hf: end of the request's static batch - start of the run; engine: stats.wall_time_s "
        "(request creation, at the call's start, to its end); both include queueing",
        "rows": [],
    }
    rows: list[Row] = []
    for n in sorted(args.prompts):
        for b in per_set.get(n, args.batch_sizes):
            if b > n:
                continue
            ens = Ensemble(members, max_batch_size=b)
            for config in args.configs:
                # B = 1 decodes one request after another, so a bigger set's B = 1 row is a smaller set's
                # (the same first prompts) followed by the remaining prompts: only those run.
                prior = max(
                    (r for r in rows if (r.config, r.batch_size) == (config, 1) and r.prompts < n),
                    key=lambda r: r.prompts,
                    default=None,
                )
                skip = prior.prompts if b == 1 and prior is not None else 0
                ids = [p.id for p in problems[skip:n]]
                msgs = [messages[i] for i in ids]
                if config == "hf":
                    row = run_hf(members[0], ids, msgs, b, args.max_new_tokens)
                else:
                    row = run_engine(ens, config, ids, msgs, args.max_new_tokens, options)
                if skip:
                    row = extend_solo(prior, row)
                rows.append(row)
                result["rows"].append(asdict(row))
                summary = {k: v for k, v in asdict(row).items() if k not in ("requests", "profile")}
                print(json.dumps(summary), file=sys.stderr, flush=True)
                write_json(result, args.out)
    result["load_average_end"] = list(os.getloadavg())
    result["targets"] = targets(result["rows"], args.target_batch_size)
    result["equality"] = equality(rows, members, messages)
    return result


def extend_solo(prior: Row, rest: Row) -> Row:
    """A B = 1 row over prior's prompts then rest's, as if run in one call (rest's requests queued behind
    all of prior's, so their latencies grow by prior's wall time)."""
    requests = prior.requests + [replace(q, latency_s=q.latency_s + prior.wall_s) for q in rest.requests]
    profile = {}
    for name in dict.fromkeys([*prior.profile, *rest.profile]):
        a, b = prior.profile.get(name, ForwardProfile()), rest.profile.get(name, ForwardProfile())
        profile[name] = ForwardProfile(a.calls + b.calls, a.tokens + b.tokens, a.seconds + b.seconds)
    passes = {
        name: prior.forward_passes.get(name, 0) + rest.forward_passes.get(name, 0)
        for name in dict.fromkeys([*prior.forward_passes, *rest.forward_passes])
    }
    return make_row(
        len(requests),
        rest.config,
        1,
        prior.wall_s + rest.wall_s,
        requests,
        replaced_tokens=prior.replaced_tokens + rest.replaced_tokens,
        discarded_draft_tokens=prior.discarded_draft_tokens + rest.discarded_draft_tokens,
        forward_passes=passes,
        profile=profile,
        forward_busy_s=prior.forward_busy_s + rest.forward_busy_s,
        rss_start_mib=prior.rss_start_mib,
        peak_rss_mib=max(prior.peak_rss_mib, rest.peak_rss_mib),
        reused_requests=len(prior.requests),
    )


def write_json(result: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")


# -- reporting ---------------------------------------------------------------------------------------------


def markdown(result: dict) -> str:
    """The rows table, the targets with their profiles where missed, and the batch-vs-solo equality check."""
    lines = [
        f"# Throughput ({result['date']}): {' + '.join(result['members'])}, {result['max_new_tokens']} new tokens, "
        f"greedy, {result['torch_threads']} torch thread(s)",
        "",
        f"Engine options: {result.get('engine_options') or 'defaults'}. Latency: {result['latency']}. "
        f"Load average (1, 5, 15 min) {_loads(result.get('load_average_start'))} at the start, "
        f"{_loads(result.get('load_average_end'))} at the end; {result.get('cpu_count')} CPUs.",
        "",
        "| prompts | config | B | tok/s | p50 s | p95 s | mean E/T | replaced | discarded | forward passes "
        "(Σ requests) | forward calls | peak RSS MiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for r in result["rows"]:
        rate = "–" if r["mean_ensemble_rate"] is None else f"{r['mean_ensemble_rate']:.1%}"
        passes = ", ".join(f"{k}={v}" for k, v in r["forward_passes"].items()) or "–"
        calls = ", ".join(f"{k}={p['calls']}" for k, p in r["profile"].items())
        reused = (
            f" (first {r['reused_requests']} from the {r['reused_requests']}-prompt row)"
            if r.get("reused_requests")
            else ""
        )
        lines.append(
            f"| {r['prompts']} | {r['config']} | {r['batch_size']}{reused} | {r['tokens_per_s']:.2f} | "
            f"{r['latency_p50_s']:.2f} | {r['latency_p95_s']:.2f} | {rate} | {r['replaced_tokens']} | "
            f"{r['discarded_draft_tokens']} | {passes} | {calls} | {r['peak_rss_mib']:.0f} |"
        )
    lines += ["", "## Targets", "", "| prompts | target | ratio | goal | |", "|---:|---|---:|---:|---|"]
    notes = []
    for t in result.get("targets", []):
        verdict = "pass" if t["passed"] else "**miss**"
        where = t["denominator_from"]
        lines.append(f"| {t['prompts']} | {t['target']}{where} | {t['ratio']:.2f} | ≥ {t['goal']:.2f} | {verdict} |")
        if t["profile"]:
            profile = "\n".join(t["profile"])
            notes.append(
                f"- {t['prompts']} prompts, {t['target']} = {t['ratio']:.2f} < {t['goal']}; profile:\n{profile}"
            )
    if notes:
        lines += ["", "Missed targets, with the profile of both rows:", "", *notes]
    lines += [
        "",
        "## Batch text = solo text (greedy)",
        "",
        f"A difference is explained when the drafter's top-2 logit gap at the first differing token is < {NEAR_TIE:g}.",
        "",
    ]
    at = [
        e for e in result.get("equality", []) if e["batch_size"] == result["target_batch_size"] and e["config"] != "hf"
    ]
    if at:
        equal, compared = sum(e["equal"] for e in at), sum(e["compared"] for e in at)
        diffs = [d for e in at for d in e["differences"]]
        lines += [
            f"Engine configurations at B = {result['target_batch_size']}: {equal} / {compared} requests "
            f"({equal / compared:.1%}) equal their solo text; {len(diffs)} differ, "
            f"{sum(not d['near_tie'] for d in diffs)} of them not at a near-tie.",
            "",
        ]
    lines += [
        "| prompts | config | B | equal / compared | rate | differences all at near-ties |",
        "|---:|---|---:|---:|---:|---|",
    ]
    details = []
    for e in result.get("equality", []):
        ties = "–" if not e["differences"] else ("yes" if e["all_near_ties"] else "**no**")
        unsolo = f" ({e['prompts'] - e['compared']} without a solo run)" if e["compared"] < e["prompts"] else ""
        lines.append(
            f"| {e['prompts']} | {e['config']} | {e['batch_size']} | {e['equal']} / {e['compared']}{unsolo} | "
            f"{e['rate']:.1%} | {ties} |"
        )
        for d in e["differences"]:
            gaps = "; ".join(
                f"{name}: token {g['token_index']} {g['solo_token']!r} vs {g['batch_token']!r}, top-2 gap "
                f"{g['top2_gap']:.2e}, gap between the two {g['chosen_gap']:.2e}"
                for name, g in d["members"].items()
            )
            flag = "" if d["near_tie"] else " **NOT a near-tie**"
            details.append(
                f"- {e['config']} B={e['batch_size']} ({e['prompts']} prompts) {d['id']}: char {d['char']}, solo "
                f"{d['solo']!r} vs batch {d['batch']!r}; {gaps}{flag}"
            )
    if details:
        lines += ["", "Differences:", "", *details]
    return "\n".join(lines) + "\n"


def _loads(loads: Sequence[float] | None) -> str:
    return "–" if not loads else " / ".join(f"{x:.2f}" for x in loads)


def plot(result: dict, path: str | Path) -> None:
    """Aggregate tok/s vs B (left) and p95 latency vs B (right), one line per configuration and prompt set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[tuple[str, int], dict[int, dict]] = {}
    for r in result["rows"]:
        lines.setdefault((r["config"], r["prompts"]), {})[r["batch_size"]] = r
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {c: f"C{i}" for i, c in enumerate(sorted({c for c, _ in lines}))}
    sets = sorted({n for _, n in lines})
    styles = {n: ("-", "--", ":", "-.")[i % 4] for i, n in enumerate(sets)}
    for (config, n), points in sorted(lines.items()):
        xs = sorted(points)
        style = {"marker": "o", "color": colors[config], "linestyle": styles[n], "label": f"{config} ({n} prompts)"}
        left.plot(xs, [points[x]["tokens_per_s"] for x in xs], **style)
        right.plot(xs, [points[x]["latency_p95_s"] for x in xs], **style)
    for ax, ylabel in ((left, "aggregate tokens/s"), (right, "p95 latency per request (s)")):
        ax.set(xscale="log", xlabel="B (max batch size)", ylabel=ylabel)
        ax.set_xticks(sorted({r["batch_size"] for r in result["rows"]}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=7)
    fig.suptitle(f"{' + '.join(result['members'])}, {result['max_new_tokens']} new tokens", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None, members: Sequence[Member] | None = None) -> int:
    """Run (or, with --from-json, re-render) the benchmark; `members` replaces --models (tests pass tiny ones)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="member specs, the first drafts")
    p.add_argument("--prompts", type=int, nargs="+", default=[8, 16], help="prompt set sizes (first N GSM8K)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8], help="B for every set")
    p.add_argument(
        "--batch-sizes-for", nargs="+", metavar="N:B,B", help="B for the N-prompt set instead (e.g. 16:8,16)"
    )
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), help="hf, single, METHOD:AGGREGATION")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--option", action="append", metavar="KEY=VALUE", help="a GenerationConfig field for every engine row (repeat)"
    )
    p.add_argument("--target-batch-size", type=int, default=8, help="the B of the throughput targets")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--out", help="JSON results (rewritten after every row)")
    p.add_argument("--markdown", help="Markdown report")
    p.add_argument("--plot", help="PNG: tok/s and p95 latency vs B")
    p.add_argument("--from-json", help="no run: render --markdown / --plot from this results file")
    args = p.parse_args(argv)
    if args.from_json:
        if not (args.markdown or args.plot):
            p.error("--from-json needs --markdown PATH and/or --plot PATH")
        result = json.loads(Path(args.from_json).read_text())
        result["targets"] = targets(result["rows"], result["target_batch_size"])  # pure: recomputed from the rows
    else:
        for config in args.configs:  # refuse a bad --configs / --option now, not an hour into the run
            if config != "hf":
                method, _, aggregation = config.partition(":")
                options = {"method": method, "aggregation": aggregation or "unite"}
                GenerationConfig().updated(**parse_options(args.option or []), **options)
        if args.threads:
            torch.set_num_threads(args.threads)
        members = list(members) if members is not None else [load_member(s) for s in args.models]
        result = benchmark(members, args)
        write_json(result, args.out)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown(result))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
