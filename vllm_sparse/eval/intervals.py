"""95% intervals for eval scores: a backend's mean score per cell, and a sparse backend's paired
difference to dense on the same prompts. Pure Python (no scipy), deterministic.

Scores lie in ``[0, 1]`` (``tasks.score``: the share of expected strings found; most tasks are 0/1).

* Mean of one cell: the **Wilson score interval** of the mean with ``n`` samples. For 0/1 scores it is
  the textbook Wilson interval; for graded scores in ``[0, 1]`` it is conservative, because a
  variable in ``[0, 1]`` with mean ``p`` has variance at most ``p (1 - p)``, the binomial one. Unlike
  a normal or t interval it stays inside ``[0, 1]`` and does not collapse to zero width when every
  sample scored 1 (20/20 gives ``[0.839, 1]``).
* Paired difference (sparse minus dense, matched by sample): the **paired Student-t interval** of
  the mean difference, clipped to ``[-1, 1]``. Pairs that all differ by the same amount give a
  zero-width interval (identical answers on every prompt: no evidence of any difference); fewer
  than two pairs give no interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
WILSON = "wilson"
PAIRED_T = "paired-t"


@dataclass(frozen=True)
class Interval:
    """A point estimate with its 95% interval; ``lo``/``hi`` are None where none can be given."""

    mean: float
    n: int
    lo: float | None
    hi: float | None
    method: str

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval lies wholly above or below zero (a difference the data shows)."""
        return self.lo is not None and self.hi is not None and (self.lo > 0 or self.hi < 0)

    def as_dict(self, digits: int = 4) -> dict:
        r = lambda x: None if x is None else round(x, digits)  # noqa: E731
        return {"mean": r(self.mean), "n": self.n, "ci95": [r(self.lo), r(self.hi)], "ci_method": self.method}


def wilson_interval(mean: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``mean`` observed over ``n`` trials (``n >= 1``)."""
    if n < 1:
        raise ValueError("the Wilson interval needs at least one sample")
    if not 0.0 <= mean <= 1.0:
        raise ValueError(f"a proportion lies in [0, 1], got {mean}")
    z2 = z * z
    centre = (mean + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(mean * (1 - mean) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_interval(scores: Sequence[float]) -> Interval:
    """Mean of scores in ``[0, 1]`` with its Wilson interval (see the module docstring)."""
    n = len(scores)
    if n == 0:
        raise ValueError("no scores")
    mean = math.fsum(scores) / n
    lo, hi = wilson_interval(min(1.0, max(0.0, mean)), n)
    return Interval(mean, n, lo, hi, WILSON)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
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
    """Regularised incomplete beta function ``I_x(a, b)``."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """Student-t distribution function with ``df`` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on :func:`t_cdf`, to 1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must lie in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return 0.5 * (lo + hi)


def paired_difference(sparse: Sequence[float], dense: Sequence[float]) -> Interval:
    """Mean of ``sparse[i] - dense[i]`` with its paired-t 95% interval, clipped to ``[-1, 1]``.

    ``sparse[i]`` and ``dense[i]`` must be the scores of the same prompt.
    """
    if len(sparse) != len(dense):
        raise ValueError(f"paired scores need equal lengths, got {len(sparse)} and {len(dense)}")
    n = len(sparse)
    if n == 0:
        raise ValueError("no pairs")
    diffs = [s - d for s, d in zip(sparse, dense, strict=True)]
    mean = math.fsum(diffs) / n
    if n < 2:
        return Interval(mean, n, None, None, PAIRED_T)
    var = math.fsum((x - mean) ** 2 for x in diffs) / (n - 1)
    half = t_quantile(0.975, n - 1) * math.sqrt(var / n)
    return Interval(mean, n, max(-1.0, mean - half), min(1.0, mean + half), PAIRED_T)
