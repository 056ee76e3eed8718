"""Paired statistics of the study: a paired t confidence interval and test, and the minimum
detectable effect of a paired design.

The study pairs runs by seed (a seed fixes the training prompts, the delay draws and the
evaluation problems), so the difference of two methods' scores on one seed removes what the seed
shares; the n paired differences are treated as i.i.d. normal. :func:`paired_test`: mean, sample
std, standard error, the two-sided (1 - alpha) t interval, the t statistic and its p-value.
:func:`mde`: the smallest true mean difference a two-sided level-alpha paired t test on n pairs
detects with probability ``power`` (exact, noncentral t). :func:`binomial_eval_sd`: the sampling
std of one run's accuracy (the mean of k evaluations of m problems x s samples), the floor of any
run-to-run std. :func:`holm_adjusted`: Holm's step-down adjustment of a family of p-values.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

__all__ = ["PairedTest", "paired_test", "mde", "t_test_power", "binomial_eval_sd", "holm_adjusted"]


@dataclass(frozen=True)
class PairedTest:
    """Summary of n paired differences (see :func:`paired_test`); NaN where n is too small."""

    n: int
    mean: float
    sd: float
    se: float
    ci_low: float
    ci_high: float
    t: float
    p: float
    alpha: float

    def as_dict(self) -> dict:
        return asdict(self)


def _finite(values: Sequence[float]) -> list[float]:
    out = []
    for v in values:
        x = float(v)
        if not math.isfinite(x):
            raise ValueError(f"paired differences must be finite, got {v!r}")
        out.append(x)
    return out


def _check_alpha(alpha: float) -> float:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha={alpha!r} must be in (0, 1)")
    return float(alpha)


def paired_test(diffs: Sequence[float], alpha: float = 0.05) -> PairedTest:
    """Two-sided paired t analysis of ``diffs`` (one difference per seed).

    n = 0: everything NaN. n = 1: the mean, the rest NaN. sd = 0 with n >= 2: the interval is the
    point, t = +-inf and p = 0 (or t = NaN and p = 1 when the mean is 0 too).
    """
    from scipy import stats

    alpha = _check_alpha(alpha)
    d = _finite(diffs)
    n = len(d)
    nan = math.nan
    if n == 0:
        return PairedTest(0, nan, nan, nan, nan, nan, nan, nan, alpha)
    mean = sum(d) / n
    if n == 1:
        return PairedTest(1, mean, nan, nan, nan, nan, nan, nan, alpha)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    se = sd / math.sqrt(n)
    half = float(stats.t.ppf(1 - alpha / 2, n - 1)) * se
    if se == 0.0:
        t, p = (nan, 1.0) if mean == 0.0 else (math.copysign(math.inf, mean), 0.0)
    else:
        t = mean / se
        p = float(2 * stats.t.sf(abs(t), n - 1))
    return PairedTest(n, mean, sd, se, mean - half, mean + half, t, p, alpha)


def t_test_power(effect: float, sd: float, n: int, alpha: float = 0.05) -> float:
    """Probability that the two-sided level-``alpha`` one-sample t test on ``n`` differences of
    std ``sd`` rejects when their true mean is ``effect`` (noncentral t, ncp = effect sqrt(n) / sd)."""
    from scipy import stats

    alpha = _check_alpha(alpha)
    if n < 2:
        raise ValueError(f"n={n!r} must be >= 2 for a t test")
    if not (sd > 0 and math.isfinite(sd)):
        raise ValueError(f"sd={sd!r} must be finite and > 0")
    df = n - 1
    crit = stats.t.ppf(1 - alpha / 2, df)
    ncp = effect * math.sqrt(n) / sd
    upper, lower = float(stats.nct.sf(crit, df, ncp)), float(stats.nct.cdf(-crit, df, ncp))
    # far from 0 scipy returns NaN for the tail on the other side; it is 0 there
    upper = upper if math.isfinite(upper) else (1.0 if ncp > 0 else 0.0)
    lower = lower if math.isfinite(lower) else (1.0 if ncp < 0 else 0.0)
    return min(1.0, upper + lower)


def mde(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """Minimum detectable effect: the true mean difference (> 0) at which the two-sided
    level-``alpha`` paired t test on ``n`` pairs whose differences have std ``sd`` has the given
    ``power``. Solved exactly on the noncentral t; about (t_{1-alpha/2} + t_{power}) sd / sqrt(n)."""
    from scipy import optimize, stats

    if not 0.0 < power < 1.0:
        raise ValueError(f"power={power!r} must be in (0, 1)")
    alpha = _check_alpha(alpha)
    if power <= alpha:
        raise ValueError(f"power={power} must exceed alpha={alpha}")
    t_test_power(0.0, sd, n, alpha)  # validates sd and n
    approx = (stats.t.ppf(1 - alpha / 2, n - 1) + stats.t.ppf(power, n - 1)) * sd / math.sqrt(n)
    return float(optimize.brentq(lambda e: t_test_power(e, sd, n, alpha) - power, 0.0, 3 * approx, xtol=1e-12 * sd))


def binomial_eval_sd(accuracy: float, problems: int, samples: int = 1, evaluations: int = 1) -> float:
    """Sampling std of a run's score = mean over ``evaluations`` evaluations, each the accuracy of
    ``samples`` samples on each of ``problems`` problems, when every answer is an independent
    Bernoulli(accuracy) draw: sqrt(a (1 - a) / (problems x samples x evaluations)). A floor: the
    evaluations share their problems and the runs' training differs, which only adds variance."""
    if not 0.0 <= accuracy <= 1.0:
        raise ValueError(f"accuracy={accuracy!r} must be in [0, 1]")
    for name, v in (("problems", problems), ("samples", samples), ("evaluations", evaluations)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    return math.sqrt(accuracy * (1 - accuracy) / (problems * samples * evaluations))


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979), in the order given: with the k p-values
    sorted ascending, p_(i) becomes max_{j <= i} min(1, (k - j + 1) p_(j)). NaN stays NaN and does
    not count in k (a comparison without a test is not one of the family)."""
    ps = [float(p) for p in p_values]
    bad = [p for p in ps if not (math.isnan(p) or 0.0 <= p <= 1.0)]
    if bad:
        raise ValueError(f"p-values must lie in [0, 1] (or be NaN), got {bad}")
    order = sorted((i for i, p in enumerate(ps) if not math.isnan(p)), key=lambda i: ps[i])
    out, running = list(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(order) - rank) * ps[i]))
        out[i] = running
    return out
