"""Loops before and after issue 31: writes loops.md and loops.json next to this file.

    python benchmarks/accuracy_loops.py

"Before" is the study's records in this folder (the engine of issue 17: the drafter handed the pick's own token).
"After" is `rerun-31/`: the same harness, problems and budgets with the engine that heals the handover
(`token_healing=True`, the default since issue 31). "Steered" is the healed answers with loop steering on
(`loop_steer=2`), under each of its rules (`RULES`): the answers a rule can change (`steerable`) were decoded again,
the rest are the healed ones. `copies-31/` holds the rule the engine has: go back to the first replacement inside the
two copies of a loop, digits counting as equal. `digits-31/` went back only to a replacement inside the last copy,
`back-31/` did so with exact copies, `steer-31/` kept the drafter's token only at a pick that itself completed the
second copy (all three earlier engines).
Per task and row, on the problems both runs of that row and the drafter alone answered: the share of answers cut in a
loop (`accuracy_summarize.loops`), accuracy, and the paired comparison with the drafter alone (difference with a
paired bootstrap interval, McNemar's exact p). "Lost to loops" counts the problems the drafter alone solved where the
row's answer loops; "shared" the row's loops on problems where the drafter alone loops too. The target of issue 31 is
in loops: a pair within one problem of the drafter alone, three members no more than their loopiest-but-one member
(SmolLM2 alone; gemma alone loops on most answers). The loop guard's rows are exact replays of the same records: a
greedy answer with the guard on is the answer without it, ended at the first token where the guard fires (`guarded`),
so it needs no run; its accuracy is the truncated text scored again."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent / "results" / "accuracy"  # the study's records
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parents[2]))

from accuracy_summarize import loops  # noqa: E402

from safe_engine.algorithm.text import DIGITS_AS_ZERO, ends_in_loop  # noqa: E402
from safe_engine.eval import bootstrap_difference, load_task, mcnemar, score  # noqa: E402

TASKS = ("mmlu-redux", "arc", "gsm8k")
ROWS = ("UniTE+SAFE", "GaC+SAFE", "UniTE+SAFE (3 models)", "UniTE every token")
DRAFTER = "qwen alone"
SECOND = "smollm2 alone"  # the three-member row's loopiest-but-one member
GUARD = (3, 32)  # loop_guard, loop_span: the documented setting
STEER = (2, 32)  # loop_steer, loop_span: the loop-steering rows' setting (accuracy.py LOOP_STEER)
# loop steering's rules: the folder of each one's answers, and whether its loops count digits as equal
RULES = {
    "at the pick": ("steer-31", False),
    "going back": ("back-31", False),
    "going back, digits equal": ("digits-31", True),
    "going back into both copies, digits equal": ("copies-31", True),
}


def records(folder: Path, task: str) -> dict[str, dict[str, dict[str, Any]]]:
    """row -> problem id -> record, over TASK.jsonl and its part files in `folder` (last record wins)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for path in [folder / f"{task}.jsonl", *sorted(folder.glob(f"{task}.*.jsonl"))]:
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                r = json.loads(line)
                out.setdefault(r["config"], {})[r["problem_id"]] = r
    return out


def looping(r: dict[str, Any]) -> bool:
    return r.get("finish_reason") == "length" and loops(str(r["text"]))


def first_loop_end(data: bytes, setting: tuple[int, int]) -> int | None:
    """The length of the shortest prefix of `data` that ends in a loop at `setting` (repeats, span), if any:
    where a guard checking after every token fires."""
    repeats, span = setting
    return next((k for k in range(span * repeats, len(data) + 1) if ends_in_loop(data[:k], span, repeats)), None)


def steerable(r: dict[str, Any], digits_equal: bool = True) -> bool:
    """Whether loop steering can change the record's greedy answer: only where some prefix of it ends in a
    stretch of 32 bytes or more repeated twice in a row (`digits_equal`: digits counting as one). Every rule
    acts only at a token that ends such a prefix, and every other answer is decoded exactly as without it."""
    data = str(r["text"]).encode()
    return first_loop_end(data.translate(DIGITS_AS_ZERO) if digits_equal else data, STEER) is not None


def guarded(r: dict[str, Any], problem: Any) -> tuple[bool, bool]:
    """(correct, ended by the guard) for the record's answer with the loop guard on (see the module doc)."""
    data = str(r["text"]).encode()
    k = first_loop_end(data, GUARD)
    if k is None:
        return bool(r["correct"]), False
    return score(problem, data[:k].decode(errors="replace")).correct, True


def looping_guarded(r: dict[str, Any]) -> bool:
    """Whether the record's answer still loops until the budget with the loop guard on: a loop the guard's
    exact repetition does not see (a counter that changes from copy to copy, a period over 500 bytes)."""
    return looping(r) and first_loop_end(str(r["text"]).encode(), GUARD) is None


def compare(a: Sequence[bool], b: Sequence[bool]) -> dict[str, Any]:
    low, high = bootstrap_difference(a, b)
    test = mcnemar(a, b)
    return {
        "delta": (sum(a) - sum(b)) / len(a),
        "ci95": [low, high],
        "only_row": test.only_a,
        "only_drafter": test.only_b,
        "p": test.p_value,
    }


def task_table(task: str) -> list[dict[str, Any]]:
    before, after = records(HERE, task), records(HERE / "rerun-31", task)
    steer = {rule: records(HERE / folder, task) for rule, (folder, _) in RULES.items()}
    problems = {p.id: p for p in load_task(task, limit=150)}
    drafter, second = before[DRAFTER], before[SECOND]
    out = []
    for row in ROWS:
        old, new = before.get(row, {}), after.get(row, {})
        ids = [i for i in old if i in new and i in drafter] or [i for i in old if i in drafter]
        if not ids:
            continue
        base = [bool(drafter[i]["correct"]) for i in ids]
        entry: dict[str, Any] = {"task": task, "row": row, "n": len(ids), "rerun": all(i in new for i in ids)}
        entry["drafter"] = {"loops": sum(looping(drafter[i]) for i in ids) / len(ids), "accuracy": sum(base) / len(ids)}
        # the target, and the same bound with the guard on both sides (the loops each leaves to the budget)
        bound = second if "3 models" in row else drafter
        extra = 0 if "3 models" in row else 1
        entry["target_loops"] = sum(looping(bound[i]) for i in ids) + extra
        entry["target_loops_guarded"] = sum(looping_guarded(bound[i]) for i in ids) + extra
        runs = {}
        for rule, (_, digits_equal) in RULES.items():
            decoded = steer[rule].get(f"{row}, loop steering", {})
            if not (entry["rerun"] and decoded):
                continue
            redo = [i for i in ids if steerable(new[i], digits_equal)]
            done = [i for i in redo if i in decoded]
            entry[f"steering {rule}"] = {
                "redecoded": len(redo),
                "complete": len(done) == len(redo),
                "changed": sum(decoded[i]["text"] != new[i]["text"] for i in done),
                "steered_points": sum(decoded[i].get("steered_tokens") or 0 for i in done),
                "rolled_back_tokens": sum(decoded[i].get("rolled_back_tokens") or 0 for i in done),
                # the engine check: where the going-back rule never went back, the answer is the healed one
                "unsteered_differing": sum(
                    decoded[i]["text"] != new[i]["text"]
                    for i in done
                    if "rolled_back_tokens" in decoded[i] and not decoded[i]["rolled_back_tokens"]
                ),
                "cpu_s": round(sum(float(decoded[i].get("cpu_time_s") or 0) for i in done), 1),
            }
            if len(done) == len(redo):
                runs[f"steered {rule}"] = {i: decoded[i] if i in redo else new[i] for i in ids}
        for name, recs in (("before", old), ("after", new if entry["rerun"] else {}), *runs.items()):
            if not recs:
                continue
            correct = [bool(recs[i]["correct"]) for i in ids]
            loop_ids = [i for i in ids if looping(recs[i])]
            entry[name] = {
                "loops": len(loop_ids) / len(ids),
                "loop_count": len(loop_ids),
                "lost_to_loops": sum(bool(drafter[i]["correct"]) for i in loop_ids),
                "loops_shared_with_drafter": sum(looping(drafter[i]) for i in loop_ids),
                "accuracy": sum(correct) / len(ids),
                "vs_drafter": compare(correct, base),
            }
            outcome = [guarded(recs[i], problems[i]) for i in ids]
            entry[f"{name}_guard"] = {
                "fired": sum(f for _, f in outcome) / len(ids),
                "loop_count": sum(looping_guarded(recs[i]) for i in ids),
                "accuracy": sum(c for c, _ in outcome) / len(ids),
                "vs_drafter": compare([c for c, _ in outcome], base),
            }
        out.append(entry)
    return out


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Loops before and after token healing (issue 31)",
        "",
        "Written by `python benchmarks/accuracy_loops.py`. Loops: answers cut at the budget whose last "
        "40 characters occur 3+ times in their last 1,500 (the study's criterion). Guard: `loop_guard=3, "
        "loop_span=32` applied to the same answers (exact for greedy decoding: see the script). Δ: row − drafter "
        "alone (qwen), points, with the paired 95 % bootstrap interval and McNemar's exact p. Target: issue 31's "
        "bound on the loop count (a pair: the drafter's loops + 1; three members: SmolLM2 alone's loops). Lost to "
        "loops: problems the drafter alone solved where the row's answer loops. Shared: the row's loops on "
        "problems where the drafter alone loops too.",
        "",
        "| Task | Row | n | Drafter loops (%) | Loops before (%) | Loops after (%) | Loops after / target (count) | "
        "Lost to loops, before / after | Shared with drafter, after | Acc. drafter | Acc. before | "
        "Acc. after | Δ after (95 % CI), p | Guard fires, before / after (%) | Δ with guard, before / after |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        before, after = r["before"], r.get("after")
        guards = [r[k] for k in ("before_guard", "after_guard") if k in r]
        cells = [r["task"], r["row"], str(r["n"]), pct(r["drafter"]["loops"]), pct(before["loops"])]
        if after is None:
            cells += ["not re-run", "", f"{before['lost_to_loops']} / –", ""]
        else:
            met = "met" if after["loop_count"] <= r["target_loops"] else "missed"
            cells += [
                pct(after["loops"]),
                f"{after['loop_count']} / {r['target_loops']} ({met})",
                f"{before['lost_to_loops']} / {after['lost_to_loops']}",
                str(after["loops_shared_with_drafter"]),
            ]
        cells += [
            pct(r["drafter"]["accuracy"]),
            pct(before["accuracy"]),
            "" if after is None else pct(after["accuracy"]),
        ]
        if after is None:
            cells.append("")
        else:
            d = after["vs_drafter"]
            cells.append(
                f"{100 * d['delta']:+.1f} ({100 * d['ci95'][0]:+.1f} to {100 * d['ci95'][1]:+.1f}), {d['p']:.3f}"
            )
        cells.append(" / ".join(pct(g["fired"]) for g in guards))
        cells.append(
            " / ".join(f"{100 * g['vs_drafter']['delta']:+.1f} (p {g['vs_drafter']['p']:.2f})" for g in guards)
        )
        lines.append("| " + " | ".join(cells) + " |")
    for rule in RULES:
        lines += steering_table(rows, rule)
    return "\n".join(lines) + "\n"


def steering_table(rows: list[dict[str, Any]], rule: str) -> list[str]:
    lines = [
        "",
        f"## Loop steering, {rule} (`loop_steer=2, loop_span=32`, `{RULES[rule][0]}/`), on top of token healing",
        "",
        "Only the answers steering can change were decoded again (`steerable`: some prefix of the healed answer "
        "ends in a stretch of 32+ bytes repeated twice in a row); every other answer is the healed one, exactly. "
        "Changed: re-decoded answers whose text differs. Steered points: where the drafter's token stands in the "
        "final answers. Rolled back: tokens taken back and decoded again. Guard: `loop_guard=3` applied to the "
        "steered answers. Guard on too: the steered answers that still loop until the budget with the guard on, "
        "against the target with the guard on its side as well (the drafter's, or SmolLM2's, loops the guard "
        "does not end).",
        "",
        "| Task | Row | Re-decoded | Changed | Steered points | Rolled back | Loops healed → steered / target (count) "
        "| Lost to loops, steered | Acc. healed | Acc. steered | Δ steered (95 % CI), p | Guard fires (%) | "
        "Δ with guard | Loops, guard on too / target with guard (count) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        run = r.get(f"steered {rule}")
        if run is None:
            continue
        st, after, g = r[f"steering {rule}"], r["after"], r[f"steered {rule}_guard"]
        met = "met" if run["loop_count"] <= r["target_loops"] else "missed"
        d = run["vs_drafter"]
        cells = [
            r["task"], r["row"], str(st["redecoded"]), str(st["changed"]), str(st["steered_points"]),
            str(st["rolled_back_tokens"]), f"{after['loop_count']} → {run['loop_count']} / {r['target_loops']} ({met})",
            str(run["lost_to_loops"]), pct(after["accuracy"]), pct(run["accuracy"]),
            f"{100 * d['delta']:+.1f} ({100 * d['ci95'][0]:+.1f} to {100 * d['ci95'][1]:+.1f}), {d['p']:.3f}",
            pct(g["fired"]), f"{100 * g['vs_drafter']['delta']:+.1f} (p {g['vs_drafter']['p']:.2f})",
            f"{g['loop_count']} / {r['target_loops_guarded']} "
            f"({'met' if g['loop_count'] <= r['target_loops_guarded'] else 'missed'})",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    if sys.argv[1:2] == ["--steerable"]:  # the problems loop steering can change: `accuracy.py --ids` input
        task, row = sys.argv[2:4]
        print("\n".join(i for i, r in records(HERE / "rerun-31", task)[row].items() if steerable(r)))
        return
    rows = [entry for task in TASKS for entry in task_table(task)]
    (HERE / "loops.json").write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    (HERE / "loops.md").write_text(markdown(rows), encoding="utf-8")
    print(markdown(rows))


if __name__ == "__main__":
    main()
