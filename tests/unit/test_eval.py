"""Evaluation harness: answer extraction, grading, loaders on the real benchmark files, prompts, the
resumable runner and the report. Fast: no models (the runner is driven by plain Python callables)."""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

from safe_engine.eval import (
    DatasetNotFoundError,
    Problem,
    aggregate,
    bbh_equal,
    chat_messages,
    completed_keys,
    default_data_dir,
    extract_bbh,
    extract_boxed,
    extract_choice,
    extract_math_answer,
    extract_number,
    fewshot_prompt,
    load_records,
    load_task,
    make_ensemble_config,
    math_equal,
    normalize_math,
    numbers_equal,
    parse_gsm8k_reference,
    problem_seed,
    run_eval,
    score,
    stop_strings,
    write_report,
)

DATA = default_data_dir()


@pytest.fixture(scope="module")
def data_dir() -> Path:
    if not (DATA / "gsm8k_test.jsonl").is_file():
        pytest.fail(f"benchmark data not found at {DATA}; set SAFE_SHARED_DIR to the shared/ folder")
    return DATA


# ==================================================================================================
# GSM8K


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 18.", "18"),
        ("Janet sells 16 - 3 - 4 = 9 eggs and makes 9 * 2 = $18.\nThe answer is 18", "18"),
        ("She makes $1,234.50 per week.", "1234.5"),
        ("The total cost is $1,234.50.", "1234.5"),
        ("The answer is: $1,000", "1000"),
        ("So he has -5 dollars left. The answer is -5.", "-5"),
        ("The temperature dropped to −12 degrees. The answer is −12.", "-12"),
        ("It takes 3.75 hours in total.", "3.75"),
        ("The answer is 42 apples.", "42"),
        ("He walks 5 miles a day, so 7 * 5 = 35 miles per week.", "35"),
        ("First 12, then 30, finally 7 + 3 = 10 cookies", "10"),
        ("The answer is **72**.", "72"),
        ("#### 128", "128"),
        ("Final answer: \\boxed{1,200}", "1200"),
        ("The answer is 16 - 3 = 13.", "13"),
        (
            "Step 1: 2 + 2 = 4.\nStep 2: 4 * 10 = 40.\n\nThe answer is 40.\n\nHope 3 helps.",
            "40",
        ),
        ("The answer is 2.50 dollars", "2.5"),
        ("He needs 0.5 liters.", "0.5"),
        ("The answer is 100%.", "100"),
        ("There are 1,000,000 grains.", "1000000"),
        ("To answer this, 3 * 4 = 12 apples.\nShe buys 8 more, so 20 apples.", "20"),
        ("Answer: 5 is wrong.\nFinal answer:\n\n**42**", "42"),
        ("The answer is:\n\n$1,200", "1200"),
    ],
)
def test_extract_number(text: str, expected: str) -> None:
    assert extract_number(text) == expected


def test_extract_number_none_and_equality() -> None:
    assert extract_number("") is None
    assert extract_number("no digits here") is None
    assert numbers_equal("18.00", "18")
    assert numbers_equal("$1,234.5", "1234.50")
    assert numbers_equal("-3", "−3")
    assert not numbers_equal("18", "19")
    assert not numbers_equal(None, "1")
    assert numbers_equal("1000000.0001", "1000000") and not numbers_equal("1000.01", "1000")
    huge = "9" * 400  # a model looping on one digit: no float overflow, just not equal
    assert extract_number(f"So the answer is {huge}") == huge and not numbers_equal(huge, "18")
    assert not score(Problem(id="g", task="gsm8k", question="?", answer="18"), f"The answer is {huge}.").correct


@pytest.mark.parametrize(
    ("solution", "expected"),
    [
        ("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18", "18"),
        ("#### 1,234", "1234"),
        ("so the loss is 5\n#### -5", "-5"),
        ("#### 0.5", "0.5"),
    ],
)
def test_parse_gsm8k_reference(solution: str, expected: str) -> None:
    assert parse_gsm8k_reference(solution) == expected


def test_all_gsm8k_references_are_numbers(data_dir: Path) -> None:
    problems = load_task("gsm8k", data_dir)
    assert all(extract_number(p.answer) is not None for p in problems)
    assert all(numbers_equal(extract_number(f"The answer is {p.answer}."), p.answer) for p in problems)
    first = problems[0]
    assert first.answer == "18" and score(first, "... so she makes $18 a day. The answer is 18.").correct


# ==================================================================================================
# MATH500


def test_extract_boxed_nested_braces() -> None:
    text = r"So $x = \boxed{\frac{1}{\sqrt{2}}}$ first, but finally \boxed{\left( 3, \frac{\pi}{2} \right)}."
    assert extract_boxed(text) == r"\left( 3, \frac{\pi}{2} \right)"
    assert extract_boxed(r"\boxed{\frac{a^{2}}{b_{1}}}") == r"\frac{a^{2}}{b_{1}}"
    assert extract_boxed(r"The area is \fbox{12}.") == "12"
    assert extract_boxed(r"\boxed 5$.") == "5"
    assert extract_boxed("no box here") is None
    assert extract_boxed(r"\boxed{unbalanced") is None


def test_extract_math_answer_fallback() -> None:
    assert extract_math_answer(r"Thus the final answer is $\frac{3}{4}$. I hope") == r"\frac{3}{4}"
    assert extract_math_answer("The answer is 12.") == "12"
    assert extract_math_answer("no answer") is None


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (r"\frac{1}{2}", "0.5"),
        (r"\frac{1}{2}", r"\dfrac12"),
        ("0.5", r"\dfrac12"),
        (r"\tfrac{1}{2}", "1/2"),
        (r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})"),
        (r"10^\circ", "10"),
        (r"90^{\circ}", "90"),
        (r"\text{(C)}", "C"),
        (r"\textbf{(B)}", "(B)"),
        (r"\$18.50", "18.5"),
        (r"10\text{ inches}", "10"),
        (r"5\text{ cm}^2", "5"),
        ("x = 5", "5"),
        (r"\sqrt2", r"\sqrt{2}"),
        (r"2\sqrt{2}", r"\sqrt{8}"),
        (r"\frac{\sqrt{3}}{2}", r"\frac{1}{2}\sqrt{3}"),
        (r"\frac{\pi}{2}", r"\frac12\pi"),
        (r"3\pi", r"\pi \cdot 3"),
        ("1,-2", "-2, 1"),
        ("[2, 5)", r"\left[ 2,5 \right)"),
        ("1{,}000", "1000"),
        ("1,000", "1000"),
        ("50\\%", "50"),
        ("2.50", r"\frac{5}{2}"),
        ("p - q", "-q + p"),
        (r"x^2+2x+1", "(x+1)^2"),
        ("52_8", "52_{8}"),
        (r"\text{Evelyn}", "Evelyn"),
        ("$6 - 5i$", "6-5i"),
        ("12.", "12"),
    ],
)
def test_math_equal_equivalent(a: str, b: str) -> None:
    assert math_equal(a, b)
    assert math_equal(b, a)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (r"\frac{1}{3}", "0.33"),
        ("(3,2)", "(2,3)"),
        ("[2,5)", "(2,5)"),
        ("p - q", "q - p"),
        ("C", "D"),
        ("10", "100"),
        (r"\sqrt{2}", "2"),
        (r"\pi", "3.14"),
        ("x^2", "x^3"),
        ("1,2", "1,2,3"),
        (r"\text{Evelyn}", "Emily"),
        ("", "0"),
    ],
)
def test_math_equal_different(a: str, b: str) -> None:
    assert not math_equal(a, b)
    assert not math_equal(b, a)


def test_math_equal_none() -> None:
    assert not math_equal(None, "1")


def _reformat(answer: str) -> str:
    """The same answer written differently: spaces, \\left/\\right, \\dfrac, $…$, trailing period."""
    out = answer.replace("\\frac", "\\dfrac")
    if "[" not in out:  # wrapping "[a, b)" in \left…\right would still be fine, but keep brackets as-is
        out = out.replace("\\left(", "(").replace("\\right)", ")")
        out = out.replace("(", "\\left( ").replace(")", " \\right)")
    out = out.replace(",", " , ").replace("+", " + ").replace("=", " = ")
    return f"$ {out} $."


def test_math500_references_equal_reformatted_self(data_dir: Path) -> None:
    problems = load_task("math500", data_dir)
    assert len(problems) == 500
    # the first 20 real answers, spelled out so a failure names the case
    for p in problems[:20]:
        reformatted = _reformat(p.answer)
        assert reformatted != p.answer
        assert math_equal(reformatted, p.answer), (p.id, p.answer, normalize_math(reformatted))
        assert score(p, f"Hence the answer is $\\boxed{{{reformatted.strip('$. ')}}}$.").correct, p.id
    # and every other one
    bad = [p.answer for p in problems if not math_equal(_reformat(p.answer), p.answer)]
    assert bad == []


def test_math500_all_references_self_equal(data_dir: Path) -> None:
    """Every real reference grades as correct when the model boxes it verbatim (no false negatives)."""
    bad = [p.answer for p in load_task("math500", data_dir) if not score(p, f"\\boxed{{{p.answer}}}").correct]
    assert bad == []


def test_math_equal_sympy_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hanging symbolic check is abandoned after the timeout and counts as not equal."""
    sympy = pytest.importorskip("sympy")

    def slow(expr: Any) -> Any:
        time.sleep(3)
        return expr

    monkeypatch.setattr(sympy, "simplify", slow)
    start = time.perf_counter()
    assert not math_equal("x + y", "y + x", timeout=0.2)
    assert time.perf_counter() - start < 2


def test_math_equal_without_sympy(monkeypatch: pytest.MonkeyPatch) -> None:
    """sympy is optional: numeric and string cases still work when it cannot be imported."""
    monkeypatch.setitem(sys.modules, "sympy", None)
    assert math_equal(r"\frac{1}{2}", "0.5")
    assert math_equal(r"2\sqrt{2}", r"\sqrt{8}")
    assert math_equal(r"\left( 3, \frac{\pi}{2} \right)", r"(3,\frac{\pi}{2})")
    assert not math_equal("p - q", "-q + p")  # needs symbolic algebra
    assert not math_equal("1", "2")


# ==================================================================================================
# Multiple choice and BBH


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is (B).", "B"),
        ("Answer: C", "C"),
        ("answer is D", "D"),
        ("I first thought A, but the answer is B.", "B"),
        ("The correct option is **C**.", "C"),
        ("\\boxed{C}", "C"),
        ("\\boxed{\\text{(A)}}", "A"),
        ("Option (A) is wrong and (D) fits best.", "D"),
        ("The answer is C. Planetary days will become shorter.", "C"),
        ("Because of conservation of angular momentum...\nPlanetary days will become shorter.", "C"),
        ("After elimination we are left with D", "D"),
        ("A planet spins faster.", None),
        ("", None),
        ("The answer is (E).", None),  # not one of the four labels
    ],
)
def test_extract_choice(text: str, expected: str | None) -> None:
    choices = [
        "Planetary density will decrease.",
        "Planetary years will become longer.",
        "Planetary days will become shorter.",
        "Planetary gravity will become stronger.",
    ]
    assert extract_choice(text, ("A", "B", "C", "D"), choices) == expected


def test_extract_choice_five_labels() -> None:
    assert extract_choice("The answer is (E).", ("A", "B", "C", "D", "E")) == "E"


@pytest.fixture(scope="module")
def bbh_by_task(data_dir: Path) -> dict[str, Problem]:
    return {p.subtask or "": p for p in load_task("bbh", data_dir, limit=27)}


@pytest.mark.parametrize(
    ("task", "output", "target", "expected"),
    [
        ("date_understanding", "... that is 12/14/1937. So the answer is (D).", "(D)", True),
        ("date_understanding", "So the answer is (B).", "(D)", False),
        ("boolean_expressions", "not ( True ) is False. So the answer is False.", "False", True),
        ("boolean_expressions", "So the answer is True.", "False", False),
        ("causal_judgement", "So the answer is **Yes**.", "Yes", True),
        ("sports_understanding", "So the answer is yes.", "yes", True),
        ("navigate", "We end at (0, 0). So the answer is No.", "No", True),
        ("formal_fallacies", "So the answer is invalid.", "invalid", True),
        ("formal_fallacies", "So the answer is valid.", "invalid", False),
        ("multistep_arithmetic_two", "(-3 + 5) * 2 = 4. So the answer is 4.", "4", True),
        ("multistep_arithmetic_two", "So the answer is -10.", "-10", True),
        ("object_counting", "So the answer is 12.", "12", True),
        ("word_sorting", "So the answer is abbas average Bridesmaid.", "abbas average bridesmaid", True),
        ("word_sorting", "So the answer is average abbas.", "abbas average", False),
        ("dyck_languages", "So the answer is ) ] }.", ") ] }", True),
        ("dyck_languages", "So the answer is )]}", ") ] }", True),
        ("dyck_languages", "So the answer is ) }", ") ] }", False),
    ],
)
def test_bbh_grading(bbh_by_task: dict[str, Problem], task: str, output: str, target: str, expected: bool) -> None:
    base = bbh_by_task[task]
    problem = Problem(
        id="x",
        task="bbh",
        question=base.question,
        answer=target,
        choices=base.choices,
        labels=base.labels,
        subtask=task,
    )
    assert bbh_equal(extract_bbh(output, problem), target) is expected
    assert score(problem, output).correct is expected


def test_bbh_written_out_target_with_option_letter() -> None:
    """movie_recommendation has a target written as text; a model answering by letter is mapped back."""
    problem = Problem(
        id="m",
        task="bbh",
        question="Find a movie...\nOptions:\n(A) Monsters, Inc\n(B) Heat",
        answer="Monsters, Inc",
        choices=("Monsters, Inc", "Heat"),
        labels=("A", "B"),
        subtask="movie",
    )
    assert score(problem, "So the answer is (A).").correct
    assert score(problem, "So the answer is Monsters, Inc.").correct
    assert not score(problem, "So the answer is (B).").correct


# ==================================================================================================
# Loaders on the real files


def test_loader_counts(data_dir: Path) -> None:
    assert len(load_task("gsm8k", data_dir)) == 1319
    assert len(load_task("math500", data_dir)) == 500
    assert len(load_task("arc", data_dir)) == 1172
    bbh = load_task("bbh", data_dir)
    assert len({p.subtask for p in bbh}) == 27 and len(bbh) == 6511
    assert len(load_task("bbh:navigate", data_dir)) == 250
    assert len(load_task("mmlu-redux", data_dir, include_flagged=True)) == 5700
    ok_only = load_task("mmlu-redux", data_dir)
    assert 5000 < len(ok_only) < 5700 and all(p.meta["error_type"] == "ok" for p in ok_only)


@pytest.mark.parametrize(
    "name", ["gsm8k", "math500", "bbh", "bbh:date_understanding", "arc", "mmlu-redux", "mmlu-redux:virology"]
)
def test_each_task_loads_with_limit(data_dir: Path, name: str) -> None:
    problems = load_task(name, data_dir, limit=5)
    assert len(problems) == 5
    assert len({p.id for p in problems}) == 5
    for p in problems:
        assert p.question and p.answer and p.task == name.split(":")[0]
        if p.task in ("arc", "mmlu-redux"):
            assert p.choices and p.labels and p.answer in p.labels
        if p.task == "bbh":
            assert p.fewshot and p.fewshot.count("Q: ") == 3 and "canary" not in p.fewshot


def test_problem_fields(data_dir: Path) -> None:
    gsm = load_task("gsm8k", data_dir, limit=1)[0]
    assert gsm.id == "gsm8k/0" and gsm.answer == "18" and gsm.choices is None
    math = load_task("math500", data_dir, limit=1)[0]
    assert math.answer == r"\left( 3, \frac{\pi}{2} \right)" and math.meta["level"] == 2
    arc = load_task("arc", data_dir, limit=1)[0]
    assert arc.id == "arc/Mercury_7175875" and arc.answer == "C" and arc.labels == ("A", "B", "C", "D")
    date = load_task("bbh:date_understanding", data_dir, limit=1)[0]
    assert date.answer == "(B)" and date.labels == ("A", "B", "C", "D", "E", "F")
    assert date.choices is not None and date.choices[1] == "12/25/1937"
    mmlu = load_task("mmlu-redux:mmlu_moral_scenarios", data_dir, limit=3)  # the MacRoman-encoded file
    assert all(len(p.choices or ()) == 4 for p in mmlu)


def test_subset_selection_is_deterministic(data_dir: Path) -> None:
    first = load_task("gsm8k", data_dir, limit=10)
    assert [p.id for p in first] == [f"gsm8k/{i}" for i in range(10)]
    a = load_task("gsm8k", data_dir, limit=10, seed=3)
    b = load_task("gsm8k", data_dir, limit=10, seed=3)
    c = load_task("gsm8k", data_dir, limit=10, seed=4)
    assert [p.id for p in a] == [p.id for p in b] != [p.id for p in first]
    assert [p.id for p in a] != [p.id for p in c]
    assert [p.meta["index"] for p in a] == sorted(p.meta["index"] for p in a)  # file order
    strat = load_task("bbh", data_dir, limit=27, seed=0)
    assert len({p.subtask for p in strat}) == 27  # stratified: one per task
    assert len(load_task("arc", data_dir, limit=0)) == 0


def test_data_dir_from_env(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAFE_SHARED_DIR", str(data_dir.parent))
    assert default_data_dir() == data_dir
    assert len(load_task("math500", limit=2)) == 2


def test_data_dir_may_name_a_file_or_subfolder(data_dir: Path) -> None:
    assert len(load_task("gsm8k", data_dir / "gsm8k_test.jsonl", limit=3)) == 3
    assert len(load_task("bbh:navigate", data_dir / "bbh")) == 250
    assert len(load_task("mmlu-redux:virology", data_dir / "mmlu_redux")) == len(
        load_task("mmlu-redux:virology", data_dir)
    )
    with pytest.raises(ValueError, match="do not look like"):
        load_task("math500", data_dir / "gsm8k_test.jsonl")


def test_load_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown task"):
        load_task("nope", tmp_path)
    with pytest.raises(ValueError, match="no subtasks"):
        load_task("gsm8k:foo", tmp_path)
    with pytest.raises(ValueError, match="unknown BBH task"):
        load_task("bbh:nope", default_data_dir())
    monkeypatch.setitem(sys.modules, "datasets", None)  # HF datasets "not installed"
    with pytest.raises(DatasetNotFoundError, match="datasets"):
        load_task("gsm8k", tmp_path)
    with pytest.raises(FileNotFoundError, match="data_dir"):
        load_task("math500", tmp_path, source="local")


def test_hf_datasets_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the files are missing, HF ``datasets`` is used (a stand-in module here: no network)."""
    calls: list[tuple[Any, ...]] = []

    def load_dataset(*args: Any, split: str) -> list[dict[str, Any]]:
        calls.append((*args, split))
        if args[0] == "openai/gsm8k":
            return [{"question": "1+1?", "answer": "1+1=2\n#### 2"}]
        if args[0] == "allenai/ai2_arc":
            return [
                {
                    "id": "q1",
                    "question": "Pick",
                    "answerKey": "2",
                    "choices": {"text": ["x", "y", "z", "w"], "label": ["1", "2", "3", "4"]},
                }
            ]
        raise ConnectionError("offline")

    fake = types.SimpleNamespace(load_dataset=load_dataset, get_dataset_config_names=lambda repo: [])
    monkeypatch.setitem(sys.modules, "datasets", fake)
    (gsm,) = load_task("gsm8k", tmp_path)
    assert gsm.answer == "2" and calls[0] == ("openai/gsm8k", "main", "test")
    (arc,) = load_task("arc", tmp_path)
    assert arc.answer == "B" and arc.labels == ("A", "B", "C", "D")  # numeric labels become letters
    with pytest.raises(DatasetNotFoundError, match="offline"):
        load_task("math500", tmp_path)


# ==================================================================================================
# Prompts


def test_chat_prompts(data_dir: Path) -> None:
    gsm = load_task("gsm8k", data_dir, limit=1)[0]
    (msg,) = chat_messages(gsm)
    assert msg["role"] == "user" and gsm.question in msg["content"] and "The answer is" in msg["content"]
    math = load_task("math500", data_dir, limit=1)[0]
    assert "\\boxed{}" in chat_messages(math)[-1]["content"]
    arc = load_task("arc", data_dir, limit=1)[0]
    content = chat_messages(arc)[-1]["content"]
    assert "(C) Planetary days will become shorter." in content and "The answer is (X)" in content
    bbh = load_task("bbh:date_understanding", data_dir, limit=1)[0]
    msgs = chat_messages(bbh)
    assert [m["role"] for m in msgs] == ["user", "assistant"] * 3 + ["user"]
    assert msgs[0]["content"].startswith("Infer the date from context.")
    assert msgs[1]["content"].startswith("Let's think step by step.") and "So the answer is (D)." in msgs[1]["content"]
    assert len(chat_messages(bbh, fewshot=False)) == 1


def test_fewshot_prompts_and_stops(data_dir: Path) -> None:
    gsm = load_task("gsm8k", data_dir, limit=1)[0]
    text = fewshot_prompt(gsm)
    assert text.endswith(f"Question: {gsm.question}\nAnswer:") and text.count("The answer is") == 4
    assert stop_strings(gsm)[0] == "\n\nQuestion:" and stop_strings(gsm, chat=True) == ()
    math = load_task("math500", data_dir, limit=1)[0]
    assert fewshot_prompt(math).endswith("\nSolution:") and "\\boxed{" in fewshot_prompt(math)
    assert stop_strings("math500")[0] == "\n\nProblem:"
    bbh = load_task("bbh:navigate", data_dir, limit=1)[0]
    text = fewshot_prompt(bbh)
    assert (
        text.startswith("Given a series of navigation instructions") and text.count("\nQ: ") == 4
    )  # 3 exemplars + the question
    assert text.endswith("A: Let's think step by step.") and stop_strings(bbh)[0] == "\n\nQ:"
    mmlu = load_task("mmlu-redux", data_dir, limit=1)[0]
    assert "(D) No." in fewshot_prompt(mmlu)


# ==================================================================================================
# Runner


def _problems(n: int) -> list[Problem]:
    return [Problem(id=f"p{i}", task="gsm8k", question=f"{i}+1?", answer=str(i + 1)) for i in range(n)]


class FakeConfig:
    """Deterministic canned outputs; counts calls; optionally fails after ``fail_after`` calls."""

    def __init__(self, right: bool, fail_after: int | None = None) -> None:
        self.right, self.fail_after, self.calls = right, fail_after, []

    def __call__(self, problem: Problem) -> dict[str, Any]:
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise RuntimeError("interrupted")
        self.calls.append(problem.id)
        value = int(problem.answer) + (0 if self.right else 1)
        return {
            "text": f"So the answer is {value}.",
            "tokens": 10,
            "ensembled_tokens": 1 if self.right else 0,
            "wall_time_s": 0.5,
            "finish_reason": "eos",
        }


def test_runner_resumes_after_interruption(tmp_path: Path) -> None:
    out = tmp_path / "run" / "results.jsonl"
    problems = _problems(6)
    good, bad = FakeConfig(True, fail_after=3), FakeConfig(False)
    with pytest.raises(RuntimeError, match="interrupted"):
        run_eval({"good": good, "bad": bad}, problems, out, progress=False)
    # problem-major order: p0..p2 done for both, "good" failed on p3 before "bad" ran p3
    assert good.calls == ["p0", "p1", "p2"] and bad.calls == ["p0", "p1", "p2"]
    assert completed_keys(out) == {(c, f"p{i}") for c in ("good", "bad") for i in range(3)}

    good2, bad2 = FakeConfig(True), FakeConfig(False)
    records = run_eval({"good": good2, "bad": bad2}, problems, out, progress=False)
    assert good2.calls == ["p3", "p4", "p5"] and bad2.calls == ["p3", "p4", "p5"]
    assert len(records) == 12 and len(load_records(out)) == 12
    assert all(r["correct"] for r in records if r["config"] == "good")
    assert not any(r["correct"] for r in records if r["config"] == "bad")
    rec = next(r for r in records if r["config"] == "good" and r["problem_id"] == "p4")
    assert rec["prediction"] == "5" and rec["reference"] == "5" and rec["tokens"] == 10
    assert rec["text"] == "So the answer is 5." and rec["finish_reason"] == "eos" and rec["task"] == "gsm8k"

    third = FakeConfig(True)
    assert len(run_eval({"good": third}, problems, out, progress=False)) == 6
    assert third.calls == []  # nothing left to do


def test_runner_torn_line_and_skip_errors(tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    problems = _problems(3)
    run_eval({"a": FakeConfig(True)}, problems[:1], out, progress=False)
    with out.open("a", encoding="utf-8") as fh:
        fh.write('{"config": "a", "problem_id": "p1", "te')  # killed mid-write
    flaky = FakeConfig(True, fail_after=1)
    records = run_eval({"a": flaky}, problems, out, progress=False, on_error="skip")
    assert flaky.calls == ["p1"] and {r["problem_id"] for r in records} == {"p0", "p1"}
    again = FakeConfig(True)
    records = run_eval({"a": again}, problems, out, progress=False)
    assert again.calls == ["p2"] and len(records) == 3
    assert len(load_records(out)) == 3


def test_runner_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unique"):
        run_eval({"a": FakeConfig(True)}, _problems(2) * 2, tmp_path / "x.jsonl", progress=False)
    with pytest.raises(KeyError, match="text"):
        run_eval({"a": lambda p: {"tokens": 1}}, _problems(1), tmp_path / "y.jsonl", progress=False)


class FakeEnsemble:
    """Records generate() calls and answers like the contract's GenerationResult."""

    def __init__(self, text: str) -> None:
        self.text, self.calls = text, []

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((args, kwargs))
        stats = types.SimpleNamespace(
            tokens=20,
            ensembled_tokens=2,
            ensemble_rate=0.1,
            wall_time_s=0.25,
            tokens_per_s=80.0,
            replaced_tokens=1,
            discarded_draft_tokens=3,
            forward_passes={"a": 9, "b": 4},
        )
        return types.SimpleNamespace(text=self.text, finish_reason="stop", stats=stats)


def test_make_ensemble_config_chat_and_text(tmp_path: Path) -> None:
    (problem,) = _problems(1)
    ens = FakeEnsemble("1 + 1 = 2. The answer is 1.\n\nQuestion: what next? The answer is 7.")
    chat_cfg = make_ensemble_config(ens, method="safe", aggregation="gac", seed=7, max_new_tokens=64)
    rec = chat_cfg(problem)
    args, kwargs = ens.calls[-1]
    assert args == () and kwargs["messages"][0]["role"] == "user"
    assert kwargs["method"] == "safe" and kwargs["aggregation"] == "gac" and kwargs["max_new_tokens"] == 64
    assert kwargs["seed"] == problem_seed(7, "p0") and "stop" not in kwargs
    assert rec["tokens"] == 20 and rec["ensembled_tokens"] == 2 and rec["wall_time_s"] == 0.25
    assert rec["ensemble_rate"] == 0.1 and rec["tokens_per_s"] == 80.0 and rec["finish_reason"] == "stop"
    assert rec["replaced_tokens"] == 1 and rec["discarded_draft_tokens"] == 3
    assert rec["forward_passes"] == {"a": 9, "b": 4} and rec["cpu_time_s"] >= 0

    text_cfg = make_ensemble_config(ens, method="single", chat=False, draft_length=3)
    rec = text_cfg(problem)
    args, kwargs = ens.calls[-1]
    assert isinstance(args[0], str) and args[0].endswith("Question: 0+1?\nAnswer:")
    assert kwargs["stop"] == stop_strings("gsm8k") and kwargs["draft_length"] == 3 and "seed" not in kwargs
    assert rec["text"] == "1 + 1 = 2. The answer is 1."  # cut at the stop string
    assert rec["method"] == "single" and rec["chat"] is False

    records = run_eval({"text": text_cfg}, [problem], tmp_path / "e.jsonl", progress=False)
    assert records[0]["correct"] and records[0]["prediction"] == "1"


def test_batched_single_config_answers_like_the_engines_single_method(tmp_path: Path) -> None:
    """Left-padded batches (prompts of different lengths) give the engine's own greedy answers."""
    from safe_engine import Ensemble
    from safe_engine.eval import make_batched_single_config
    from tests.conftest import tiny_member

    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    member = tiny_member("qwen2.5-7b-instruct", 3)
    questions = ["1+1?", "What is seven times six, in words?", "2?", "Tom has 3 apples and eats one. How many?", "x"]
    problems = [Problem(id=f"q{i}", task="gsm8k", question=q, answer="0") for i, q in enumerate(questions)]
    batched = make_batched_single_config(member, problems, batch_size=3, max_new_tokens=12)
    engine = make_ensemble_config(Ensemble([member]), method="single", max_new_tokens=12)
    records = run_eval({"batched": batched, "engine": engine}, problems, tmp_path / "b.jsonl", progress=False)
    got = {(r["config"], r["problem_id"]): r for r in records}
    for p in problems:
        b, e = got["batched", p.id], got["engine", p.id]
        assert b["text"] == e["text"] and b["tokens"] == e["tokens"] and b["finish_reason"] == e["finish_reason"]
        assert b["method"] == "hf_generate_batched" and b["batch_size"] in (3, 2) and b["wall_time_s"] > 0


def test_batched_single_config_stop_strings(tmp_path: Path) -> None:
    """A stop string ends a row's answer: text cut before it, finish "stop", tokens up to it; CPU time kept."""
    from safe_engine.eval import make_batched_single_config
    from tests.conftest import tiny_member

    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    member = tiny_member("qwen2.5-7b-instruct", 3)
    problems = [Problem(id=f"q{i}", task="gsm8k", question=q, answer="0") for i, q in enumerate(["1+1?", "2+2?"])]
    free = make_batched_single_config(member, problems, batch_size=2, max_new_tokens=12)
    plain = {p.id: free(p) for p in problems}
    text = plain["q0"]["text"]
    stop = text[len(text) // 2 :][:2]  # two characters from the middle of the first answer
    assert stop.strip() and plain["q0"]["finish_reason"] == "length" and "cpu_time_s" in plain["q0"]
    stopped = make_batched_single_config(member, problems, batch_size=2, max_new_tokens=12, stop=(stop,))
    got = {p.id: stopped(p) for p in problems}
    assert got["q0"]["text"] == text[: text.index(stop)] and got["q0"]["finish_reason"] == "stop"
    assert 0 < got["q0"]["tokens"] <= plain["q0"]["tokens"] and got["q0"]["stop"] == [stop]
    if stop not in plain["q1"]["text"]:  # the other row is unaffected
        assert got["q1"]["text"] == plain["q1"]["text"] and got["q1"]["finish_reason"] == plain["q1"]["finish_reason"]


def test_problem_seed_is_stable() -> None:
    assert problem_seed(1, "gsm8k/3") == problem_seed(1, "gsm8k/3")
    assert problem_seed(1, "gsm8k/3") != problem_seed(2, "gsm8k/3")
    assert 0 <= problem_seed(123456789, "x") < 2**31


# ==================================================================================================
# Report


def test_report_aggregates_and_files(tmp_path: Path) -> None:
    records = [
        {
            "config": "safe",
            "problem_id": "a",
            "task": "gsm8k",
            "correct": True,
            "tokens": 100,
            "ensembled_tokens": 10,
            "wall_time_s": 2.0,
        },
        {
            "config": "safe",
            "problem_id": "b",
            "task": "gsm8k",
            "correct": False,
            "tokens": 300,
            "ensembled_tokens": 10,
            "wall_time_s": 2.0,
            "finish_reason": "length",
        },
        {
            "config": "safe",
            "problem_id": "c",
            "task": "arc",
            "correct": True,
            "tokens": 100,
            "ensembled_tokens": 5,
            "wall_time_s": 1.0,
        },
        {
            "config": "single",
            "problem_id": "a",
            "task": "gsm8k",
            "correct": False,
            "tokens": 50,
            "ensembled_tokens": 0,
            "wall_time_s": 0.5,
        },
        {
            "config": "single",
            "problem_id": "a",
            "task": "gsm8k",
            "correct": True,
            "tokens": 50,
            "ensembled_tokens": 0,
            "wall_time_s": 0.5,
        },  # duplicate: the last record wins
    ]
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    rows = {r.config: r for r in aggregate(load_records(jsonl))}
    safe, single = rows["safe"], rows["single"]
    assert safe.n == 3 and safe.correct == 2 and safe.accuracy == pytest.approx(2 / 3)
    assert safe.ensemble_rate == pytest.approx(25 / 500)
    assert safe.tokens_per_s == pytest.approx(500 / 5.0)
    assert safe.mean_wall_time_s == pytest.approx(5.0 / 3)
    assert safe.by_task["gsm8k"]["accuracy"] == 0.5 and safe.by_task["arc"]["n"] == 1
    assert safe.truncated == 1 and single.truncated == 0
    assert single.n == 1 and single.accuracy == 1.0 and single.ensemble_rate == 0.0
    assert single.tokens_per_s == pytest.approx(100.0)

    paths = write_report(jsonl, tmp_path / "report", title="GSM8K test")
    assert set(paths) == {"json", "md", "png"}
    data = json.loads(paths["json"].read_text(encoding="utf-8"))
    assert data["source"] == str(jsonl) and [c["config"] for c in data["configs"]] == ["safe", "single"]
    assert data["configs"][0]["ensemble_rate"] == pytest.approx(0.05)
    md = paths["md"].read_text(encoding="utf-8")
    assert "# GSM8K test" in md and "| safe | 3 | 66.67 | 5.00 | 100.0 | 1.67 | 33 |" in md
    assert "| single | 1 | 100.00 | 0.00 | 100.0 | 0.50 | 0 |" in md and "per task" in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # single answered only problem a: the configurations are also compared on that one alone
    assert data["common_problems"]["n"] == 1
    assert {c["config"]: c["accuracy"] for c in data["common_problems"]["configs"]} == {"safe": 1.0, "single": 1.0}
    assert "## The 1 problems every configuration answered" in md and "| safe | 1 | 100.00 | 10.00 |" in md


def test_report_without_token_counts(tmp_path: Path) -> None:
    records = [{"config": "x", "problem_id": "a", "task": "gsm8k", "correct": True, "wall_time_s": 1.0}]
    (row,) = aggregate(records)
    assert row.ensemble_rate is None and row.tokens_per_s is None and row.accuracy == 1.0
    paths = write_report(records, tmp_path, plot=False)
    assert "png" not in paths and "| x | 1 | 100.00 | – | – | 1.00 | 0 |" in paths["md"].read_text(encoding="utf-8")


def test_batched_ensemble_rows_answer_like_one_at_a_time(tmp_path: Path) -> None:
    """Ensemble rows decode several problems together; each answer (seeded sampling included) is the one the
    problem gets alone."""
    from safe_engine import Ensemble
    from tests.conftest import tiny_member

    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    ens = Ensemble([tiny_member("qwen2.5-7b-instruct", 3), tiny_member("llama2", 2, chat_template=template)])
    questions = ["1+1?", "What is seven times six, in words?", "2?", "Tom has 3 apples and eats one. How many?", "x"]
    problems = [Problem(id=f"q{i}", task="gsm8k", question=q, answer="0") for i, q in enumerate(questions)]
    options = {"method": "safe", "do_sample": True, "seed": 4, "max_new_tokens": 16, "schedule": "rounds"}
    batched = make_ensemble_config(ens, problems=problems, batch_size=3, **options)
    alone = make_ensemble_config(ens, **options)
    records = run_eval({"batched": batched, "alone": alone}, problems, tmp_path / "e.jsonl", progress=False)
    got = {(r["config"], r["problem_id"]): r for r in records}
    for p in problems:
        b, a = got["batched", p.id], got["alone", p.id]
        assert (b["text"], b["tokens"], b["ensembled_tokens"], b["seed"]) == (
            a["text"],
            a["tokens"],
            a["ensembled_tokens"],
            a["seed"],
        )
        assert b["batch_size"] in (3, 2) and "batch_size" not in a
        assert b["replaced_tokens"] == a["replaced_tokens"] and b["cpu_time_s"] > 0 and a["cpu_time_s"] > 0
