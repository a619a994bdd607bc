"""Turn a results JSONL into per-configuration numbers: ``results.json``, ``results.md`` and a plot.

Why these numbers: the SAFE claim is "ensemble accuracy at single-model speed by ensembling few tokens".
So each configuration gets accuracy, the paper's E/T (ensembled tokens / generated tokens, summed over
problems, not averaged per problem, so long outputs weigh by their length), throughput (sum tokens / sum
wall time) and mean wall time per problem; the plot puts accuracy against tokens/s, one point each.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from safe_engine.eval.runner import load_records

__all__ = ["ConfigRow", "aggregate", "plot_results", "render_markdown", "write_report"]

log = logging.getLogger(__name__)


@dataclass
class ConfigRow:
    """Aggregates of one configuration over all its recorded problems.

    ``ensemble_rate`` is E/T = sum(ensembled_tokens) / sum(tokens) (None when no token counts were
    recorded); ``tokens_per_s`` = sum(tokens) / sum(wall_time_s); ``by_task`` holds n / correct /
    accuracy per benchmark family.
    """

    config: str
    n: int
    correct: int
    accuracy: float
    tokens: int
    ensembled_tokens: int
    ensemble_rate: float | None
    tokens_per_s: float | None
    total_wall_time_s: float
    mean_wall_time_s: float
    by_task: dict[str, dict[str, float]] = field(default_factory=dict)
    truncated: int = 0  # answers cut at max_new_tokens (finish_reason "length"): graded as they stand
    batched: bool = False  # answered several problems per generate call: speed columns not comparable


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def aggregate(records: Iterable[Mapping[str, Any]]) -> list[ConfigRow]:
    """Per-configuration rows, in order of first appearance; duplicate (config, problem) keeps the last."""
    latest: dict[tuple[str, str], Mapping[str, Any]] = {}
    for r in records:
        if "config" in r and "problem_id" in r:
            latest[(str(r["config"]), str(r["problem_id"]))] = r
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for (config, _), r in latest.items():
        groups.setdefault(config, []).append(r)

    rows = []
    for config, recs in groups.items():
        n = len(recs)
        correct = sum(1 for r in recs if r.get("correct"))
        tokens = [t for r in recs if (t := _num(r.get("tokens"))) is not None]
        ensembled = [t for r in recs if (t := _num(r.get("ensembled_tokens"))) is not None]
        walls = [w for r in recs if (w := _num(r.get("wall_time_s"))) is not None]
        # throughput only over records that have both numbers, so a missing count cannot skew it
        timed = [
            (t, w)
            for r in recs
            if (t := _num(r.get("tokens"))) is not None and (w := _num(r.get("wall_time_s"))) is not None
        ]
        sum_tokens, sum_ens, sum_wall = sum(tokens), sum(ensembled), sum(walls)
        timed_tokens, timed_wall = sum(t for t, _ in timed), sum(w for _, w in timed)
        by_task: dict[str, dict[str, float]] = {}
        for r in recs:
            entry = by_task.setdefault(str(r.get("task", "?")), {"n": 0, "correct": 0, "accuracy": 0.0})
            entry["n"] += 1
            entry["correct"] += 1 if r.get("correct") else 0
        for entry in by_task.values():
            entry["accuracy"] = entry["correct"] / entry["n"]
        rows.append(
            ConfigRow(
                config=config,
                n=n,
                correct=correct,
                accuracy=correct / n if n else 0.0,
                tokens=int(sum_tokens),
                ensembled_tokens=int(sum_ens),
                ensemble_rate=(sum_ens / sum_tokens) if tokens and ensembled and sum_tokens > 0 else None,
                tokens_per_s=(timed_tokens / timed_wall) if timed and timed_wall > 0 else None,
                total_wall_time_s=sum_wall,
                mean_wall_time_s=sum_wall / len(walls) if walls else 0.0,
                by_task=dict(sorted(by_task.items())),
                truncated=sum(1 for r in recs if r.get("finish_reason") == "length"),
                batched=any((_num(r.get("batch_size")) or 1) > 1 for r in recs),
            )
        )
    return rows


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "–" if value is None else format(value * scale, spec)


def render_markdown(rows: Sequence[ConfigRow], title: str | None = None) -> str:
    """A Markdown table of the rows, plus a per-task accuracy table when several tasks are present."""
    lines = [f"# {title}", ""] if title else []
    lines += [
        "| Config | n | Accuracy (%) | E/T (%) | Tokens/s | Mean wall time / problem (s) | Cut at max tokens (%) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.config}{' †' if r.batched else ''} | {r.n} | {_fmt(r.accuracy, '.2f', 100)} "
            f"| {_fmt(r.ensemble_rate, '.2f', 100)} "
            f"| {_fmt(r.tokens_per_s, '.1f')} | {_fmt(r.mean_wall_time_s, '.2f')} "
            f"| {_fmt(r.truncated / r.n if r.n else None, '.0f', 100)} |"
        )
    if any(r.batched for r in rows):
        lines += [
            "",
            "† answered several problems per batched `generate` call: its tokens/s and wall time are shares of a "
            "batch, not comparable with one-at-a-time rows (compare speed with the speed benchmark).",
        ]
    tasks = sorted({t for r in rows for t in r.by_task})
    if len(tasks) > 1:
        lines += [
            "",
            "Accuracy (%) per task:",
            "",
            "| Config | " + " | ".join(tasks) + " |",
            "|---|" + "---:|" * len(tasks),
        ]
        for r in rows:
            cells = [_fmt(r.by_task[t]["accuracy"], ".2f", 100) if t in r.by_task else "–" for t in tasks]
            lines.append(f"| {r.config} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_results(rows: Sequence[ConfigRow], path: str | os.PathLike[str], title: str | None = None) -> Path:
    """Scatter accuracy (%) against tokens/s, one labelled point per configuration; saves a PNG.

    Uses matplotlib's object API with the Agg canvas: no display needed and the caller's pyplot backend
    is left alone. matplotlib is optional (extra ``eval``) and imported here only.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.8), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for r in rows:
        x = r.tokens_per_s if r.tokens_per_s is not None else 0.0
        ax.scatter([x], [r.accuracy * 100])
        ax.annotate(r.config, (x, r.accuracy * 100), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("throughput (generated tokens / s)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(title or "Accuracy vs. speed")
    ax.grid(True, alpha=0.3)
    ax.margins(0.15)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def write_report(
    records: str | os.PathLike[str] | Iterable[Mapping[str, Any]],
    out_dir: str | os.PathLike[str],
    *,
    title: str | None = None,
    plot: bool = True,
) -> dict[str, Path]:
    """Write ``results.json``, ``results.md`` and ``results.png`` for a results JSONL (or its records).

    Returns the written paths by kind (``"json"``, ``"md"``, ``"png"``). The PNG is skipped, with a
    warning, when ``plot`` is false or matplotlib is not installed.
    """
    source = None
    if isinstance(records, str | os.PathLike):
        source = str(records)
        records = load_records(records)
    records = list(records)
    rows = aggregate(records)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md"}
    payload: dict[str, Any] = {"title": title, "source": source, "configs": [asdict(r) for r in rows]}
    markdown = render_markdown(rows, title)
    # Configurations run on different subsets (a long run split or cut short) are only comparable on the
    # problems they all answered: report those too.
    solved: dict[str, set[str]] = {}
    for r in records:
        if "config" in r and "problem_id" in r:
            solved.setdefault(str(r["config"]), set()).add(str(r["problem_id"]))
    common = set.intersection(*solved.values()) if solved else set()
    if common and any(ids != common for ids in solved.values()):
        shared = aggregate(r for r in records if str(r.get("problem_id")) in common)
        payload["common_problems"] = {"n": len(common), "configs": [asdict(r) for r in shared]}
        markdown += f"\n## The {len(common)} problems every configuration answered\n\n" + render_markdown(shared)
    paths["json"].write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    paths["md"].write_text(markdown, encoding="utf-8")
    if plot:
        try:
            paths["png"] = plot_results(rows, out / "results.png", title)
        except ImportError:
            log.warning("matplotlib is not installed; results.png skipped (pip install 'langchain-safe[eval]')")
    return paths
