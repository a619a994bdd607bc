"""Answer extraction and grading for the SAFE benchmarks.

Why this is its own module: accuracy numbers are only comparable between configurations (single model,
every-token ensemble, SAFE) if every output is graded the same lenient-but-strict way. Models phrase the
same answer many ways ("$1,234.50", "\\dfrac12", "\\text{(C)}", "So the answer is (B).") and a brittle
regex would measure formatting, not reasoning.

- GSM8K: :func:`extract_number` / :func:`numbers_equal`.
- MATH500: :func:`extract_boxed`, :func:`extract_math_answer`, :func:`normalize_math`, :func:`math_equal`
  (string normalisation, exact numeric evaluation, and sympy when installed, under a timeout).
- ARC / MMLU-redux: :func:`extract_choice`.
- BBH: :func:`extract_bbh` / :func:`bbh_equal` (options, True/False, Yes/No, valid/invalid, numbers, words).
- :func:`score` dispatches on ``problem.task``.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any

from safe_engine.eval.tasks import Problem


@dataclass(frozen=True)
class Score:
    """What the grader read out of a model output, and whether it matches the reference."""

    prediction: str | None
    correct: bool


# ==================================================================================================
# Numbers (GSM8K, BBH arithmetic)

_MINUS = "-\u2212\u2013"  # ASCII hyphen, unicode minus, en dash (models emit all three)
# A number: optional sign (only when not glued to a preceding word/closing bracket, so "16-3" is not
# read as "16" and "-3"), optional currency, digits with optional thousands commas and decimals.
_NUMBER_RE = re.compile(
    rf"(?P<sign>(?<![\w)\]}}])[{_MINUS}])?\s?\\?\$?\s?"
    r"(?P<num>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:\s*/\s*(?P<den>\d+)(?![\d.]))?"
)
# Phrases that introduce a final answer; the last one in the text wins.
# A bare "answer" is not a cue ("To answer this, 3 * 4 = 12 ..."): it needs "is", ":" or "=" after it.
_ANSWER_CUE_RE = re.compile(r"answer\s*(?:is|=|:|：)\s*:?|####|\\boxed\s*\{", re.IGNORECASE)


def normalize_number(text: str) -> str | None:
    """Canonical string of the first number in ``text`` (``"$1,234.50"`` -> ``"1234.5"``), else None."""
    match = _NUMBER_RE.search(text)
    if not match:
        return None
    return _canonical_number(match)


def _canonical_number(match: re.Match[str]) -> str | None:
    raw = match.group("num").replace(",", "")
    sign = "-" if match.group("sign") else ""
    den = match.group("den")
    try:
        if den is not None:
            value = Fraction(Decimal(raw)) / Fraction(int(den)) if int(den) else None
            if value is None:
                return None
            if value.denominator == 1:
                return sign + str(value.numerator)
            return f"{sign}{value.numerator}/{value.denominator}"
        dec = Decimal(raw)
    except (InvalidOperation, ValueError, ZeroDivisionError):
        return None
    out = str(int(dec)) if dec == dec.to_integral_value() else format(dec.normalize(), "f")
    return "0" if out == "0" else sign + out


def _number_value(text: str | None) -> Fraction | None:
    if text is None:
        return None
    canon = normalize_number(text)
    if canon is None:
        return None
    try:
        return Fraction(canon)
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(a: str | None, b: str | None, rel_tol: float = 1e-6) -> bool:
    """Numeric equality of two number strings (any formatting :func:`normalize_number` accepts)."""
    va, vb = _number_value(a), _number_value(b)
    if va is None or vb is None:
        return False
    if va == vb:
        return True
    # exact arithmetic: a float() of a runaway digit string (a looping model) would overflow
    return abs(va - vb) <= max(Fraction(rel_tol) * max(abs(va), abs(vb)), Fraction(1, 10**9))


def extract_number(text: str) -> str | None:
    """The final numeric answer in a chain-of-thought output.

    The first number after the last answer cue ("The answer is", "Answer:", "####", ``\\boxed{``) wins;
    without a cue, the last number in the text. Commas, ``$``, trailing units and sentence periods are
    ignored; negatives, decimals and simple fractions are kept.
    """
    if not text:
        return None
    text = text.replace("**", "")
    cues = list(_ANSWER_CUE_RE.finditer(text))
    for cue in reversed(cues):
        line = text[cue.end() :].lstrip().split("\n", 1)[0]  # "Answer:\n\n42" reads the next line
        if "=" in line:  # "The answer is 16 - 3 = 13": the result, not the first operand
            line = line.rsplit("=", 1)[1]
        match = _NUMBER_RE.search(line)
        if match:
            canon = _canonical_number(match)
            if canon is not None:
                return canon
    for match in reversed(list(_NUMBER_RE.finditer(text))):
        canon = _canonical_number(match)
        if canon is not None:
            return canon
    return None


#: GSM8K extraction is the generic final-number extraction.
extract_gsm8k = extract_number


# ==================================================================================================
# MATH500: boxed extraction


def _read_group(s: str, i: int) -> tuple[str, int] | None:
    """Read one TeX argument at ``s[i:]``: a balanced ``{...}`` group or a single token. -> (body, end)."""
    n = len(s)
    while i < n and s[i] == " ":
        i += 1
    if i >= n:
        return None
    if s[i] == "{":
        depth = 0
        for j in range(i, n):
            if s[j] == "{":
                depth += 1
            elif s[j] == "}":
                depth -= 1
                if depth == 0:
                    return s[i + 1 : j], j + 1
        return None  # unbalanced
    if s[i] == "\\":
        m = re.match(r"\\[a-zA-Z]+", s[i:])
        if m:
            return m.group(0), i + m.end()
    return s[i], i + 1


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces allowed), else None.

    Also accepts the brace-less form ``\\boxed 5``.
    """
    if not text:
        return None
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)(?![a-zA-Z])", text)]
    for m in reversed(starts):
        i = m.end()
        if i < len(text) and text[i] == " ":
            tail = re.match(r"\s+([^\s$]+)", text[i:])
            if tail and not tail.group(1).startswith("{"):
                return tail.group(1)
        group = _read_group(text, i)
        if group is not None:
            return group[0].strip()
    return None


_MATH_CUE_RE = re.compile(r"(?:final\s+answer|the\s+answer)\s*(?:is|:)\s*:?", re.IGNORECASE)


def extract_math_answer(text: str) -> str | None:
    """The final answer of a MATH-style solution: last ``\\boxed{}``, else the text after "answer is"."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    cues = list(_MATH_CUE_RE.finditer(text or ""))
    if not cues:
        return None
    tail = text[cues[-1].end() :].strip().split("\n", 1)[0].strip()
    dollar = re.match(r"\$+([^$]+)\$+", tail)
    if dollar:
        return dollar.group(1).strip()
    tail = re.sub(r"\.\s.*$", "", tail)  # first sentence only
    return tail.strip().rstrip(".").strip() or None


# ==================================================================================================
# MATH500: normalisation

_TEXT_CMDS = r"text|textbf|textit|textrm|textnormal|mbox|mathrm|mathbf|mathit|operatorname|boxed|fbox"
_UNIT_RE = re.compile(r"^(?P<value>.*[\d}])\s*\\(?:text|mbox|mathrm)\{\s*[a-zA-Z][a-zA-Z\s.]*\}(?:\^\{?\d\}?)?$")
_PLAIN_UNIT_RE = re.compile(r"^(?P<value>-?[\d.,]+)\s+[a-zA-Z]{2,}(?:\s+[a-zA-Z]+)*\.?$")


def normalize_math(answer: str) -> str:
    """Reduce a LaTeX answer to a canonical string, so formatting differences compare equal.

    Handles ``$``/``\\$``, ``\\left``/``\\right``, ``\\dfrac``/``\\tfrac``, spacing commands and spaces,
    ``^\\circ``, ``\\%``, ``\\text{...}`` (units dropped after a number, otherwise unwrapped),
    ``\\frac12``/``\\sqrt2`` shorthands, thousands separators, ``x = 5`` -> ``5``, ``(C)`` -> ``C``,
    trailing periods, ``π``/``√``, decimals (``2.50`` -> ``2.5``).
    """
    s = str(answer).strip()
    s = s.replace("\u03c0", "\\pi").replace("\u221a", "\\sqrt").replace("\u2212", "-")
    s = s.replace("\u00b0", "").replace("\\degree", "").replace("\u2009", " ").replace("\n", " ")
    s = s.replace("\\left.", "").replace("\\right.", "")
    s = re.sub(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big)(?![a-zA-Z])", "", s)
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\[()\[\]]", "", s)  # \( \) \[ \] math delimiters
    s = re.sub(r"\\[!,;:> ]|~", " ", s)  # spacing commands
    s = s.replace("\\displaystyle", "")
    s = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ", "", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.strip().rstrip(".").strip()  # sentence period, so the unit patterns below can anchor at $
    unit = _UNIT_RE.match(s)
    if unit:
        s = unit.group("value")
    for _ in range(3):  # unwrap \text{...} (possibly nested a little)
        s = re.sub(rf"\\(?:{_TEXT_CMDS})\s*\{{([^{{}}]*)\}}", r"\1", s)
    plain_unit = _PLAIN_UNIT_RE.match(s.strip())
    if plain_unit:
        s = plain_unit.group("value")
    # Remove spaces, but keep one between a command and a following letter ("\cot x" != "\cotx").
    s = re.sub(r"(\\[a-zA-Z]+)\s+(?=[a-zA-Z])", "\\1\x00", s)
    s = re.sub(r"\s+", "", s).replace("\x00", " ")
    s = s.replace("{,}", "")
    s = _canonical_commands(s)
    s = re.sub(r"\^\{(\w)\}", r"^\1", s)
    s = re.sub(r"_\{(\w+)\}", r"_\1", s)
    s = s.rstrip(".").rstrip("\\").strip()
    if s.count("=") == 1:
        lhs, rhs = s.split("=")
        if re.fullmatch(r"[a-zA-Z](?:_\w)?|\\[a-zA-Z]+", lhs) and rhs:
            s = rhs
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?(?:\d+\.\d*|\.\d+)", s):
        s = _canonical_decimal(s)
    choice = re.fullmatch(r"\(?([A-Ea-e])\)?", s)
    if choice:
        s = choice.group(1).upper()
    if s.startswith("+") and len(s) > 1:
        s = s[1:]
    return s


def _canonical_decimal(s: str) -> str:
    try:
        dec = Decimal(s)
    except InvalidOperation:
        return s
    if dec == dec.to_integral_value():
        return str(int(dec))
    return format(dec.normalize(), "f")


_COMMAND = re.compile(r"\\(frac|sqrt)(?![a-zA-Z])")


def _map_commands(
    s: str, render: Callable[[str, str | None, list[str]], str | None], open_index: bool = False
) -> tuple[str, int | None]:
    """Rewrite each ``\\frac{a}{b}`` / ``\\sqrt[n]{a}`` of ``s`` as ``render(name, n or None, [a, b] or [a])``.

    Returns the rewritten text and None; or, at the first command with unbalanced braces (or one ``render``
    refuses with None), the text before it and the command's position. `open_index`: a ``[`` never closed
    is read as the root's argument (``\\sqrt[`` -> ``\\sqrt{[}``), not as unbalanced."""
    out: list[str] = []
    i = 0
    while i < len(s):
        m = _COMMAND.match(s, i)
        if not m:
            out.append(s[i])
            i += 1
            continue
        j, index = m.end(), None
        if m.group(1) == "sqrt" and j < len(s) and s[j] == "[":
            close = s.find("]", j)
            if close >= 0:
                index, j = s[j + 1 : close], close + 1
            elif not open_index:
                return "".join(out), i
        groups: list[str] = []
        for _ in range(1 if m.group(1) == "sqrt" else 2):
            group = _read_group(s, j)
            if group is None:
                return "".join(out), i
            groups.append(group[0])
            j = group[1]
        rendered = render(m.group(1), index, groups)
        if rendered is None:
            return "".join(out), i
        out.append(rendered)
        i = j
    return "".join(out), None


def _canonical_commands(s: str) -> str:
    """Rewrite ``\\frac`` and ``\\sqrt`` with explicit braces: ``\\frac12`` -> ``\\frac{1}{2}`` (an unbalanced
    command and what follows it are kept as they are)."""

    def render(name: str, index: str | None, args: list[str]) -> str:
        braced = "".join(f"{{{_canonical_commands(a)}}}" for a in args)
        return f"\\{name}{'' if index is None else f'[{index}]'}{braced}"

    text, stop = _map_commands(s, render, open_index=True)
    return text if stop is None else text + s[stop:]


# ==================================================================================================
# MATH500: equivalence


def math_equal(prediction: str | None, reference: str | None, timeout: float = 3.0) -> bool:
    """Whether two MATH answers are the same value.

    Order of checks: normalised strings; tuples/intervals element-wise (bracket kinds must match);
    bare comma lists as unordered multisets; exact numeric evaluation of arithmetic with ``\\frac``,
    ``\\sqrt``, ``\\pi`` and powers; finally sympy symbolic simplification when sympy is installed.
    sympy runs in a daemon thread with ``timeout`` seconds so a pathological expression cannot hang
    the evaluation; on timeout or any sympy error the answer is treated as not equal.
    """
    if prediction is None or reference is None:
        return False
    a, b = normalize_math(prediction), normalize_math(reference)
    if not a or not b:
        return False
    return _equal_normalized(a, b, timeout)


def _equal_normalized(a: str, b: str, timeout: float) -> bool:
    if a == b:
        return True
    ta, tb = _split_tuple(a), _split_tuple(b)
    if ta is not None or tb is not None:
        if ta is None or tb is None:
            return False
        (open_a, items_a, close_a), (open_b, items_b, close_b) = ta, tb
        if (open_a, close_a) != (open_b, close_b) or len(items_a) != len(items_b):
            return False
        return all(_equal_normalized(x, y, timeout) for x, y in zip(items_a, items_b, strict=True))
    la, lb = _split_top_level(a, ","), _split_top_level(b, ",")
    if len(la) > 1 or len(lb) > 1:
        if len(la) != len(lb):
            return False
        remaining = list(lb)
        for x in la:
            hit = next((k for k, y in enumerate(remaining) if _equal_normalized(x, y, timeout)), None)
            if hit is None:
                return False
            remaining.pop(hit)
        return True
    return _scalar_equal(a, b, timeout)


def _split_top_level(s: str, sep: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _split_tuple(s: str) -> tuple[str, list[str], str] | None:
    """``(a,b)`` / ``[a,b)`` -> (open, items, close) when the outer brackets wrap the whole string."""
    if len(s) < 2 or s[0] not in "([" or s[-1] not in ")]":
        return None
    depth = 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0 and i != len(s) - 1:
                return None  # "(a)(b)" is a product, not a tuple
    items = _split_top_level(s[1:-1], ",")
    if len(items) < 2:
        return None
    return s[0], items, s[-1]


def _scalar_equal(a: str, b: str, timeout: float) -> bool:
    ea, eb = _latex_to_expr(a), _latex_to_expr(b)
    if ea is None or eb is None:
        return False
    va, vb = _safe_eval(ea), _safe_eval(eb)
    if va is not None and vb is not None:
        if isinstance(va, Fraction) and isinstance(vb, Fraction):
            return va == vb
        return math.isclose(float(va), float(vb), rel_tol=1e-6, abs_tol=1e-9)
    if (va is None) != (vb is None) and not re.search(r"[a-zA-Z]", ea + eb):
        return False
    return _sympy_equal(ea, eb, timeout)


def _latex_to_expr(s: str) -> str | None:
    """Convert normalised LaTeX to a Python-syntax expression, or None if it is not arithmetic."""
    replaced = _replace_commands(s)
    if replaced is None:
        return None
    s = replaced.replace("\\pi", " pi ").replace("\\infty", " oo ")
    s = re.sub(r"\\(?:cdot|times)(?![a-zA-Z])", "*", s).replace("\\div", "/")
    if "\\" in s or "_" in s or "=" in s or "<" in s or ">" in s:
        return None
    s = s.replace("{", "(").replace("}", ")").replace("^", "**")
    s = s.strip()
    # implicit multiplication: 2pi, 2(x), )(, x(  -- but not function calls sqrt(
    s = re.sub(r"(?<=[\d)])\s*(?=[a-zA-Z(])", "*", s)
    s = re.sub(r"\)\s*(?=[\d(])", ")*", s)
    s = re.sub(r"\b(pi|oo)\s+(?=[\w(])", r"\1*", s)
    s = re.sub(r"\s+", "", s)
    s = re.sub(r"(?<=\bpi)(?=[a-zA-Z\d(])", "*", s)
    return s or None


def _replace_commands(s: str) -> str | None:
    """``\\frac{a}{b}`` -> ``((a)/(b))``, ``\\sqrt{a}`` -> ``sqrt(a)``, ``\\sqrt[n]{a}`` -> ``((a)**(1/n))``.

    Returns None when braces are unbalanced, so malformed answers are never evaluated.
    """

    def render(name: str, index: str | None, args: list[str]) -> str | None:
        inner = [_replace_commands(a) for a in args]
        root = None if index is None else _replace_commands(index)
        if None in inner or (index is not None and root is None):
            return None
        if name == "frac":
            return f"(({inner[0]})/({inner[1]}))"
        return f"sqrt({inner[0]})" if index is None else f"(({inner[0]})**(1/({root})))"

    text, stop = _map_commands(s, render)
    return text if stop is None else None


_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def _safe_eval(expr: str) -> Fraction | float | None:
    """Evaluate numbers, + - * / **, sqrt and pi exactly (Fractions) where possible; else None.

    A whitelist AST walk, not ``eval``: only arithmetic nodes are accepted and powers are bounded.
    """
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError):
        return None
    try:
        value = _eval_node(tree.body)
    except (ValueError, ZeroDivisionError, OverflowError, TypeError):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _eval_node(node: ast.AST) -> Fraction | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value)
    if isinstance(node, ast.Name) and node.id == "pi":
        return math.pi
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval_node(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(float(right)) > 64 or abs(float(left)) > 1e12:
                raise ValueError("power too large")
            if isinstance(left, Fraction) and isinstance(right, Fraction) and right.denominator == 1:
                return left ** int(right)
            if float(left) < 0:
                raise ValueError("complex power")
            return float(left) ** float(right)
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise ValueError("operator")
        if isinstance(left, float) or isinstance(right, float):
            return op(float(left), float(right))
        return op(left, right)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "sqrt"
        and len(node.args) == 1
        and not node.keywords
    ):
        value = _eval_node(node.args[0])
        if value < 0:
            raise ValueError("sqrt of negative")
        if isinstance(value, Fraction):
            num, den = math.isqrt(value.numerator), math.isqrt(value.denominator)
            if num * num == value.numerator and den * den == value.denominator:
                return Fraction(num, den)
        return math.sqrt(float(value))
    raise ValueError("unsupported expression")


def _sympy_equal(ea: str, eb: str, timeout: float) -> bool:
    """Symbolic equality through sympy (optional), bounded by ``timeout`` seconds in a daemon thread."""
    try:
        import sympy
        from sympy.parsing.sympy_parser import parse_expr, standard_transformations
    except ImportError:
        return False
    if len(ea) > 300 or len(eb) > 300:
        return False
    names = set(re.findall(r"[a-zA-Z_]\w*", ea + " " + eb)) - {"sqrt", "pi", "oo"}
    local: dict[str, Any] = {n: sympy.Symbol(n) for n in names}
    local.update({"sqrt": sympy.sqrt, "pi": sympy.pi, "oo": sympy.oo})
    result: list[bool] = []

    def work() -> None:
        try:
            xa = parse_expr(ea, local_dict=local, transformations=standard_transformations)
            xb = parse_expr(eb, local_dict=local, transformations=standard_transformations)
            diff = sympy.simplify(xa - xb)
            result.append(bool(diff == 0))
        except Exception:  # sympy raises many types on odd input; unparseable means "not equal"
            result.append(False)

    worker = threading.Thread(target=work, daemon=True, name="math_equal-sympy")
    worker.start()
    worker.join(timeout)
    return bool(result and result[0])


# ==================================================================================================
# Multiple choice (ARC, MMLU-redux, BBH options)

_CHOICE_STRONG = [
    re.compile(r"\\boxed\s*\{\s*(?:\\text(?:bf)?\s*\{)?\s*\(?([A-Z])\)?"),
    # "The answer is (B)", "Answer: C", "the correct option is D", "best choice would be: A"
    re.compile(
        r"(?i:answer|(?:correct|right|best)\s+(?:option|choice))\s*(?i:is|would\s+be|:|：)\s*:?\s*"
        r"(?i:option\s+|choice\s+)?(?:\*\*|\s)*\\?\(?\s*([A-Z])(?![a-zA-Z'])"
    ),
]
_CHOICE_PAREN = re.compile(r"\(([A-Z])\)")
_CHOICE_BARE = re.compile(r"(?<![\w'])([A-Z])(?![\w'])")


def extract_choice(
    text: str, labels: Sequence[str] = ("A", "B", "C", "D"), choices: Sequence[str] | None = None
) -> str | None:
    """The option letter a model chose, or None.

    Priority: the last "answer is (B)" / "Answer: B" / ``\\boxed{B}``; then the last ``(B)``; then the
    option whose full text follows the last "answer is"; then the last standalone valid letter (an
    article "A" before a lowercase word is skipped).
    """
    if not text:
        return None
    valid = {x.upper() for x in labels}
    clean = text.replace("**", "")
    best: tuple[int, str] | None = None
    for pattern in _CHOICE_STRONG:
        for m in pattern.finditer(clean):
            if m.group(1) in valid and (best is None or m.start() >= best[0]):
                best = (m.start(), m.group(1))
    if best is not None:
        return best[1]
    parens = [m.group(1) for m in _CHOICE_PAREN.finditer(clean) if m.group(1) in valid]
    if parens:
        return parens[-1]
    if choices:
        letter = _match_option_text(clean, labels, choices)
        if letter is not None:
            return letter
    for m in reversed(list(_CHOICE_BARE.finditer(clean))):
        letter = m.group(1)
        if letter not in valid:
            continue
        if letter in "AI" and re.match(r"\s+[a-z]", clean[m.end() :]):
            continue  # "A car ..." is an article, not an answer
        return letter
    return None


def _norm_text(s: str) -> str:
    s = s.replace("**", "").replace("$", "").strip().lower()
    s = re.sub(r"\s+", " ", s)
    return s.strip(" .;:!\"'`")


def _match_option_text(text: str, labels: Sequence[str], choices: Sequence[str]) -> str | None:
    tail = _answer_tail(text)
    if tail is None:  # no cue: accept a last line that is exactly one option's text
        lines = [line for line in text.strip().splitlines() if line.strip()]
        if not lines:
            return None
        tail = lines[-1]
    norm_tail = _norm_text(tail)
    hits = [
        lab
        for lab, ch in zip(labels, choices, strict=False)
        if _norm_text(ch) and (_norm_text(ch) == norm_tail or norm_tail.startswith(_norm_text(ch)))
    ]
    return hits[0] if len(hits) == 1 else None


def _answer_tail(text: str) -> str | None:
    """The rest of the line after the last "answer is" / "answer:", or None."""
    cues = list(re.finditer(r"answer\s*(?:is|:)\s*:?", text, re.IGNORECASE))
    if not cues:
        return None
    return text[cues[-1].end() :].strip().split("\n", 1)[0]


# ==================================================================================================
# BBH

_BOOL_WORDS = ("true", "false", "yes", "no", "valid", "invalid")
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _bbh_kind(reference: str) -> str:
    ref = reference.strip()
    if re.fullmatch(r"\([A-Z]\)", ref):
        return "choice"
    if ref.lower() in _BOOL_WORDS:
        return "bool"
    if re.fullmatch(r"-?\d+(?:\.\d+)?", ref):
        return "number"
    return "text"


def extract_bbh(text: str, problem: Problem) -> str | None:
    """The BBH answer in the form of the problem's target (``"(B)"``, ``"True"``, ``"12"``, words).

    The BBH CoT exemplars end with "So the answer is X."; the text after the last such cue is read
    first, the whole output is the fallback.
    """
    if not text:
        return None
    clean = text.replace("**", "")
    kind = _bbh_kind(problem.answer)
    tail = _answer_tail(clean)
    labels = problem.labels or tuple(_LETTERS)
    if kind == "choice":
        letter = extract_choice(tail, labels, problem.choices) if tail is not None else None
        letter = letter or extract_choice(clean, labels, problem.choices)
        return f"({letter})" if letter else None
    if kind == "bool":
        words = {"true": "true|false", "false": "true|false", "yes": "yes|no", "no": "yes|no"}
        pattern = re.compile(rf"\b({words.get(problem.answer.strip().lower(), 'invalid|valid')})\b", re.IGNORECASE)
        if tail is not None and (found := pattern.findall(tail)):
            return found[0]
        found = pattern.findall(clean)
        return found[-1] if found else None
    if kind == "number":
        if tail is not None and (number := normalize_number(tail)) is not None:
            return number
        return extract_number(clean)
    if tail is None:
        return None
    paren = _CHOICE_PAREN.search(tail)
    if problem.choices and problem.labels and paren and paren.group(1) in problem.labels:
        # the target is written out ("Monsters, Inc") but the model picked an option letter
        return problem.choices[problem.labels.index(paren.group(1))]
    return _norm_text(tail)


def bbh_equal(prediction: str | None, reference: str) -> bool:
    """Normalised comparison of a BBH prediction with its target (case, spaces, final period)."""
    if prediction is None:
        return False
    kind = _bbh_kind(reference)
    if kind == "number":
        return numbers_equal(prediction, reference)
    p, r = _norm_text(prediction), _norm_text(reference)
    if p == r:
        return True
    if not re.search(r"[a-z0-9]", r):  # dyck languages: ") ] }" vs ")]}"
        return p.replace(" ", "") == r.replace(" ", "")
    return False


# ==================================================================================================
# Dispatcher


def score(problem: Problem, text: str) -> Score:
    """Extract the answer from ``text`` with the problem's task grader and compare with the reference."""
    task = problem.task
    if task == "gsm8k":
        pred = extract_number(text)
        return Score(pred, numbers_equal(pred, problem.answer))
    if task == "math500":
        pred = extract_math_answer(text)
        return Score(pred, math_equal(pred, problem.answer))
    if task in ("arc", "mmlu-redux"):
        pred = extract_choice(text, problem.labels or ("A", "B", "C", "D"), problem.choices)
        return Score(pred, pred is not None and pred == problem.answer.strip().upper())
    if task == "bbh":
        pred = extract_bbh(text, problem)
        return Score(pred, bbh_equal(pred, problem.answer))
    raise ValueError(f"no grader for task {task!r}")
