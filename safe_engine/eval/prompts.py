"""Prompt construction for the benchmarks: chat messages for instruct models, few-shot text for base models.

Why fixed, explicit prompts: the SAFE comparisons (single model vs. every-token ensemble vs. SAFE) are
only meaningful when every configuration sees byte-identical prompts, and when every prompt ends with a
clearly marked final answer ("The answer is X", ``\\boxed{}``) that :mod:`safe_engine.eval.extract` can
read back. Chat prompts are zero-shot chain-of-thought (BBH keeps its three CoT exemplars as earlier
turns, as in the paper's 3-shot BBH setting); base-model prompts are few-shot plain text with
per-task stop strings so a base model stops before inventing the next question.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal, overload

from safe_engine.eval.tasks import Problem

__all__ = [
    "Message",
    "build_prompt",
    "chat_messages",
    "fewshot_prompt",
    "format_question",
    "stop_strings",
]

Message = dict[str, str]

# --------------------------------------------------------------------------------------------------
# Instructions appended to the question in chat prompts.

_GSM8K_INSTRUCTION = (
    "Solve the problem step by step. At the end, write the final answer as a single number on its own "
    'line in the form "The answer is N."'
)
_MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_MC_INSTRUCTION = (
    'Think step by step, then finish with a line of the form "The answer is (X)." where X is the '
    "letter of the correct option."
)
_BBH_INSTRUCTION = (
    'Think step by step, then finish with a sentence of the form "So the answer is X." where X is '
    "the final answer in the same format as in the examples."
)

# --------------------------------------------------------------------------------------------------
# Fixed exemplars for base-model few-shot prompts. Written for this project (not taken from any test
# set), short on purpose: they teach the output format, not the skill.

_GSM8K_SHOTS: tuple[tuple[str, str], ...] = (
    (
        "Tom has 3 boxes with 12 pencils in each box. He gives away 10 pencils. How many pencils does he have left?",
        "Tom starts with 3 * 12 = 36 pencils. After giving away 10 he has 36 - 10 = 26 pencils. The answer is 26.",
    ),
    (
        "A shirt costs $25 and is on sale for 20% off. How much does the shirt cost on sale?",
        "20% of $25 is 0.2 * 25 = $5. The sale price is 25 - 5 = $20. The answer is 20.",
    ),
    (
        "Maria reads 15 pages every day. How many days does she need to read a 120-page book?",
        "She needs 120 / 15 = 8 days. The answer is 8.",
    ),
    (
        "A baker made 48 cookies and sold them in bags of 6. Each bag sells for $4. How much money did the baker make?",
        "There are 48 / 6 = 8 bags. They bring in 8 * 4 = $32. The answer is 32.",
    ),
)

_MATH_SHOTS: tuple[tuple[str, str], ...] = (
    (
        "What is the value of $3^2 + 4^2$?",
        "We have $3^2 = 9$ and $4^2 = 16$, so the sum is $9 + 16 = 25$. The final answer is $\\boxed{25}$.",
    ),
    (
        "Solve for $x$: $2x + 5 = 11$.",
        "Subtracting 5 gives $2x = 6$, so $x = 3$. The final answer is $\\boxed{3}$.",
    ),
    (
        "Simplify $\\frac{6}{8}$.",
        "Both 6 and 8 are divisible by 2, so $\\frac{6}{8} = \\frac{3}{4}$. "
        "The final answer is $\\boxed{\\frac{3}{4}}$.",
    ),
    (
        "What is the area of a circle with radius $3$?",
        "The area is $\\pi r^2 = \\pi \\cdot 3^2 = 9\\pi$. The final answer is $\\boxed{9\\pi}$.",
    ),
)

_MC_SHOTS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (
        "Which of these is a mammal?",
        ("Shark", "Dolphin", "Trout", "Octopus"),
        "Sharks and trout are fish and an octopus is a mollusc. Dolphins breathe air and nurse their "
        "young, so they are mammals. The answer is (B).",
    ),
    (
        "What is the boiling point of water at sea level?",
        ("50 °C", "75 °C", "90 °C", "100 °C"),
        "At standard atmospheric pressure pure water boils at 100 °C. The answer is (D).",
    ),
    (
        "Which planet is closest to the Sun?",
        ("Mercury", "Venus", "Earth", "Mars"),
        "The order from the Sun is Mercury, Venus, Earth, Mars. The answer is (A).",
    ),
)

_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

# --------------------------------------------------------------------------------------------------
# Public API


def format_question(problem: Problem) -> str:
    """The question text with lettered options on their own lines (ARC / MMLU-redux).

    BBH inputs already contain their ``Options:`` block and are returned unchanged.
    """
    if problem.task == "bbh" or not problem.choices:
        return problem.question.strip()
    return _format_mc(problem.question, problem.choices, problem.labels)


def chat_messages(problem: Problem, fewshot: bool | None = None) -> list[Message]:
    """Chat messages for an instruct model: zero-shot CoT with a clearly marked final answer.

    Args:
        fewshot: include the task's exemplars as earlier user/assistant turns. ``None`` means the task
            default: on for BBH (its 3 CoT exemplars, when loaded from cot-prompts), off elsewhere.
    """
    use_shots = (problem.task == "bbh" and problem.fewshot is not None) if fewshot is None else fewshot
    messages: list[Message] = []
    if use_shots:
        for question, answer in _shots_for(problem):
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": answer})
    question = format_question(problem)
    if problem.task == "bbh" and use_shots and problem.fewshot is not None:
        description = _bbh_description(problem.fewshot)
        if description and messages:  # state the task once, in the first turn
            messages[0]["content"] = f"{description}\n\n{messages[0]['content']}"
    content = f"{question}\n\n{_instruction(problem)}"
    messages.append({"role": "user", "content": content})
    return messages


def fewshot_prompt(problem: Problem) -> str:
    """A plain-text few-shot CoT prompt for a base model (no chat template).

    GSM8K / MATH500 / ARC / MMLU-redux use short fixed exemplars in a ``Question: … Answer: …`` layout;
    BBH uses the task's own ``cot-prompts`` block (``Q: … A: Let's think step by step. …``). The prompt
    ends right where the model should start reasoning; pair it with :func:`stop_strings`.
    """
    task = problem.task
    if task == "bbh":
        head = f"{problem.fewshot.strip()}\n\n" if problem.fewshot else ""
        return f"{head}Q: {problem.question.strip()}\nA: Let's think step by step."
    if task == "gsm8k":
        shots = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in _GSM8K_SHOTS)
        return f"{shots}Question: {problem.question.strip()}\nAnswer:"
    if task == "math500":
        shots = "".join(f"Problem: {q}\nSolution: {a}\n\n" for q, a in _MATH_SHOTS)
        return f"{shots}Problem: {problem.question.strip()}\nSolution:"
    shots = "".join(
        f"Question: {_format_mc(q, opts, None)}\nAnswer: Let's think step by step. {a}\n\n" for q, opts, a in _MC_SHOTS
    )
    return f"{shots}Question: {format_question(problem)}\nAnswer: Let's think step by step."


def stop_strings(problem_or_task: Problem | str, chat: bool = False) -> tuple[str, ...]:
    """Stop strings for the few-shot text prompt of a task (empty for chat prompts: EOS ends those).

    They mark the start of the next invented exemplar, so generation ends after one answer.
    """
    if chat:
        return ()
    task = problem_or_task.task if isinstance(problem_or_task, Problem) else problem_or_task.split(":")[0]
    if task == "bbh":
        return ("\n\nQ:", "\nQ:")
    if task == "math500":
        return ("\n\nProblem:", "\nProblem:")
    return ("\n\nQuestion:", "\nQuestion:")


@overload
def build_prompt(problem: Problem, chat: Literal[True], fewshot: bool | None = None) -> list[Message]: ...
@overload
def build_prompt(problem: Problem, chat: Literal[False], fewshot: bool | None = None) -> str: ...
@overload
def build_prompt(problem: Problem, chat: bool, fewshot: bool | None = None) -> str | list[Message]: ...
def build_prompt(problem: Problem, chat: bool, fewshot: bool | None = None) -> str | list[Message]:
    """``chat_messages(problem)`` when ``chat`` else ``fewshot_prompt(problem)``."""
    return chat_messages(problem, fewshot=fewshot) if chat else fewshot_prompt(problem)


# --------------------------------------------------------------------------------------------------
# Helpers


def _format_mc(question: str, choices: Sequence[str], labels: Sequence[str] | None) -> str:
    labs = list(labels) if labels else list(_LETTERS[: len(choices)])
    options = "\n".join(f"({lab}) {text}" for lab, text in zip(labs, choices, strict=False))
    return f"{question.strip()}\n{options}"


def _instruction(problem: Problem) -> str:
    if problem.task == "gsm8k":
        return _GSM8K_INSTRUCTION
    if problem.task == "math500":
        return _MATH_INSTRUCTION
    if problem.task == "bbh":
        return _BBH_INSTRUCTION
    return _MC_INSTRUCTION


def _bbh_description(block: str) -> str:
    """The one-line task description that opens a cot-prompts block (text before the first ``Q:``)."""
    head = block.split("\nQ:", 1)[0] if not block.startswith("Q:") else ""
    return head.strip()


def _bbh_shots(block: str) -> list[tuple[str, str]]:
    """Parse a cot-prompts block into (question, reasoning-and-answer) pairs for chat turns."""
    shots = []
    for chunk in re.split(r"(?:^|\n\n)Q: ", block)[1:]:
        question, sep, answer = chunk.partition("\nA: ")
        if not sep:
            continue
        shots.append((question.strip(), answer.strip()))
    return shots


def _shots_for(problem: Problem) -> list[tuple[str, str]]:
    if problem.task == "bbh":
        return [(q, a) for q, a in _bbh_shots(problem.fewshot or "")]
    if problem.task == "gsm8k":
        return list(_GSM8K_SHOTS)
    if problem.task == "math500":
        return list(_MATH_SHOTS)
    return [(_format_mc(q, opts, None), a) for q, opts, a in _MC_SHOTS]
