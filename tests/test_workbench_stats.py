"""Workbench statistics against values computed by hand (and printed tables), on small fixed examples."""

from __future__ import annotations

import math

import pytest

from cosyvoice.workbench.stats import (
    binomial_test,
    bradley_terry,
    krippendorff_alpha,
    mean_ci,
    t_quantile,
)


@pytest.mark.parametrize(("df", "table"), [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423)])
def test_t_quantile_matches_the_printed_table(df: int, table: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(table, abs=5e-5)
    assert t_quantile(0.025, df) == pytest.approx(-table, abs=5e-5)


def test_mean_ci_by_hand() -> None:
    # mean 4; sd sqrt(2/4) = 0.70711; se = 0.31623; t(0.975, 4) = 2.77645 -> half-width 0.87799
    ci = mean_ci([3, 4, 5, 4, 4])
    assert (ci.estimate, ci.n) == (4.0, 5)
    assert ci.low == pytest.approx(4 - 0.87799, abs=1e-5) and ci.high == pytest.approx(4 + 0.87799, abs=1e-5)
    assert math.isnan(mean_ci([2]).low)


def test_binomial_test_by_hand() -> None:
    assert binomial_test(9, 10) == pytest.approx(2 * (10 + 1) / 1024)  # P(X<=1) + P(X>=9)
    assert binomial_test(7, 10) == pytest.approx(2 * (120 + 45 + 10 + 1) / 1024)  # P(X<=3) + P(X>=7)
    assert binomial_test(5, 10) == 1.0
    assert binomial_test(0, 0) == 1.0


def test_bradley_terry_two_conditions_by_hand() -> None:
    # A wins 7 of 10: theta_A - theta_B = ln(7/3); sum-zero -> theta_A = ln(7/3)/2 = 0.42365;
    # var(theta_A) = 1 / (4 n p q) = 1 / (4 * 10 * 0.21) -> se 0.34503, half-width 1.95996 * se = 0.67625
    scores = bradley_terry([("A", "B", 1.0)] * 7 + [("A", "B", 0.0)] * 3)
    assert scores["A"].estimate == pytest.approx(math.log(7 / 3) / 2, abs=1e-9)
    assert scores["B"].estimate == pytest.approx(-math.log(7 / 3) / 2, abs=1e-9)
    assert scores["A"].high - scores["A"].estimate == pytest.approx(0.67625, abs=1e-4)
    assert scores["A"].n == 10


def test_bradley_terry_ties_and_cycles() -> None:
    # a perfect cycle: every condition equally strong
    cycle = bradley_terry([("A", "B", 1.0), ("B", "C", 1.0), ("C", "A", 1.0)] * 3)
    assert all(s.estimate == pytest.approx(0.0, abs=1e-9) for s in cycle.values())
    # two "no preference" answers and one win: p = 2/3 -> theta_A = ln(2)/2
    assert bradley_terry([("A", "B", 0.5), ("A", "B", 0.5), ("A", "B", 1.0)])["A"].estimate == pytest.approx(
        math.log(2) / 2, abs=1e-9)
    with pytest.raises(ValueError, match="win and lose"):
        bradley_terry([("A", "B", 1.0)] * 4)  # B never wins: no finite maximum


def test_krippendorff_alpha_by_hand() -> None:
    # values 1,2 | 3,3 | 2,3: Do = (2 + 0 + 2) / 6 = 2/3; De = 40 / 30 = 4/3 -> alpha = 0.5
    assert krippendorff_alpha([[1, 2], [3, 3], [2, 3]]) == pytest.approx(0.5)
    assert krippendorff_alpha([[1, 1, None], [3, 3, 3], [5, None, 5]]) == pytest.approx(1.0)
    # nominal: A,A | B,A | B,B -> Do = 2/6; De = (2*3*3)/(6*5) = 18/30 -> alpha = 1 - (1/3)/(3/5) = 4/9
    assert krippendorff_alpha([["A", "A"], ["B", "A"], ["B", "B"]], "nominal") == pytest.approx(4 / 9)
    assert math.isnan(krippendorff_alpha([[4, 4], [4, 4]]))
