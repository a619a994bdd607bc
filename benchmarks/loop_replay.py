"""Issue 31's diagnosis: replay the accuracy study's looping SAFE answers with `trace=True`, and count what the
ensemble did before and inside each loop.

    python benchmarks/loop_replay.py replay --rows UniTE+SAFE GaC+SAFE --healing off \
        --out benchmarks/results/accuracy/loop_replay/reference.jsonl       # the study's engine, traced
    python benchmarks/loop_replay.py replay --rows UniTE+SAFE GaC+SAFE --healing on \
        --out benchmarks/results/accuracy/loop_replay/healed.jsonl          # the same answers, healed
    python benchmarks/loop_replay.py analyze benchmarks/results/accuracy/loop_replay/reference.jsonl
    python benchmarks/loop_replay.py alone \
        --out benchmarks/results/accuracy/loop_replay/alone.jsonl           # whose loop is it?
    python benchmarks/loop_replay.py verifier gsm8k/81                      # the verifier's rows, checked

`replay` decodes, for each task and row, the problems whose study answer loops (`accuracy_summarize.loops`) with the
study's prompts, members, budgets and batching (8 at once), greedy, and appends one JSON line per answer:
the text, whether it equals the study's (`token_healing=False` is the study's engine: it must), the finish
reason and the trace. Resumable: answers already in OUT are skipped. `analyze` prints, over those records:
replacements that swapped the drafted token for a piece of it (" electrons" -> " electron"), handovers that
leave the drafter's ids non-canonical (a token end its tokenizer would not put there), where each loop starts
(the earliest offset from which the text repeats with its final period) relative to where it left the
drafter's own answer and to the last replacement, and the ensemble points inside the loop.

`alone` asks, for each answer that still loops in the re-run (`rerun-31/`, token healing on), whose loop it
is: each member alone, greedy, is handed the prompt and the ensemble's text up to a word start after the
loop's first full period, and writes as many tokens as the next period takes in its own tokenization. If the
member alone writes the next period, the repetition is that member's own greedy continuation of the path:
the ensemble led there, but no ensemble point is needed to keep it going.

`verifier` decodes one re-run UniTE+SAFE answer again and checks every distribution the verifier gave an
ensemble point (its cache cropped and re-encoded from its frozen prefix round after round) against a fresh
forward over the same ids: a stale cache would favour repeating what it has already seen.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
STUDY = HERE / "results" / "accuracy"
sys.path.insert(0, str(HERE))

from accuracy import MAX_NEW_TOKENS, load_problems, member  # noqa: E402
from accuracy_loops import looping, records  # noqa: E402
from accuracy_summarize import loops  # noqa: E402

TASKS = ("mmlu-redux", "arc", "gsm8k")
AGGREGATION = {"UniTE+SAFE": "unite", "GaC+SAFE": "gac"}
DRAFTER = "qwen2.5-coder-0.5b"


def study(task: str) -> dict[str, dict[str, dict[str, Any]]]:
    """row -> problem id -> the study's record."""
    return records(STUDY, task)


def answered(out: Path) -> set[tuple[str, str, str]]:
    """(task, row, problem id) of the records already in `out`: a resumed run skips them."""
    if not out.exists():
        return set()
    return {(r["task"], r["config"], r["problem_id"]) for r in map(json.loads, out.read_text().splitlines())}


def replay(args: argparse.Namespace) -> None:
    import torch

    from safe_engine import Ensemble
    from safe_engine.eval import build_prompt

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = answered(out)
    ens = Ensemble([member(DRAFTER), member("smollm2-135m")], max_batch_size=8)
    for task in TASKS:
        problems = {p.id: p for p in load_problems(task, 150)}
        records = study(task)
        for row in args.rows:
            ids = [i for i, r in records[row].items() if looping(r) and (task, row, i) not in done]
            for k in range(0, len(ids), 8):
                chunk = ids[k : k + 8]
                results = ens.generate_batch(
                    [build_prompt(problems[i], chat=True) for i in chunk],
                    method="safe",
                    aggregation=AGGREGATION[row],
                    max_new_tokens=MAX_NEW_TOKENS[task],
                    token_healing=args.healing == "on",
                    trace=True,
                )
                with out.open("a", encoding="utf-8") as f:
                    for i, res in zip(chunk, results):
                        record = {"task": task, "config": row, "problem_id": i, "healing": args.healing}
                        record |= {"text": res.text, "same_as_study": res.text == records[row][i]["text"]}
                        record |= {"finish_reason": res.finish_reason, "trace": [p.to_dict() for p in res.trace or []]}
                        f.write(json.dumps(record) + "\n")
                print(f"{task} {row}: {k + len(chunk)}/{len(ids)}", file=sys.stderr)


def loop_start(text: str) -> tuple[int, int] | None:
    """(start, period) of the repetition the text ends in: the smallest period p whose last two copies are
    equal, extended back as far as the text keeps that period; None if its end is not an exact repetition."""
    for p in range(4, len(text) // 3 + 1):
        if text[-p:] == text[-2 * p : -p]:
            i = len(text) - p
            while i > 0 and text[i - 1] == text[i - 1 + p]:
                i -= 1
            return i, p
    return None


def analyze(args: argparse.Namespace) -> None:
    drafter = member(DRAFTER)
    counts: Counter = Counter()
    pieces: Counter = Counter()
    for line in Path(args.records).read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        text, data = r["text"], r["text"].encode()
        own = study(r["task"])["qwen alone"][r["problem_id"]]["text"]
        counts["answers"] += 1
        counts["still loop"] += r["finish_reason"] == "length" and loops(text)
        counts["same text as the study"] += r["same_as_study"]
        replaced = [p for p in r["trace"] if p["replaced"]]
        counts["replacements"] += len(replaced)
        _, starts = drafter.vocab.encode(data)
        bounds = set(starts) | {len(data)}
        for p in replaced:
            if p["chosen"] and p["drafted"].startswith(p["chosen"]) and len(p["chosen"]) < len(p["drafted"]):
                counts["replacements by a piece of the drafted token"] += 1
                pieces[f"{p['drafted']!r} -> {p['chosen']!r}"] += 1
            handed = p.get("handed") or p["chosen"]
            counts["handovers ending where the drafter's tokenizer has no token end"] += (
                p["offset"] + len(handed.encode()) not in bounds
            )
        found = loop_start(text) if looping(r) else None
        if found is None:
            continue
        start, period = found
        start_b = len(text[:start].encode())
        left = next((k for k, (a, b) in enumerate(zip(text, own)) if a != b), min(len(text), len(own)))
        counts["loops with an exact period"] += 1
        counts["... starting after the text left the drafter's own answer"] += start >= left
        before = [p for p in replaced if p["offset"] < start_b]
        counts["... starting within 40 bytes after a replacement"] += (
            bool(before) and start_b - before[-1]["offset"] <= 40
        )
        inside = [p for p in r["trace"] if p["offset"] >= start_b]
        counts["ensemble points inside loops"] += len(inside)
        counts["... replaced"] += sum(p["replaced"] for p in inside)
        period_b = len(text[start : start + period].encode())
        counts["... replaced by the loop's own next text"] += sum(
            1 for p in inside if p["replaced"] and data[p["offset"] - period_b :].startswith(p["chosen"].encode())
        )
    print(json.dumps({"counts": dict(counts), "pieces": dict(pieces.most_common(20))}, indent=1))


def alone(args: argparse.Namespace) -> None:
    import torch

    from safe_engine.eval import build_prompt
    from safe_engine.shaping.chat import chat_prompt_ids

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    done = answered(out)
    members = {name: member(name) for name in (DRAFTER, "smollm2-135m")}
    for task in TASKS:
        problems = {p.id: p for p in load_problems(task, 150)}
        rerun = records(STUDY / "rerun-31", task)
        for row in args.rows:
            for i, r in rerun.get(row, {}).items():
                found = loop_start(r["text"]) if looping(r) else None
                if found is None or (task, row, i) in done:
                    continue
                text, (start, period) = r["text"], found
                cut = next((c for c in range(start + period, len(text) - period) if text[c] in " \n"), None)
                if cut is None:
                    continue
                expected = text[cut : cut + period]
                record: dict[str, Any] = {"task": task, "config": row, "problem_id": i, "period": period}
                for name, m in members.items():
                    ids = chat_prompt_ids(m, build_prompt(problems[i], chat=True))
                    ids += m.tokenizer.encode(text[:cut], add_special_tokens=False)
                    budget = len(m.tokenizer.encode(expected, add_special_tokens=False)) + 4
                    with torch.inference_mode():
                        new = m.model.generate(
                            input_ids=torch.tensor([ids], device=m.device),
                            max_new_tokens=budget,
                            do_sample=False,
                            pad_token_id=sorted(m.eos_ids)[0],
                        )[0, len(ids) :]
                    written = m.tokenizer.decode(new, skip_special_tokens=True)
                    record[name] = {"repeats": written.startswith(expected), "written": written}
                with out.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(record) + "\n")
                print(
                    f"{task} {row} {i}: " + ", ".join(f"{n} {record[n]['repeats']}" for n in members), file=sys.stderr
                )
    counts: Counter = Counter()
    for r in map(json.loads, out.read_text(encoding="utf-8").splitlines()):
        who = [n for n in members if r[n]["repeats"]]
        counts[(r["task"], r["config"], " and ".join(who) or "neither")] += 1
    print(json.dumps([{"task": t, "row": c, "repeated by": w, "loops": n} for (t, c, w), n in sorted(counts.items())]))


def verifier(args: argparse.Namespace) -> None:
    import torch

    from safe_engine import Ensemble
    from safe_engine.algorithm import alignment
    from safe_engine.eval import build_prompt

    torch.set_num_threads(args.threads)
    task = args.problem.split("/")[0]
    problem = {p.id: p for p in load_problems(task, 150)}[args.problem]
    seen: list[tuple[list[int], torch.Tensor]] = []
    view = alignment.Verification.view

    def recording(self: alignment.Verification, offset: int, final: bool) -> Any:
        row, own, cut = view(self, offset, final)
        k = self.starts.index(offset) if offset in self.starts else len(self.ids)
        head = self.track.prompt_len + self.track.frozen_ids
        seen.append((list(self.track.ids[:head]) + list(self.ids[:k]), row.full().clone()))
        return row, own, cut

    alignment.Verification.view = recording  # type: ignore[method-assign]
    qwen, smol = member(DRAFTER), member("smollm2-135m")
    res = Ensemble([qwen, smol]).generate(
        messages=build_prompt(problem, chat=True), max_new_tokens=MAX_NEW_TOKENS[task], schedule="rounds"
    )
    alignment.Verification.view = view  # type: ignore[method-assign]
    worst, argmax_differs = 0.0, 0
    with torch.inference_mode():
        for ids, values in seen:
            fresh = torch.log_softmax(smol.model(torch.tensor([ids])).logits[0, -1].float(), -1)[: values.shape[-1]]
            worst = max(worst, float((fresh - values.float()).abs().max()))
            argmax_differs += int(fresh.argmax()) != int(values.argmax())
    study_text = records(STUDY / "rerun-31", task)["UniTE+SAFE"][args.problem]["text"]
    result = {"problem": args.problem, "same_text_as_rerun": res.text == study_text, "views": len(seen)}
    print(json.dumps(result | {"max_abs_logprob_diff": worst, "argmax_differs": argmax_differs}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("replay")
    r.add_argument("--rows", nargs="+", default=list(AGGREGATION), choices=list(AGGREGATION))
    r.add_argument("--healing", choices=("on", "off"), default="off")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--out", required=True)
    a = sub.add_parser("analyze")
    a.add_argument("records")
    b = sub.add_parser("alone")
    b.add_argument("--rows", nargs="+", default=["UniTE+SAFE", "GaC+SAFE"])
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--out", required=True)
    v = sub.add_parser("verifier")
    v.add_argument("problem")
    v.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    {"replay": replay, "analyze": analyze, "alone": alone, "verifier": verifier}[args.command](args)


if __name__ == "__main__":
    main()
