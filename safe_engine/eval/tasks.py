"""Benchmark loaders: turn the five SAFE benchmarks into one uniform list of :class:`Problem`.

Why one shape: the runner, prompt builders and scorers then never care which file format a benchmark
came in (GSM8K/MATH500/ARC are JSONL, BBH is JSON plus CoT prompt text files, MMLU-redux is a folder
of CSVs with mixed delimiters and encodings).

Data comes from ``data_dir`` (default ``$SAFE_SHARED_DIR/data``, else ``<repo>/../shared/data``); when
the files are not there, the HF ``datasets`` library is tried (lazily imported, optional). If neither
works a :class:`DatasetNotFoundError` says what to do.
"""

from __future__ import annotations

import ast
import csv
import io
import json
import os
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from safe_engine.errors import ConfigError, SafeEngineError

__all__ = [
    "TASKS",
    "DatasetNotFoundError",
    "Problem",
    "default_data_dir",
    "load_task",
    "parse_gsm8k_reference",
]

#: Benchmark families accepted by :func:`load_task` (``bbh`` and ``mmlu-redux`` also take ``:<subtask>``).
TASKS: tuple[str, ...] = ("gsm8k", "math500", "bbh", "arc", "mmlu-redux")

Source = Literal["auto", "local", "hf"]

_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


class DatasetNotFoundError(SafeEngineError, FileNotFoundError):
    """A benchmark could be found neither under ``data_dir`` nor through HF ``datasets``."""


@dataclass(frozen=True)
class Problem:
    """One benchmark question, uniform across tasks.

    Attributes:
        id: unique across all tasks (``"gsm8k/17"``, ``"math500/test/algebra/1.json"``, ``"bbh/navigate/3"``),
            used by the runner to resume.
        task: the benchmark family, one of :data:`TASKS`; picks the prompt and the scorer.
        question: the question text. For BBH it is the task's ``input`` verbatim (options included, as in
            the original prompts); for ARC / MMLU-redux it is the stem only, the options are in ``choices``.
        answer: the reference answer, already reduced to what the scorer compares: a plain number for
            GSM8K, the LaTeX answer for MATH500, a letter for ARC / MMLU-redux, the raw target for BBH.
        choices: option texts for multiple-choice problems, in label order; ``None`` otherwise.
        labels: option labels matching ``choices`` (``("A", "B", "C", "D")``); ``None`` when no choices.
        subtask: BBH task name or MMLU subject; ``None`` for single-part benchmarks.
        fewshot: BBH only: the task's chain-of-thought exemplar block from ``cot-prompts`` (description and
            three ``Q: … A: Let's think step by step. … So the answer is …`` examples).
        meta: anything else worth keeping in the results (MATH level/subject, full solution, source).
    """

    id: str
    task: str
    question: str
    answer: str
    choices: tuple[str, ...] | None = None
    labels: tuple[str, ...] | None = None
    subtask: str | None = None
    fewshot: str | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_multiple_choice(self) -> bool:
        """Whether the problem lists options (ARC, MMLU-redux, and BBH tasks with ``Options:``)."""
        return bool(self.choices)


# --------------------------------------------------------------------------------------------------
# Data directory


def default_data_dir() -> Path:
    """``$SAFE_SHARED_DIR/data`` if set, else ``<repo>/../shared/data`` (where tests and CI find data)."""
    shared = os.environ.get("SAFE_SHARED_DIR")
    if shared:
        return Path(shared) / "data"
    repo = Path(__file__).resolve().parents[2]
    return repo.parent / "shared" / "data"


# --------------------------------------------------------------------------------------------------
# Public entry point


def load_task(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    limit: int | None = None,
    seed: int | None = None,
    *,
    source: Source = "auto",
    include_flagged: bool = False,
) -> list[Problem]:
    """Load a benchmark as a list of problems.

    Args:
        name: ``"gsm8k"``, ``"math500"``, ``"arc"``, ``"bbh"`` (all 27 tasks), ``"bbh:<task>"``,
            ``"mmlu-redux"`` (all subjects) or ``"mmlu-redux:<subject>"`` (with or without ``mmlu_``).
        data_dir: folder holding the benchmark files; default :func:`default_data_dir`.
        limit: keep at most this many problems. For multi-part benchmarks (``bbh``, ``mmlu-redux``) the
            subset is stratified: parts are interleaved round-robin before cutting, so a small limit
            still covers every part.
        seed: ``None`` keeps the first problems (file order); an int draws a reproducible random subset
            (same seed, same subset), returned in file order within each part.
        source: ``"local"`` only reads ``data_dir``; ``"hf"`` only uses HF ``datasets``; ``"auto"``
            reads ``data_dir`` and falls back to ``datasets`` when the files are missing.
        include_flagged: MMLU-redux only. By default questions whose annotated ``error_type`` is not
            ``ok`` (wrong ground truth, unclear question, ...) are dropped, as is usual for MMLU-redux;
            ``True`` keeps them with their original label.
    """
    family, _, sub = name.strip().lower().partition(":")
    family = {
        "mmlu_redux": "mmlu-redux",
        "mmluredux": "mmlu-redux",
        "arc-challenge": "arc",
        "arc_challenge": "arc",
        "math": "math500",
        "math-500": "math500",
    }.get(family, family)
    if family not in TASKS:
        raise _config_error(
            f"unknown task {name!r}; expected one of {', '.join(TASKS)} (bbh and mmlu-redux also accept ':<subtask>')"
        )
    if sub and family not in ("bbh", "mmlu-redux"):
        raise _config_error(f"task {family!r} has no subtasks (got {name!r})")
    if limit is not None and limit < 0:
        raise _config_error(f"limit must be >= 0, got {limit}")
    if source not in ("auto", "local", "hf"):
        raise _config_error(f"source must be 'auto', 'local' or 'hf', got {source!r}")

    root = Path(data_dir) if data_dir is not None else default_data_dir()
    local_loader, hf_loader = _LOADERS[family]
    parts: list[list[Problem]] | None = None
    local_error: Exception | None = None
    if source in ("auto", "local"):
        try:
            parts = local_loader(root, sub or None, include_flagged)
        except FileNotFoundError as exc:
            local_error = exc
            if source == "local":
                raise DatasetNotFoundError(
                    f"{name}: benchmark files not found under {root} ({exc}). Pass data_dir= pointing at "
                    "a folder laid out like ../shared/data, or set SAFE_SHARED_DIR."
                ) from exc
        except (KeyError, TypeError, ValueError, SyntaxError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise _config_error(
                f"{name}: the files under {root} do not look like this benchmark "
                f"({type(exc).__name__}: {exc}); check data_dir"
            ) from exc
    if parts is None:
        parts = _load_hf(name, family, sub or None, include_flagged, hf_loader, root, local_error)
    return _select(parts, limit, seed)


# --------------------------------------------------------------------------------------------------
# Subset selection


def _select(parts: list[list[Problem]], limit: int | None, seed: int | None) -> list[Problem]:
    """Deterministic subset: first N (seed None) or a seeded sample, stratified over parts.

    Which problems are kept is decided round-robin over the parts (after a seeded shuffle of each part
    when ``seed`` is given); the result is always returned grouped by part, in file order, so two runs
    with the same arguments produce identical lists and outputs are easy to diff.
    """
    if limit is None:
        return [p for part in parts for p in part]
    candidates = parts
    if seed is not None:
        rng = random.Random(seed)
        candidates = [rng.sample(part, len(part)) for part in parts]
    keep = {p.id for p in _round_robin(candidates, limit)}
    return [p for part in parts for p in part if p.id in keep]


def _round_robin(parts: Sequence[Sequence[Problem]], limit: int) -> list[Problem]:
    out: list[Problem] = []
    depth = 0
    while len(out) < limit and any(depth < len(part) for part in parts):
        for part in parts:
            if depth < len(part):
                out.append(part[depth])
                if len(out) == limit:
                    break
        depth += 1
    return out


# --------------------------------------------------------------------------------------------------
# GSM8K


def parse_gsm8k_reference(answer: str) -> str:
    """The number after ``####`` in a GSM8K solution, commas removed (``"#### 1,234"`` -> ``"1234"``)."""
    match = re.search(r"####\s*(.+?)\s*$", answer.strip())
    value = match.group(1) if match else answer.strip()
    return value.replace(",", "").replace("$", "").strip()


def _gsm8k_rows(rows: Iterable[dict[str, Any]]) -> list[Problem]:
    return [
        Problem(
            id=f"gsm8k/{i}",
            task="gsm8k",
            question=row["question"],
            answer=parse_gsm8k_reference(row["answer"]),
            meta={"index": i, "solution": row["answer"]},
        )
        for i, row in enumerate(rows)
    ]


def _gsm8k_local(root: Path, sub: str | None, _flagged: bool) -> list[list[Problem]]:
    return [_gsm8k_rows(_read_jsonl(_first_existing(root, ["gsm8k_test.jsonl", "gsm8k/test.jsonl"])))]


def _gsm8k_hf(ds: Any, sub: str | None, _flagged: bool) -> list[list[Problem]]:
    return [_gsm8k_rows(ds.load_dataset("openai/gsm8k", "main", split="test"))]


# --------------------------------------------------------------------------------------------------
# MATH500


def _math_rows(rows: Iterable[dict[str, Any]]) -> list[Problem]:
    out = []
    for i, row in enumerate(rows):
        uid = row.get("unique_id") or str(i)
        out.append(
            Problem(
                id=f"math500/{uid}",
                task="math500",
                question=row["problem"],
                answer=str(row["answer"]),
                meta={
                    "index": i,
                    "subject": row.get("subject"),
                    "level": row.get("level"),
                    "solution": row.get("solution"),
                },
            )
        )
    return out


def _math_local(root: Path, sub: str | None, _flagged: bool) -> list[list[Problem]]:
    path = _first_existing(root, ["math500_test.jsonl", "math500/test.jsonl", "MATH-500/test.jsonl"])
    return [_math_rows(_read_jsonl(path))]


def _math_hf(ds: Any, sub: str | None, _flagged: bool) -> list[list[Problem]]:
    return [_math_rows(ds.load_dataset("HuggingFaceH4/MATH-500", split="test"))]


# --------------------------------------------------------------------------------------------------
# ARC-Challenge


def _arc_rows(rows: Iterable[dict[str, Any]]) -> list[Problem]:
    out = []
    for i, row in enumerate(rows):
        texts = list(row["choices"]["text"])
        raw_labels = [str(x) for x in row["choices"]["label"]]
        labels = _letter_labels(raw_labels)
        key = str(row["answerKey"]).strip()
        answer = labels[raw_labels.index(key)] if key in raw_labels else key
        out.append(
            Problem(
                id=f"arc/{row.get('id') or i}",
                task="arc",
                question=row["question"],
                answer=answer,
                choices=tuple(texts),
                labels=tuple(labels),
                meta={"index": i},
            )
        )
    return out


def _letter_labels(raw: Sequence[str]) -> list[str]:
    """ARC sometimes labels options ``1..4``; the prompts and the scorer always use letters."""
    if all(len(x) == 1 and x.isalpha() for x in raw):
        return [x.upper() for x in raw]
    return list(_LETTERS[: len(raw)])


def _arc_local(root: Path, sub: str | None, _flagged: bool) -> list[list[Problem]]:
    path = _first_existing(root, ["arc_challenge_test.jsonl", "arc/test.jsonl", "arc_challenge/test.jsonl"])
    return [_arc_rows(_read_jsonl(path))]


def _arc_hf(ds: Any, sub: str | None, _flagged: bool) -> list[list[Problem]]:
    return [_arc_rows(ds.load_dataset("allenai/ai2_arc", "ARC-Challenge", split="test"))]


# --------------------------------------------------------------------------------------------------
# BBH

_OPTION_LINE = re.compile(r"^\(([A-Z])\)\s?(.*)$")


def _bbh_options(text: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """Options listed after ``Options:`` in a BBH input, as (labels, texts); None if there are none."""
    idx = text.rfind("Options:")
    if idx < 0:
        return None
    labels, texts = [], []
    for line in text[idx + len("Options:") :].splitlines():
        match = _OPTION_LINE.match(line.strip())
        if match:
            labels.append(match.group(1))
            texts.append(match.group(2).strip())
    return (tuple(labels), tuple(texts)) if labels else None


def _bbh_fewshot(text: str) -> str:
    """Strip the canary header (everything up to the ``-----`` line) from a cot-prompts file."""
    head, sep, tail = text.partition("\n-----\n")
    return (tail if sep else head).strip()


def _bbh_rows(task: str, rows: Iterable[dict[str, Any]], fewshot: str | None) -> list[Problem]:
    out = []
    for i, row in enumerate(rows):
        opts = _bbh_options(row["input"])
        out.append(
            Problem(
                id=f"bbh/{task}/{i}",
                task="bbh",
                question=row["input"],
                answer=str(row["target"]).strip(),
                choices=opts[1] if opts else None,
                labels=opts[0] if opts else None,
                subtask=task,
                fewshot=fewshot,
                meta={"index": i},
            )
        )
    return out


def _bbh_local(root: Path, sub: str | None, _flagged: bool) -> list[list[Problem]]:
    bbh_dir = root if (root / "tasks").is_dir() else root / "bbh"  # data_dir may be the bbh folder itself
    tasks_dir = bbh_dir / "tasks"
    if not tasks_dir.is_dir():
        raise FileNotFoundError(str(tasks_dir))
    names = sorted(p.stem for p in tasks_dir.glob("*.json"))
    if sub is not None:
        if sub not in names:
            raise _config_error(f"unknown BBH task {sub!r}; available: {', '.join(names)}")
        names = [sub]
    parts = []
    for task in names:
        data = json.loads((tasks_dir / f"{task}.json").read_text(encoding="utf-8"))
        cot = bbh_dir / "cot-prompts" / f"{task}.txt"
        fewshot = _bbh_fewshot(cot.read_text(encoding="utf-8")) if cot.is_file() else None
        parts.append(_bbh_rows(task, data["examples"], fewshot))
    return parts


def _bbh_hf(ds: Any, sub: str | None, _flagged: bool) -> list[list[Problem]]:
    # The CoT exemplars are not on the hub; BBH from HF is therefore zero-shot (fewshot=None).
    names = [sub] if sub else sorted(ds.get_dataset_config_names("lukaemon/bbh"))
    return [_bbh_rows(t, ds.load_dataset("lukaemon/bbh", t, split="test"), None) for t in names]


# --------------------------------------------------------------------------------------------------
# MMLU-redux


def _normalise_subject(sub: str) -> str:
    return sub.removeprefix("mmlu_").replace("-", "_")


def _parse_choices(raw: Any) -> list[str]:
    """Choices are stored as a JSON list in most CSVs and as a Python list literal in a few."""
    if isinstance(raw, list | tuple):
        return [str(x) for x in raw]
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, TypeError):
        value = ast.literal_eval(raw)
    return [str(x) for x in value]


def _mmlu_rows(subject: str, rows: Iterable[dict[str, Any]], include_flagged: bool) -> list[Problem]:
    out = []
    for i, row in enumerate(rows):
        error_type = str(row.get("error_type") or "ok").strip().lower().replace("_", " ")
        if error_type != "ok" and not include_flagged:
            continue
        choices = _parse_choices(row["choices"])
        answer = str(row["answer"]).strip()
        letter = _LETTERS[int(answer)] if answer.isdigit() else answer.upper()
        out.append(
            Problem(
                id=f"mmlu-redux/{subject}/{i}",
                task="mmlu-redux",
                question=str(row["question"]),
                answer=letter,
                choices=tuple(choices),
                labels=tuple(_LETTERS[: len(choices)]),
                subtask=subject,
                meta={"index": i, "error_type": error_type},
            )
        )
    return out


def _read_csv_rows(path: Path) -> list[dict[str, str]]:
    """MMLU-redux CSVs mix ``,``/``;`` delimiters, BOMs and one MacRoman-encoded file; read them all."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = raw.decode("mac_roman")
    header = text.split("\n", 1)[0]
    delimiter = ";" if header.count(";") > header.count(",") else ","
    reader = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
    return [{(k or "").strip(): v for k, v in row.items()} for row in reader]


def _mmlu_local(root: Path, sub: str | None, include_flagged: bool) -> list[list[Problem]]:
    folder = _first_existing(root, ["mmlu_redux", "mmlu-redux"]) if not any(root.glob("*.csv")) else root
    files = {p.stem.removeprefix("mmlu_"): p for p in sorted(folder.glob("*.csv"))}
    if not files:
        raise FileNotFoundError(f"no CSV files in {folder}")
    names = sorted(files)
    if sub is not None:
        subject = _normalise_subject(sub)
        if subject not in files:
            raise _config_error(f"unknown MMLU-redux subject {sub!r}; available: {', '.join(names)}")
        names = [subject]
    return [_mmlu_rows(s, _read_csv_rows(files[s]), include_flagged) for s in names]


def _mmlu_hf(ds: Any, sub: str | None, include_flagged: bool) -> list[list[Problem]]:
    repo = "edinburgh-dawg/mmlu-redux"
    names = [_normalise_subject(sub)] if sub else sorted(ds.get_dataset_config_names(repo))
    return [_mmlu_rows(s, ds.load_dataset(repo, s, split="test"), include_flagged) for s in names]


# --------------------------------------------------------------------------------------------------
# Shared helpers

LocalLoader = Callable[[Path, str | None, bool], list[list[Problem]]]
HFLoader = Callable[[Any, str | None, bool], list[list[Problem]]]

_LOADERS: dict[str, tuple[LocalLoader, HFLoader]] = {
    "gsm8k": (_gsm8k_local, _gsm8k_hf),
    "math500": (_math_local, _math_hf),
    "arc": (_arc_local, _arc_hf),
    "bbh": (_bbh_local, _bbh_hf),
    "mmlu-redux": (_mmlu_local, _mmlu_hf),
}


def _load_hf(
    name: str,
    family: str,
    sub: str | None,
    include_flagged: bool,
    loader: HFLoader,
    root: Path,
    local_error: Exception | None,
) -> list[list[Problem]]:
    where = f"not found under {root}" if local_error is not None else "local files not used"
    try:
        import datasets  # optional dependency, imported only when the local files are missing
    except ImportError as exc:
        raise DatasetNotFoundError(
            f"{name}: benchmark files {where}, and the HF 'datasets' package is not installed. Pass "
            "data_dir= pointing at a folder laid out like ../shared/data, set SAFE_SHARED_DIR, or "
            "`pip install datasets` (needs network access or a populated HF cache)."
        ) from exc
    try:
        return loader(datasets, sub, include_flagged)
    except SafeEngineError:
        raise
    except Exception as exc:  # network down, dataset renamed, cache empty ...
        raise DatasetNotFoundError(
            f"{name}: benchmark files {where}, and loading it through HF datasets failed "
            f"({type(exc).__name__}: {exc}). Pass data_dir= or set SAFE_SHARED_DIR."
        ) from exc


def _first_existing(root: Path, candidates: Sequence[str]) -> Path:
    """``root/<first candidate that exists>``; ``root`` itself when it is a file (``data_dir=x.jsonl``)."""
    if root.is_file():
        return root
    for rel in candidates:
        path = root / rel
        if path.exists():
            return path
    raise FileNotFoundError(" or ".join(str(root / rel) for rel in candidates))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _config_error(message: str) -> ConfigError:
    return ConfigError(message)
