"""How sure an accuracy difference is: bootstrap intervals and McNemar's exact test on paired answers.

Why these two: every row of a study answers the same problems, so a comparison is paired. A percentile
bootstrap over problems gives an interval for one row's accuracy and for the difference of two rows (the
pairing kept: one resample draws the same problems for both); McNemar's exact test asks whether the
problems only one row solved split more unevenly than a fair coin would, the usual test for two
classifiers on one test set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["McNemar", "bootstrap_difference", "bootstrap_interval", "mcnemar"]


def _as_array(correct: Sequence[bool], name: str) -> np.ndarray:
    values = np.asarray(correct, dtype=float)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"{name} must be a non-empty sequence of per-problem outcomes (True / False)")
    return values


def bootstrap_interval(
    correct: Sequence[bool], *, level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the accuracy (a fraction) over problems resampled with replacement."""
    values = _as_array(correct, "correct")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(resamples, values.size))].mean(axis=1)
    alpha = (1 - level) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def bootstrap_difference(
    a: Sequence[bool], b: Sequence[bool], *, level: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """Paired percentile bootstrap interval of accuracy(a) - accuracy(b); ``a[i]`` and ``b[i]`` are one problem."""
    x, y = _as_array(a, "a"), _as_array(b, "b")
    if x.size != y.size:
        raise ValueError(f"paired outcomes need the same problems: got {x.size} and {y.size} outcomes")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(resamples, x.size))
    diffs = (x[idx] - y[idx]).mean(axis=1)
    alpha = (1 - level) / 2
    return float(np.quantile(diffs, alpha)), float(np.quantile(diffs, 1 - alpha))


@dataclass(frozen=True)
class McNemar:
    """Discordant pairs and the exact two-sided p-value: ``only_a`` problems only a solved, ``only_b`` only b."""

    only_a: int
    only_b: int
    p_value: float


def mcnemar(a: Sequence[bool], b: Sequence[bool]) -> McNemar:
    """McNemar's exact test: under "a and b are equally good", each discordant problem is a fair coin flip.

    p = min(1, 2 * P[Binomial(only_a + only_b, 1/2) <= min(only_a, only_b)]); 1.0 when nothing is discordant.
    """
    x, y = _as_array(a, "a").astype(bool), _as_array(b, "b").astype(bool)
    if x.size != y.size:
        raise ValueError(f"paired outcomes need the same problems: got {x.size} and {y.size} outcomes")
    only_a, only_b = int(np.sum(x & ~y)), int(np.sum(~x & y))
    n, k = only_a + only_b, min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n if n else 1.0
    return McNemar(only_a, only_b, min(1.0, 2 * tail))
