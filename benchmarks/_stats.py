"""Small-sample statistics for the benchmarks: mean, standard deviation and paired Student-t intervals.

Seeds are few (3 per arm), so intervals use Student's t with ``n - 1`` degrees of freedom; its quantile is
computed here (numerical integration of the density, then bisection) so the benchmarks need no SciPy.

Ratios (perplexity of one arm over another, replica spread of one routing over another) are compared on the
log scale: per seed ``d = log(a / b)``, the interval is ``mean(d) +- t * sd(d) / sqrt(n)``, and it is reported
back as a ratio, or as a percent change ``100 * (exp(d) - 1)``.
"""

from __future__ import annotations

import functools
import math


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def std(values: list[float]) -> float:
    """Sample standard deviation (n - 1 in the denominator); nan below two values."""
    n = len(values)
    if n < 2:
        return math.nan
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))


def _t_density(x: float, df: int) -> float:
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))


def t_cdf(x: float, df: int) -> float:
    """P(T <= x) for Student's t with ``df`` degrees of freedom (Simpson's rule on [0, |x|])."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    a = abs(x)
    if a == 0:
        return 0.5
    # The density is smooth and unimodal: 2000 Simpson panels on [0, |x|] (|x| <= ~100 here) are exact to
    # ~1e-12.
    n = 2000
    h = a / n
    total = _t_density(0.0, df) + _t_density(a, df)
    for i in range(1, n):
        total += (4 if i % 2 else 2) * _t_density(i * h, df)
    half = min(total * h / 3, 0.5)
    return 0.5 + half if x > 0 else 0.5 - half


@functools.cache
def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        low, high = high, high * 2
    for _ in range(60):
        mid = (low + high) / 2
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def interval(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the two-sided Student-t interval of the mean; low = high = nan below two values."""
    m = mean(values)
    n = len(values)
    if n < 2:
        return m, math.nan, math.nan
    half = t_quantile(0.5 + level / 2, n - 1) * std(values) / math.sqrt(n)
    return m, m - half, m + half


def paired_log_ratio(a: list[float], b: list[float], level: float = 0.95) -> dict:
    """Paired comparison of positive quantities ``a[i]`` against ``b[i]`` (the same seed ``i``).

    Returns the per-seed ratios, and the geometric-mean ratio with its ``level`` interval, each as a ratio and
    as a percent change (``pct``, ``pct_low``, ``pct_high``).
    """
    if len(a) != len(b) or not a:
        raise ValueError(f"paired comparison needs equally many values, got {len(a)} and {len(b)}")
    logs = [math.log(x / y) for x, y in zip(a, b)]
    m, low, high = interval(logs, level)
    return {
        "n": len(logs),
        "per_seed": [x / y for x, y in zip(a, b)],
        "ratio": math.exp(m),
        "low": math.exp(low),
        "high": math.exp(high),
        "pct": 100 * (math.exp(m) - 1),
        "pct_low": 100 * (math.exp(low) - 1),
        "pct_high": 100 * (math.exp(high) - 1),
    }
