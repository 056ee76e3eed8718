"""Monte-Carlo estimators of the quantities in :mod:`verl_ext.analysis.variance`.

Every estimator takes a seeded ``numpy.random.Generator`` and returns, for each quantity, an
estimate and its standard error (``"<name>"`` and ``"<name>_se"``), so a test can compare an
exact value with ``|exact - estimate| <= z * se`` for a ``z`` chosen from a false-alarm rate
(:func:`z_threshold`), never a hand-tuned tolerance.

Standard errors: a mean of i.i.d. ``x_i`` has ``se = sd(x)/sqrt(n)``; the (plug-in) variance
``mean((x - xbar)^2)`` has, by the delta method, ``se ~= sd((x - xbar)^2)/sqrt(n)``.

Also here: the finite-group estimators of ``E_p[A]`` that GSPO and GEPO use
(:func:`group_estimates`), including GEPO's in-group estimate of ``E_q[q]``,
``sum_j q_j^2 / sum_j q_j`` (:func:`group_expectation_estimate`).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from .variance import (
    GAUSSIAN_GROUP_EXPECTATION,
    _advantage,
    _finite,
    _open_unit,
    _pair,
)

__all__ = [
    "z_threshold",
    "mean_and_se",
    "variance_and_se",
    "mc_bernoulli_weight_variance",
    "mc_gaussian_weight_variance",
    "mc_discrete_weight_variance",
    "mc_gepo_bias",
    "group_expectation_estimate",
    "group_estimates",
]


def z_threshold(alpha: float = 1e-6, n_checks: int = 1) -> float:
    """Two-sided normal quantile for family-wise false-alarm rate ``alpha`` over ``n_checks``
    comparisons (Bonferroni): ``P(|Z| > z) = alpha / n_checks``."""
    if not (0 < alpha < 1) or n_checks < 1:
        raise ValueError(f"need 0 < alpha < 1 and n_checks >= 1; got alpha={alpha}, n_checks={n_checks}")
    return float(stats.norm.isf(alpha / (2 * n_checks)))


def _check_n(n: int) -> int:
    if int(n) != n or n < 2:
        raise ValueError(f"n_samples must be an integer >= 2; got {n!r}")
    return int(n)


def mean_and_se(x: np.ndarray) -> tuple[float, float]:
    """Sample mean of 1-d ``x`` (shape ``(n,)``) and its standard error."""
    x = np.asarray(x, dtype=float)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))


def variance_and_se(x: np.ndarray) -> tuple[float, float]:
    """Plug-in variance of 1-d ``x`` (shape ``(n,)``) and its delta-method standard error."""
    x = np.asarray(x, dtype=float)
    sq = (x - x.mean()) ** 2
    return float(sq.mean()), float(sq.std(ddof=1) / math.sqrt(x.size))


def _pack(**pairs: tuple[float, float]) -> dict:
    out = {}
    for name, (est, se) in pairs.items():
        out[name] = est
        out[name + "_se"] = se
    return out


def mc_bernoulli_weight_variance(a: float, b: float, n_samples: int, rng: np.random.Generator) -> dict:
    """MC estimates for scalar ``p = Bern(a)``, ``q = Bern(b)``.

    ``"ratio"``/``"group_expectation"``: variances of ``p(y)/q(y)`` and ``p(y)/E_q[q]``,
    ``y ~ q`` (``E_q[q]`` exact, so only the variance is estimated); ``"expectation"``: mean of
    ``q(y)``, ``y ~ q``; ``"kl"``: mean of ``log p(y)/q(y)``, ``y ~ p``.  Each with ``*_se``.
    """
    a = float(_open_unit("a", a))
    b = float(_open_unit("b", b))
    n = _check_n(n_samples)
    y = rng.random(n) < b
    p_y = np.where(y, a, 1 - a)
    q_y = np.where(y, b, 1 - b)
    c = b**2 + (1 - b) ** 2
    z = rng.random(n) < a
    log_ratio_p = np.where(z, math.log(a / b), math.log((1 - a) / (1 - b)))
    return _pack(
        ratio=variance_and_se(p_y / q_y),
        group_expectation=variance_and_se(p_y / c),
        expectation=mean_and_se(q_y),
        kl=mean_and_se(log_ratio_p),
    )


def mc_gaussian_weight_variance(mu_p: float, mu_q: float, n_samples: int, rng: np.random.Generator) -> dict:
    """MC estimates for scalar ``p = N(mu_p, 1)``, ``q = N(mu_q, 1)``; keys as for Bernoulli.

    Note ``Var_q[p/q]`` has a finite fourth moment (so a finite standard error) for all means,
    but its relative error grows like ``exp(3 d^2)``; keep ``|mu_p - mu_q|`` below ~1 in checks.
    """
    mu_p = float(_finite("mu_p", mu_p))
    mu_q = float(_finite("mu_q", mu_q))
    n = _check_n(n_samples)
    y = rng.normal(mu_q, 1.0, n)
    log_p = -0.5 * (y - mu_p) ** 2 - 0.5 * math.log(2 * math.pi)
    log_q = -0.5 * (y - mu_q) ** 2 - 0.5 * math.log(2 * math.pi)
    x = rng.normal(mu_p, 1.0, n)
    log_ratio_p = -0.5 * (x - mu_p) ** 2 + 0.5 * (x - mu_q) ** 2
    return _pack(
        ratio=variance_and_se(np.exp(log_p - log_q)),
        group_expectation=variance_and_se(np.exp(log_p) / GAUSSIAN_GROUP_EXPECTATION),
        expectation=mean_and_se(np.exp(log_q)),
        kl=mean_and_se(log_ratio_p),
    )


def _single_pair_draws(caller: str, p, q, advantage, n_samples: int, rng: np.random.Generator):
    """Checked inputs of a one-pair estimator and its samples: ``(p, q, A, E_q[q], y, x)`` with
    ``p, q, A`` shape ``(n,)``, ``y ~ q`` and then ``x ~ p`` index arrays of ``n_samples``."""
    p, q = _pair(p, q)
    if p.ndim != 1:
        raise ValueError(f"{caller} takes single distributions (n,); got {p.shape}")
    adv = _advantage(advantage, p.shape)
    n = _check_n(n_samples)
    y = rng.choice(p.size, size=n, p=q)
    x = rng.choice(p.size, size=n, p=p)
    return p, q, adv, float((q**2).sum()), y, x


def mc_discrete_weight_variance(p, q, n_samples: int, rng: np.random.Generator, advantage=None) -> dict:
    """MC estimates of :func:`~verl_ext.analysis.variance.discrete_weight_variance` for one pair.

    Args: ``p, q`` shape ``(n,)``; ``advantage`` shape ``(n,)`` or ``None`` (``A = 1``).
    Returns ``"ratio"``, ``"group_expectation"``, ``"expectation"``, ``"kl"`` and ``*_se``.
    """
    p, q, adv, c, y, x = _single_pair_draws("mc_discrete_weight_variance", p, q, advantage, n_samples, rng)
    return _pack(
        ratio=variance_and_se(adv[y] * p[y] / q[y]),
        group_expectation=variance_and_se(adv[y] * p[y] / c),
        expectation=mean_and_se(q[y]),
        kl=mean_and_se(np.log(p[x]) - np.log(q[x])),
    )


def mc_gepo_bias(p, q, advantage, n_samples: int, rng: np.random.Generator) -> dict:
    """MC estimates of the two expectations in Theorem 2, shape ``(n,)`` inputs.

    ``"target"`` = mean of ``A(x)``, ``x ~ p`` (estimates ``E_p[A]``); ``"gepo"`` = mean of
    ``p(y) A(y)/E_q[q]``, ``y ~ q``; ``"gspo"`` = mean of ``p(y) A(y)/q(y)``, ``y ~ q``.  The
    bias is ``|target - gepo|``; each estimate comes with ``*_se``.
    """
    p, q, adv, c, y, x = _single_pair_draws("mc_gepo_bias", p, q, advantage, n_samples, rng)
    return _pack(
        target=mean_and_se(adv[x]),
        gepo=mean_and_se(p[y] * adv[y] / c),
        gspo=mean_and_se(p[y] * adv[y] / q[y]),
    )


def group_expectation_estimate(q_group: np.ndarray) -> np.ndarray:
    """GEPO's in-group estimate of ``E_q[q]``: ``sum_j q_j^2 / sum_j q_j`` over the last axis.

    Args: ``q_group`` shape ``(..., G)``, the sampler probabilities of the ``G`` group members.
    Returns shape ``(...)``.  For ``y_j ~ q`` i.i.d. this converges (G -> inf) to
    ``sum q^3 / sum q^2``, not to ``E_q[q] = sum q^2`` (the plain mean ``mean_j q_j`` does).
    """
    qg = np.asarray(q_group, dtype=float)
    if qg.ndim == 0 or qg.shape[-1] < 1:
        raise ValueError(f"q_group must have shape (..., G) with G >= 1; got {qg.shape}")
    if np.any(~np.isfinite(qg)) or np.any(qg < 0):
        raise ValueError("q_group must be finite and non-negative")
    s = qg.sum(axis=-1)
    if np.any(s <= 0):
        raise ValueError("every group needs at least one member with q > 0")
    return (qg**2).sum(axis=-1) / s


def group_estimates(p, q, advantage, group_size: int, n_groups: int, rng: np.random.Generator) -> dict:
    """Per-group estimates of ``E_p[A]`` from ``G = group_size`` samples ``y_j ~ q``.

    Args: ``p, q, advantage`` shape ``(n,)``.
    Returns dict of arrays of shape ``(n_groups,)``:

    * ``"gspo"``: ``mean_j A_j p_j / q_j`` (sequence-level ratio, unbiased);
    * ``"gepo"``: ``mean_j A_j p_j / Ehat`` with GEPO's ``Ehat = sum_j q_j^2/sum_j q_j``;
    * ``"gepo_exact"``: ``mean_j A_j p_j / E_q[q]`` (exact group expectation);

    and ``"target"``: the scalar ``E_p[A]``.
    """
    p, q = _pair(p, q)
    if p.ndim != 1:
        raise ValueError(f"group_estimates takes single distributions (n,); got {p.shape}")
    adv = _advantage(advantage, p.shape)
    if int(group_size) != group_size or group_size < 1 or int(n_groups) != n_groups or n_groups < 1:
        raise ValueError(f"group_size and n_groups must be positive integers; got {group_size}, {n_groups}")
    y = rng.choice(p.size, size=(int(n_groups), int(group_size)), p=q)
    pa = p[y] * adv[y]
    return {
        "gspo": (pa / q[y]).mean(axis=-1),
        "gepo": pa.mean(axis=-1) / group_expectation_estimate(q[y]),
        "gepo_exact": pa.mean(axis=-1) / float((q**2).sum()),
        "target": float((p * adv).sum()),
    }
