"""Bootstrap intervals and McNemar's exact test of safe_engine.eval.significance, checked against scipy and
against simulated studies with a known accuracy (fixed seeds)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import binomtest

from safe_engine.eval import bootstrap_difference, bootstrap_interval, mcnemar


@pytest.mark.parametrize(
    ("only_a", "only_b", "both", "neither"), [(0, 0, 5, 5), (7, 2, 40, 101), (1, 12, 3, 0), (30, 30, 0, 0)]
)
def test_mcnemar_equals_an_exact_binomial_test_of_the_discordant_pairs(only_a, only_b, both, neither):
    a = [True] * only_a + [False] * only_b + [True] * both + [False] * neither
    b = [False] * only_a + [True] * only_b + [True] * both + [False] * neither
    result = mcnemar(a, b)
    assert (result.only_a, result.only_b) == (only_a, only_b)
    expected = binomtest(only_a, only_a + only_b, 0.5).pvalue if only_a + only_b else 1.0
    assert result.p_value == pytest.approx(expected, rel=1e-12)
    assert mcnemar(b, a).p_value == pytest.approx(result.p_value, rel=1e-12)  # symmetric


def test_identical_rows_differ_by_exactly_nothing():
    rng = np.random.default_rng(3)
    a = (rng.random(150) < 0.4).tolist()
    assert bootstrap_difference(a, a) == (0.0, 0.0)
    assert mcnemar(a, a).p_value == 1.0


def test_the_interval_covers_the_true_accuracy_about_95_percent_of_the_time():
    """200 simulated 150-problem rows at accuracy 0.4: a 95 % interval should miss about 10 of them; a 1-in-1000
    binomial tail allows 2..20 misses (so a too narrow or too wide interval fails this test)."""
    rng = np.random.default_rng(0)
    misses = 0
    for i in range(200):
        row = rng.random(150) < 0.4
        lo, hi = bootstrap_interval(row.tolist(), resamples=2000, seed=i)
        misses += not lo <= 0.4 <= hi
    assert 2 <= misses <= 20


def test_a_real_difference_of_fifteen_points_is_found_and_a_null_one_is_not():
    rng = np.random.default_rng(1)
    base = rng.random(300)
    better, worse = (base < 0.55).tolist(), (base < 0.40).tolist()  # the better row solves a superset
    lo, hi = bootstrap_difference(better, worse)
    assert 0 < lo < 0.15 < hi
    assert mcnemar(better, worse).p_value < 1e-6
    coin_a, coin_b = (rng.random(300) < 0.4).tolist(), (rng.random(300) < 0.4).tolist()
    lo, hi = bootstrap_difference(coin_a, coin_b)
    assert lo < 0 < hi  # two independent rows of one accuracy: no difference claimed
    assert mcnemar(coin_a, coin_b).p_value > 0.05


def test_bad_input_is_refused_with_a_message():
    with pytest.raises(ValueError, match="same problems"):
        mcnemar([True, False], [True])
    with pytest.raises(ValueError, match="same problems"):
        bootstrap_difference([True], [True, False])
    with pytest.raises(ValueError, match="non-empty"):
        bootstrap_interval([])
