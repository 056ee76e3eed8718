"""Exact (closed-form / quadrature) importance-weight variances, biases and the GEPO theorems.

Notation (GEPO, arXiv 2508.17850): ``q`` is the sampler's distribution, ``p`` the learner's,
samples ``y ~ q``. Compared: the ordinary ratio ``p(y) / q(y)`` (GRPO/GSPO style) and the
group-expectation weight ``p(y) / E_q[q]``, ``E_q[q] = sum_y q(y)^2`` (densities: ``int q(y)^2 dy``),
a constant, so ``Var_q[p / E_q[q]] = Var_q[p(y)] / (E_q[q])^2``. Families: Bernoulli
(:func:`bernoulli_weight_variance`), unit-variance Gaussians (:func:`gaussian_weight_variance`,
closed form; :func:`gaussian_weight_variance_quad`, ``scipy.integrate.quad``) and general discrete
``p, q`` [..., n] with an optional advantage ``A`` [..., n] (:func:`discrete_weight_variance`,
Theorems 1 and 3; :func:`gepo_bias`, Theorem 2). Everything here is exact;
:mod:`verl_ext.analysis.montecarlo` holds the Monte-Carlo counterparts that check it.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import integrate

__all__ = [
    "bernoulli_weight_variance",
    "bernoulli_kl",
    "gaussian_weight_variance",
    "gaussian_weight_variance_quad",
    "gaussian_kl",
    "discrete_weight_variance",
    "discrete_kl",
    "gepo_bias",
    "theorem1_constants",
    "theorem3_constants",
    "theorem1_counterexample",
    "GAUSSIAN_GROUP_EXPECTATION",
]

#: ``E_q[q] = int q(y)^2 dy`` for ``q = N(mu, 1)``, independent of ``mu``.
GAUSSIAN_GROUP_EXPECTATION = 1.0 / (2.0 * math.sqrt(math.pi))

_SUM_TOL = 1e-6


# --------------------------------------------------------------------------- validation


def _first_bad(mask: np.ndarray) -> str:
    """Index of the first True entry of ``mask`` as ``"[i, j]"`` (``""`` for a scalar)."""
    idx = tuple(int(i) for i in np.argwhere(mask)[0])
    return "[" + ", ".join(map(str, idx)) + "]" if idx else ""


def _open_unit(name: str, x) -> np.ndarray:
    arr = np.asarray(x, dtype=float)
    bad = ~((arr > 0.0) & (arr < 1.0))  # also catches NaN
    if bad.any():
        where = _first_bad(bad)
        raise ValueError(f"{name} must lie strictly inside (0, 1); got {name}{where} = {float(arr[bad].flat[0])!r}")
    return arr


def _finite(name: str, x) -> np.ndarray:
    arr = np.asarray(x, dtype=float)
    bad = ~np.isfinite(arr)
    if bad.any():
        raise ValueError(f"{name} must be finite; got {name}{_first_bad(bad)} = {float(arr[bad].flat[0])!r}")
    return arr


def _distribution(name: str, x) -> np.ndarray:
    """Validate a (batch of) probability vector(s) along the last axis."""
    arr = np.asarray(x, dtype=float)
    if arr.ndim == 0 or arr.shape[-1] < 1:
        raise ValueError(f"{name} must have shape (..., n) with n >= 1; got shape {arr.shape}")
    bad = ~(np.isfinite(arr) & (arr >= 0.0))
    if bad.any():
        raise ValueError(
            f"{name} must be finite and non-negative; got {name}{_first_bad(bad)} = {float(arr[bad].flat[0])!r}"
        )
    sums = arr.sum(axis=-1)
    off = np.abs(sums - 1.0) > _SUM_TOL
    if np.any(off):
        s = np.asarray(sums)[off].flat[0] if np.ndim(sums) else float(sums)
        raise ValueError(f"{name} must sum to 1 along its last axis; a row sums to {s!r}")
    return arr


def _pair(p, q) -> tuple[np.ndarray, np.ndarray]:
    p = _distribution("p", p)
    q = _distribution("q", q)
    if p.shape[-1] != q.shape[-1]:
        raise ValueError(f"p and q need the same support size; got {p.shape[-1]} and {q.shape[-1]}")
    p, q = np.broadcast_arrays(p, q)
    uncovered = (q == 0.0) & (p > 0.0)
    if uncovered.any():
        raise ValueError(
            "p must be absolutely continuous w.r.t. q (q(y) > 0 wherever p(y) > 0); "
            f"q is 0 but p > 0 at index {_first_bad(uncovered)}"
        )
    return p, q


def _advantage(advantage, shape) -> np.ndarray:
    if advantage is None:
        return np.ones(shape)
    adv = _finite("advantage", advantage)
    try:
        return np.broadcast_to(adv, shape)
    except ValueError:
        raise ValueError(
            f"advantage of shape {adv.shape} does not broadcast to the distributions' shape {shape}"
        ) from None


def _safe_div(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den with 0/0 := 0 (terms where q = 0 also have p = 0 after validation)."""
    out = np.zeros(np.broadcast(num, den).shape)
    np.divide(num, den, out=out, where=den > 0)
    return out


# --------------------------------------------------------------------------- Bernoulli


def bernoulli_kl(a, b) -> np.ndarray:
    """KL(Bern(a) || Bern(b)) for arrays ``a, b`` in (0, 1); broadcast shape."""
    a = _open_unit("a", a)
    b = _open_unit("b", b)
    return a * np.log(a / b) + (1 - a) * np.log((1 - a) / (1 - b))


def bernoulli_weight_variance(a, b) -> dict:
    """Closed-form weight variances for ``p = Bern(a)``, ``q = Bern(b)``, ``y ~ q``.

    Args:
        a, b: array-likes (any broadcastable shapes) with entries strictly in (0, 1).

    Returns:
        dict of arrays of the broadcast shape:

        * ``"ratio"``: ``Var_q[p/q] = a^2/b + (1-a)^2/(1-b) - 1`` (the chi^2 divergence);
        * ``"group_expectation"``: ``Var_q[p/E_q[q]] = b(1-b)(2a-1)^2 / (b^2+(1-b)^2)^2``
          (``p(y) = (1-a) + (2a-1) y`` is affine in ``y ~ Bern(b)``);
        * ``"expectation"``: ``E_q[q] = b^2 + (1-b)^2``;
        * ``"kl"``: ``KL(p || q)``.

    Raises:
        ValueError: if any entry of ``a`` or ``b`` is outside (0, 1), naming it.
    """
    a = _open_unit("a", a)
    b = _open_unit("b", b)
    a, b = np.broadcast_arrays(a, b)
    expectation = b**2 + (1 - b) ** 2
    ratio = a**2 / b + (1 - a) ** 2 / (1 - b) - 1.0
    group = b * (1 - b) * (2 * a - 1) ** 2 / expectation**2
    return {
        "ratio": ratio,
        "group_expectation": group,
        "expectation": expectation,
        "kl": bernoulli_kl(a, b),
    }


# --------------------------------------------------------------------------- Gaussian


def gaussian_kl(mu_p, mu_q) -> np.ndarray:
    """KL(N(mu_p,1) || N(mu_q,1)) = (mu_p - mu_q)^2 / 2, broadcast shape."""
    mu_p = _finite("mu_p", mu_p)
    mu_q = _finite("mu_q", mu_q)
    return 0.5 * (mu_p - mu_q) ** 2


def gaussian_weight_variance(mu_p, mu_q) -> dict:
    """Closed forms for ``p = N(mu_p, 1)``, ``q = N(mu_q, 1)``, ``y ~ q``; ``d = mu_p - mu_q``.

    * ``"ratio"``: ``Var_q[p/q] = int p^2/q - 1 = exp(d^2) - 1``;
    * ``"expectation"``: ``E_q[q] = int q^2 = 1/(2 sqrt(pi))``;
    * ``"group_expectation"``: ``Var_q[p]/E_q[q]^2`` with ``E_q[p] = exp(-d^2/4)/(2 sqrt(pi))``
      and ``E_q[p^2] = exp(-d^2/3)/(2 pi sqrt(3))``, i.e.
      ``(2/sqrt(3)) exp(-d^2/3) - exp(-d^2/2)``;
    * ``"kl"``: ``d^2/2``.

    Args: ``mu_p, mu_q`` broadcastable finite arrays.  Returns dict of arrays (broadcast shape).
    """
    mu_p = _finite("mu_p", mu_p)
    mu_q = _finite("mu_q", mu_q)
    d2 = (mu_p - mu_q) ** 2
    ratio = np.expm1(d2)
    group = (2.0 / math.sqrt(3.0)) * np.exp(-d2 / 3.0) - np.exp(-d2 / 2.0)
    return {
        "ratio": ratio,
        "group_expectation": group,
        "expectation": np.full(d2.shape, GAUSSIAN_GROUP_EXPECTATION),
        "kl": 0.5 * d2,
    }


def _normal_pdf(y, mu):
    return math.exp(-0.5 * (y - mu) ** 2) / math.sqrt(2.0 * math.pi)


def _quad(f, lo, hi) -> float:
    val, _err = integrate.quad(f, lo, hi, epsabs=1e-13, epsrel=1e-11, limit=200)
    return val


def gaussian_weight_variance_quad(mu_p, mu_q) -> dict:
    """Same quantities as :func:`gaussian_weight_variance`, by numerical integration.

    Each scalar pair is integrated with ``scipy.integrate.quad`` over a window of +-15 standard
    deviations around every integrand's centre (``mu_p``, ``mu_q``, ``2 mu_p - mu_q``), outside of
    which every integrand is below ``exp(-100)``.  Loops in Python: use for checks and grids of a
    few thousand points, not in training code.
    """
    mu_p = _finite("mu_p", mu_p)
    mu_q = _finite("mu_q", mu_q)
    mp, mq = np.broadcast_arrays(mu_p, mu_q)
    out = {k: np.empty(mp.shape) for k in ("ratio", "group_expectation", "expectation", "kl")}
    for idx in np.ndindex(mp.shape):
        a, b = float(mp[idx]), float(mq[idx])
        centres = (a, b, 2 * a - b)
        lo, hi = min(centres) - 15.0, max(centres) + 15.0
        p = lambda y: _normal_pdf(y, a)  # noqa: E731
        q = lambda y: _normal_pdf(y, b)  # noqa: E731
        chi2p1 = _quad(lambda y: p(y) ** 2 / q(y), lo, hi)  # E_q[(p/q)^2]
        eq_q = _quad(lambda y: q(y) ** 2, lo, hi)  # E_q[q]
        eq_p = _quad(lambda y: q(y) * p(y), lo, hi)  # E_q[p]
        eq_p2 = _quad(lambda y: q(y) * p(y) ** 2, lo, hi)  # E_q[p^2]
        kl = _quad(lambda y: p(y) * (math.log(p(y)) - math.log(q(y))) if p(y) > 0 else 0.0, lo, hi)
        out["ratio"][idx] = chi2p1 - 1.0
        out["expectation"][idx] = eq_q
        out["group_expectation"][idx] = (eq_p2 - eq_p**2) / eq_q**2
        out["kl"][idx] = kl
    return out


# --------------------------------------------------------------------------- discrete


def discrete_kl(p, q) -> np.ndarray:
    """KL(p || q) along the last axis; ``p, q`` shape ``(..., n)`` -> ``(...)``."""
    p, q = _pair(p, q)
    terms = np.where(p > 0, p * (np.log(np.where(p > 0, p, 1.0)) - np.log(np.where(p > 0, q, 1.0))), 0.0)
    return terms.sum(axis=-1)


def discrete_weight_variance(p, q, advantage=None) -> dict:
    """Exact (advantage-weighted) weight variances for discrete ``p, q`` under ``y ~ q``.

    Args:
        p, q: shape ``(..., n)`` probability vectors (broadcastable), ``q > 0`` wherever ``p > 0``.
        advantage: ``A(y)``, broadcastable to ``(..., n)``; ``None`` means ``A = 1``
            (then the results are Theorem 1's quantities).

    Returns:
        dict of arrays of shape ``(...)``:

        * ``"ratio"``: ``Var_q[A p/q] = sum A^2 p^2/q - (sum A p)^2``;
        * ``"group_expectation"``: ``Var_q[A p/E_q q] = (sum q A^2 p^2 - (sum q A p)^2)/||q||_2^4``;
        * ``"expectation"``: ``E_q[q] = ||q||_2^2``;
        * ``"kl"``: ``KL(p || q)``.
    """
    p, q = _pair(p, q)
    adv = _advantage(advantage, p.shape)
    c = (q**2).sum(axis=-1)
    ratio = _safe_div((adv * p) ** 2, q).sum(axis=-1) - (adv * p).sum(axis=-1) ** 2
    m1 = (q * adv * p).sum(axis=-1)
    m2 = (q * (adv * p) ** 2).sum(axis=-1)
    group = (m2 - m1**2) / c**2
    return {
        "ratio": np.maximum(ratio, 0.0),
        "group_expectation": np.maximum(group, 0.0),
        "expectation": c,
        "kl": discrete_kl(p, q),
    }


def gepo_bias(p, q, advantage) -> dict:
    """Theorem 2: bias of the group-expectation estimate of ``E_p[A]`` (exact expectations).

    Args:
        p, q: shape ``(..., n)`` probability vectors; advantage: ``A``, broadcastable to them.

    Returns:
        dict of arrays of shape ``(...)``:

        * ``"bias"``: ``|E_p[A] - E_q[p A / E_q[q]]|``;
        * ``"gspo_bias"``: ``|E_p[A] - E_q[(p/q) A]|`` (0 up to rounding: p/q is unbiased);
        * ``"paper_bound"``: ``||p||_2 / ||q||_2`` (the bound claimed by Theorem 2);
        * ``"worst_case"``: ``max_{|A'| <= max|A|} |bias|  = max|A| * ||p - q p/E_q[q]||_1``;
        * ``"valid_bound"``: ``max|A| * (1 + ||p||_2/||q||_2)`` (triangle + Cauchy-Schwarz).
    """
    p, q = _pair(p, q)
    adv = _advantage(advantage, p.shape)
    c = (q**2).sum(axis=-1, keepdims=True)
    target = (p * adv).sum(axis=-1)
    gepo = (q * p * adv / c).sum(axis=-1)
    gspo = (q * _safe_div(p, q) * adv).sum(axis=-1)
    a_max = np.abs(adv).max(axis=-1)
    norm_ratio = np.sqrt((p**2).sum(axis=-1)) / np.sqrt((q**2).sum(axis=-1))
    return {
        "bias": np.abs(target - gepo),
        "gspo_bias": np.abs(target - gspo),
        "paper_bound": norm_ratio,
        "worst_case": a_max * np.abs(p - q * p / c).sum(axis=-1),
        "valid_bound": a_max * (1.0 + norm_ratio),
    }


# --------------------------------------------------------------------------- theorem constants


def theorem1_constants(q) -> dict:
    """Constants ``C`` for Theorem 1, ``Var[p/q] - Var[p/E_q q] >= exp(KL(p||q)) - C``.

    The paper's Theorem 1 only says "there exists C".  Two readings, both functions of ``q``
    (shape ``(..., n)`` -> ``(...)``):

    * ``"paper"``: ``1/||q||_2^2`` -- Theorem 3's ``C_adv`` at ``A = 1``.  It is attained
      (equality) for uniform ``q`` and a point-mass ``p``, and it is **violated** for some
      non-uniform ``q`` on 3+ points (see docs/theory.md).
    * ``"valid"``: ``1 + max_y q(y)(1-q(y)) / ||q||_2^4``; a proof: ``Var_q[p/q] = E_p[p/q] - 1
      >= exp(KL) - 1`` (Jensen), and ``Var_q[p(y)] = p^T (diag q - q q^T) p`` is convex in ``p``
      so its maximum over the simplex is at a vertex, ``max_y q(y)(1 - q(y))``.
    """
    q = _distribution("q", q)
    c = (q**2).sum(axis=-1)
    return {"paper": 1.0 / c, "valid": 1.0 + (q * (1 - q)).max(axis=-1) / c**2}


def theorem3_constants(q, advantage) -> dict:
    """Constants of Theorem 3: ``Var_q[A p/q] - Var_q[A p/E_q q] >= A_min^2 exp(KL) - C``.

    Args: ``q`` shape ``(..., n)``, ``advantage`` broadcastable to it (``|A| >= A_min > 0``).

    Returns dict of arrays ``(...)``: ``"a_min"``, ``"a_max"``, ``"paper"`` =
    ``A_max^2/||q||_2^2`` (the paper's ``C_adv``), and ``"valid"`` =
    ``A_max^2 (1 + ||q||_inf / ||q||_2^4)``, which does hold: ``Var_q[A p/q] >= A_min^2 E_p[p/q]
    - (E_p A)^2 >= A_min^2 exp(KL) - A_max^2`` and ``Var_q[A p/E_q q] <= A_max^2 E_q[p^2]/||q||^4
    <= A_max^2 ||q||_inf/||q||_2^4``.
    """
    q = _distribution("q", q)
    adv = np.abs(_advantage(advantage, q.shape))
    a_min = adv.min(axis=-1)
    if np.any(a_min <= 0):
        raise ValueError("Theorem 3 needs |A(y)| >= A_min > 0 on the support; an advantage is 0")
    a_max = adv.max(axis=-1)
    c = (q**2).sum(axis=-1)
    return {
        "a_min": a_min,
        "a_max": a_max,
        "paper": a_max**2 / c,
        "valid": a_max**2 * (1.0 + q.max(axis=-1) / c**2),
    }


def theorem1_counterexample(q0: float = 0.5, m: int = 2, eps: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
    """A pair violating Theorem 1 with ``C = 1/||q||_2^2`` (equivalently Theorem 3 at ``A = 1``).

    ``q = (q0, (1-q0)/m, ..., (1-q0)/m)`` on ``m + 1`` points and ``p = (1 - eps, eps/m, ...)``.
    For ``eps -> 0`` (``p`` a point mass) one gets ``diff - (exp(KL) - C) = 1/c - 1 - q0(1-q0)/c^2``
    with ``c = ||q||_2^2``, negative iff ``c(1 - c) < q0(1 - q0)``; e.g. ``q0 = 1/2, m = 2``:
    ``-1/9``; ``m -> inf``: ``-1``.  Returns ``(p, q)``, each of shape ``(m + 1,)``.
    """
    if not (0 < q0 < 1) or int(m) != m or m < 1 or not (0 <= eps < 1):
        raise ValueError(f"need 0 < q0 < 1, integer m >= 1, 0 <= eps < 1; got {q0}, {m}, {eps}")
    q = np.concatenate([[q0], np.full(int(m), (1 - q0) / m)])
    p = np.concatenate([[1 - eps], np.full(int(m), eps / m)])
    return p, q
