"""Benchmark evaluation for SAFE ensembles: load tasks, build prompts, run resumably, grade, report.

Typical use::

    from safe_engine.eval import load_task, make_ensemble_config, run_eval, write_report

    problems = load_task("gsm8k", limit=100)
    configs = {
        "safe": make_ensemble_config(ens, method="safe"),
        "drafter": make_ensemble_config(ens, method="single"),
    }
    run_eval(configs, problems, "out/gsm8k.jsonl")      # rerun the same line to resume
    write_report("out/gsm8k.jsonl", "out/")             # results.json, results.md, results.png
"""

from safe_engine.eval.extract import (
    Score,
    bbh_equal,
    extract_bbh,
    extract_boxed,
    extract_choice,
    extract_gsm8k,
    extract_math_answer,
    extract_number,
    math_equal,
    normalize_math,
    numbers_equal,
    score,
)
from safe_engine.eval.prompts import (
    build_prompt,
    chat_messages,
    fewshot_prompt,
    format_question,
    stop_strings,
)
from safe_engine.eval.report import ConfigRow, aggregate, plot_results, render_markdown, write_report
from safe_engine.eval.runner import (
    ConfigFn,
    completed_keys,
    load_records,
    make_batched_single_config,
    make_ensemble_config,
    problem_seed,
    run_eval,
)
from safe_engine.eval.significance import McNemar, bootstrap_difference, bootstrap_interval, mcnemar
from safe_engine.eval.tasks import (
    TASKS,
    DatasetNotFoundError,
    Problem,
    default_data_dir,
    load_task,
    parse_gsm8k_reference,
)

__all__ = [
    "TASKS",
    "ConfigFn",
    "ConfigRow",
    "DatasetNotFoundError",
    "McNemar",
    "Problem",
    "Score",
    "aggregate",
    "bbh_equal",
    "bootstrap_difference",
    "bootstrap_interval",
    "build_prompt",
    "chat_messages",
    "completed_keys",
    "default_data_dir",
    "extract_bbh",
    "extract_boxed",
    "extract_choice",
    "extract_gsm8k",
    "extract_math_answer",
    "extract_number",
    "fewshot_prompt",
    "format_question",
    "load_records",
    "load_task",
    "make_batched_single_config",
    "make_ensemble_config",
    "math_equal",
    "mcnemar",
    "normalize_math",
    "numbers_equal",
    "parse_gsm8k_reference",
    "plot_results",
    "problem_seed",
    "render_markdown",
    "run_eval",
    "score",
    "stop_strings",
    "write_report",
]
