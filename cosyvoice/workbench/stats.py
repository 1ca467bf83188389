"""Statistics for listening tests, as pure functions (no state, no I/O), each checked by hand in the tests.

* :func:`mean_ci`: mean with a Student-t confidence interval (MOS, CMOS, MUSHRA scores per condition);
* :func:`binomial_test`: exact two-sided binomial test (A/B preference shares against 50/50);
* :func:`bradley_terry`: maximum-likelihood Bradley–Terry log-strengths with Wald intervals from the Fisher
  information (pairwise preferences among several conditions; a "no preference" counts half a win each way);
* :func:`krippendorff_alpha`: rater agreement (Krippendorff's alpha, interval or nominal metric), which allows
  raters who skipped items, unlike Kendall's W.

The t quantile is computed here (regularised incomplete beta by continued fraction, inverted by bisection)
so the workbench needs no SciPy.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    n: int


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on the CDF to 1e-12)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError("p must lie in (0, 1) and df be positive")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    while hi - lo > 1e-12 * max(1.0, hi):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2.0


def mean_ci(values: Sequence[float], level: float = 0.95) -> Interval:
    """Mean and its two-sided t interval; one value gives an unbounded interval (nan), none raises."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("no values")
    mean = float(x.mean())
    if x.size < 2:
        return Interval(mean, math.nan, math.nan, 1)
    half = t_quantile(0.5 + level / 2.0, x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    return Interval(mean, mean - half, mean + half, int(x.size))


def binomial_test(k: int, n: int, p: float = 0.5) -> float:
    """Exact two-sided p-value of ``k`` successes in ``n`` trials: the probability of every outcome no more
    likely than the observed one (the method of R's binom.test and SciPy's binomtest)."""
    if not 0 <= k <= n:
        raise ValueError("need 0 <= k <= n")
    if n == 0:
        return 1.0
    probs = [math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(n + 1)]
    observed = probs[k] * (1 + 1e-7)  # the same relative tolerance as R
    return min(1.0, sum(q for q in probs if q <= observed))


def binomial_tail(k: int, n: int, p: float = 0.5) -> float:
    """One-sided p-value: the probability of ``k`` or more successes in ``n`` trials. An ABX test asks only
    whether listeners do better than guessing, so doing worse is no evidence of a difference."""
    if not 0 <= k <= n:
        raise ValueError("need 0 <= k <= n")
    return min(1.0, sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1)))


def bradley_terry(comparisons: Sequence[tuple[Hashable, Hashable, float]], level: float = 0.95,
                  iterations: int = 10_000) -> dict[Hashable, Interval]:
    """Log-strengths θ (summing to zero; P(i beats j) = 1 / (1 + exp(θj − θi))) with Wald intervals.

    ``comparisons``: (i, j, wins of i over j in this comparison: 1, 0, or 0.5 for "no preference"). The maximum
    likelihood exists only when every condition both wins and loses along a chain to every other (the
    "beats" graph is strongly connected); otherwise a :class:`ValueError` says so. ``n`` of an interval is its
    condition's number of comparisons.
    """
    names = sorted({c for i, j, _ in comparisons for c in (i, j)}, key=str)
    index = {c: k for k, c in enumerate(names)}
    m = len(names)
    wins = np.zeros((m, m))
    for i, j, w in comparisons:
        wins[index[i], index[j]] += w
        wins[index[j], index[i]] += 1.0 - w
    if m < 2 or not _strongly_connected(wins > 0):
        raise ValueError("Bradley–Terry needs every condition to win and lose somewhere in a connected chain; "
                         "collect more comparisons")
    games = wins + wins.T
    total_wins = wins.sum(axis=1)
    strength = np.ones(m)
    for _ in range(iterations):  # Hunter's MM algorithm: monotone, converges to the MLE
        denom = (games / (strength[:, None] + strength[None, :])).sum(axis=1)
        new = total_wins / denom
        new /= math.exp(np.log(new).mean())
        if np.max(np.abs(new - strength)) < 1e-13:
            strength = new
            break
        strength = new
    theta = np.log(strength)
    prob = 1.0 / (1.0 + np.exp(theta[None, :] - theta[:, None]))
    info = -games * prob * prob.T
    np.fill_diagonal(info, 0.0)
    np.fill_diagonal(info, -info.sum(axis=1))
    cov = np.linalg.pinv(info)  # the sum-zero constraint: the pseudo-inverse of the singular information
    z = _normal_quantile(0.5 + level / 2.0)
    return {c: Interval(float(theta[k]), float(theta[k] - z * math.sqrt(cov[k, k])),
                        float(theta[k] + z * math.sqrt(cov[k, k])), int(games[k].sum()))
            for c, k in index.items()}


def _strongly_connected(edges: np.ndarray) -> bool:
    def reach(adj: np.ndarray) -> int:
        seen, todo = {0}, [0]
        while todo:
            for nxt in np.flatnonzero(adj[todo.pop()]):
                if int(nxt) not in seen:
                    seen.add(int(nxt))
                    todo.append(int(nxt))
        return len(seen)

    return reach(edges) == len(edges) == reach(edges.T)


def _normal_quantile(p: float) -> float:
    """The standard normal quantile, by bisection on erf (1.959963984540054 for 0.975)."""
    lo, hi = -40.0, 40.0
    while hi - lo > 1e-13:
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if 0.5 * math.erfc(-mid / math.sqrt(2.0)) < p else (lo, mid)
    return (lo + hi) / 2.0


def krippendorff_alpha(units: Sequence[Sequence[float | str | None]], metric: str = "interval") -> float:
    """Krippendorff's alpha of ``units`` (one row per item: each rater's value or None). ``interval``: squared
    difference (ratings); ``nominal``: equal or not (choices). 1 is perfect agreement, 0 chance level; nan when
    fewer than two items have two values or all values are equal."""
    if metric not in ("interval", "nominal"):
        raise ValueError("metric must be 'interval' or 'nominal'")

    def delta(a: object, b: object) -> float:
        return float((a - b) ** 2) if metric == "interval" else float(a != b)  # type: ignore[operator]

    pairable = [[v for v in unit if v is not None] for unit in units]
    pairable = [u for u in pairable if len(u) >= 2]
    values = [v for u in pairable for v in u]
    n = len(values)
    if len(pairable) < 1 or n < 2:
        return math.nan
    observed = sum(sum(delta(a, b) for x, a in enumerate(u) for y, b in enumerate(u) if x != y) / (len(u) - 1)
                   for u in pairable) / n
    expected = sum(delta(a, b) for x, a in enumerate(values) for y, b in enumerate(values) if x != y) / (n * (n - 1))
    return math.nan if expected == 0 else 1.0 - observed / expected
