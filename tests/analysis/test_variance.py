"""Closed forms and quadrature against independent direct computations."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, stats

from verl_ext.analysis.variance import (
    GAUSSIAN_GROUP_EXPECTATION,
    bernoulli_kl,
    bernoulli_weight_variance,
    discrete_kl,
    discrete_weight_variance,
    gaussian_weight_variance,
    gaussian_weight_variance_quad,
    gepo_bias,
)

unit = st.floats(min_value=1e-3, max_value=1 - 1e-3)


def _enumerate_bernoulli(a, b):
    """Var_q of both weights by listing the two outcomes y in {0, 1} (no closed form)."""
    q_y = np.array([1 - b, b])
    p_y = np.array([1 - a, a])
    c = float((q_y * q_y).sum())  # E_q[q] = sum_y q(y) q(y)

    def var(w):
        return float((q_y * w**2).sum() - (q_y * w).sum() ** 2)

    return var(p_y / q_y), var(p_y / c), c


@settings(max_examples=60, deadline=None)
@given(unit, unit)
def test_bernoulli_matches_enumeration(a, b):
    got = bernoulli_weight_variance(a, b)
    ratio, group, c = _enumerate_bernoulli(a, b)
    assert got["ratio"] == pytest.approx(ratio, rel=1e-9, abs=1e-12)
    assert got["group_expectation"] == pytest.approx(group, rel=1e-9, abs=1e-12)
    assert got["expectation"] == pytest.approx(c, rel=1e-12)
    assert got["kl"] == pytest.approx(stats.entropy([a, 1 - a], [b, 1 - b]), rel=1e-9, abs=1e-14)


def test_bernoulli_is_vectorised_with_broadcasting():
    a = np.linspace(0.1, 0.9, 3)[:, None]
    b = np.linspace(0.2, 0.8, 4)[None, :]
    got = bernoulli_weight_variance(a, b)
    for key in ("ratio", "group_expectation", "expectation", "kl"):
        assert got[key].shape == (3, 4)
    for i in range(3):
        for j in range(4):
            ratio, group, _ = _enumerate_bernoulli(a[i, 0], b[0, j])
            assert got["ratio"][i, j] == pytest.approx(ratio)
            assert got["group_expectation"][i, j] == pytest.approx(group)


def test_bernoulli_special_points():
    # p = q: the ratio is identically 1, zero variance; a = 1/2: p(y) constant, GEPO weight constant.
    same = bernoulli_weight_variance([0.2, 0.7], [0.2, 0.7])
    np.testing.assert_allclose(same["ratio"], 0.0, atol=1e-12)
    np.testing.assert_allclose(same["kl"], 0.0, atol=1e-12)
    half = bernoulli_weight_variance(0.5, np.array([0.1, 0.6]))
    np.testing.assert_allclose(half["group_expectation"], 0.0, atol=1e-15)
    assert np.all(half["ratio"] > 0)


@pytest.mark.parametrize(
    "a, b, match",
    [
        (0.0, 0.5, r"a must lie strictly inside \(0, 1\); got a = 0\.0"),
        (0.5, 1.0, r"got b = 1\.0"),
        ([0.2, 1.5, 0.3], 0.5, r"got a\[1\] = 1\.5"),
        (0.5, [[0.5, 0.5], [0.5, float("nan")]], r"got b\[1, 1\] = nan"),
        (-0.1, 0.5, r"got a = -0\.1"),
    ],
)
def test_bernoulli_rejects_out_of_range(a, b, match):
    with pytest.raises(ValueError, match=match):
        bernoulli_weight_variance(a, b)
    with pytest.raises(ValueError):
        bernoulli_kl(a, b)


def test_bernoulli_equals_discrete_on_two_points():
    a = np.array([0.05, 0.3, 0.5, 0.95])
    b = np.array([0.9, 0.3, 0.2, 0.05])
    p = np.stack([1 - a, a], axis=-1)
    q = np.stack([1 - b, b], axis=-1)
    bern = bernoulli_weight_variance(a, b)
    disc = discrete_weight_variance(p, q)
    for key in ("ratio", "group_expectation", "expectation", "kl"):
        np.testing.assert_allclose(disc[key], bern[key], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("mu_p, mu_q", [(0.0, 0.0), (0.3, -0.2), (-1.0, 1.0), (2.5, 0.5)])
def test_gaussian_closed_form_matches_quadrature(mu_p, mu_q):
    closed = gaussian_weight_variance(mu_p, mu_q)
    quad = gaussian_weight_variance_quad(mu_p, mu_q)
    for key in ("ratio", "group_expectation", "expectation", "kl"):
        assert quad[key] == pytest.approx(closed[key], rel=1e-8, abs=1e-10), key


def test_gaussian_group_expectation_constant_independently():
    # int N(y; mu, 1)^2 dy computed with scipy's own normal pdf.
    val, _ = integrate.quad(lambda y: stats.norm.pdf(y, 0.7) ** 2, -np.inf, np.inf)
    assert GAUSSIAN_GROUP_EXPECTATION == pytest.approx(val, rel=1e-10)
    assert GAUSSIAN_GROUP_EXPECTATION == pytest.approx(1 / (2 * math.sqrt(math.pi)))


def test_gaussian_vectorised_and_validated():
    got = gaussian_weight_variance(np.zeros((2, 1)), np.linspace(-1, 1, 5))
    assert got["ratio"].shape == (2, 5)
    np.testing.assert_allclose(got["kl"][0], 0.5 * np.linspace(-1, 1, 5) ** 2)
    with pytest.raises(ValueError, match="mu_q"):
        gaussian_weight_variance(0.0, [0.0, np.inf])
    with pytest.raises(ValueError, match="mu_p"):
        gaussian_weight_variance_quad(np.nan, 0.0)


def _random_pair(rng, n, batch=()):
    q = rng.dirichlet(np.ones(n), size=batch or None)
    p = rng.dirichlet(np.full(n, 0.5), size=batch or None)
    return p, q


def test_discrete_against_loops(rng):
    """Batch results equal a per-pair loop with the textbook E[w^2] - E[w]^2."""
    p, q = _random_pair(rng, 6, (7,))
    adv = rng.uniform(-2, 2, size=(7, 6))
    got = discrete_weight_variance(p, q, adv)
    for i in range(7):
        c = sum(qq * qq for qq in q[i])
        w1 = adv[i] * p[i] / q[i]
        w2 = adv[i] * p[i] / c
        var1 = np.dot(q[i], w1**2) - np.dot(q[i], w1) ** 2
        var2 = np.dot(q[i], w2**2) - np.dot(q[i], w2) ** 2
        assert got["ratio"][i] == pytest.approx(var1, rel=1e-9)
        assert got["group_expectation"][i] == pytest.approx(var2, rel=1e-9)
        assert got["kl"][i] == pytest.approx(stats.entropy(p[i], q[i]), rel=1e-9)
    np.testing.assert_allclose(discrete_kl(p, q), got["kl"])


def test_discrete_allows_zero_mass_where_p_is_zero():
    p = np.array([0.5, 0.5, 0.0])
    q = np.array([0.25, 0.25, 0.5])
    got = discrete_weight_variance(p, q)
    # w = p/q takes 2 w.p. 1/2 and 0 w.p. 1/2: variance 1.
    assert got["ratio"] == pytest.approx(1.0)
    assert got["kl"] == pytest.approx(math.log(2))


@pytest.mark.parametrize(
    "p, q, match",
    [
        ([0.5, 0.6], [0.5, 0.5], "p must sum to 1"),
        ([0.5, 0.5], [1.2, -0.2], r"q must be finite and non-negative; got q\[1\] = -0\.2"),
        ([0.5, 0.5], [1.0, 0.0], r"q is 0 but p > 0 at index \[1\]"),
        ([0.5, 0.5], [0.2, 0.3, 0.5], "same support size"),
        (0.5, 0.5, r"shape \(\.\.\., n\)"),
    ],
)
def test_discrete_rejects_bad_distributions(p, q, match):
    with pytest.raises(ValueError, match=match):
        discrete_weight_variance(p, q)


def test_discrete_rejects_bad_advantage():
    p = np.array([0.5, 0.5])
    with pytest.raises(ValueError, match="advantage"):
        discrete_weight_variance(p, p, [1.0, np.nan])
    with pytest.raises(ValueError, match="does not broadcast"):
        discrete_weight_variance(p, p, [1.0, 2.0, 3.0])


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.integers(0, 2**32 - 1), st.floats(0.1, 5.0))
def test_advantage_scaling(n, seed, k):
    """Multiplying A by k multiplies both variances by k^2."""
    rng = np.random.default_rng(seed)
    p, q = _random_pair(rng, n)
    q = np.maximum(q, 1e-9)
    q /= q.sum()
    adv = rng.uniform(-1, 1, n)
    one = discrete_weight_variance(p, q, adv)
    scaled = discrete_weight_variance(p, q, k * adv)
    for key in ("ratio", "group_expectation"):
        assert scaled[key] == pytest.approx(k**2 * one[key], rel=1e-8, abs=1e-12)


def test_gepo_bias_definitions(rng):
    p, q = _random_pair(rng, 5, (50,))
    adv = rng.uniform(-1, 1, (50, 5))
    got = gepo_bias(p, q, adv)
    c = (q**2).sum(-1)
    expected = np.abs((p * adv).sum(-1) - (q * p * adv).sum(-1) / c)
    np.testing.assert_allclose(got["bias"], expected, rtol=1e-10)
    np.testing.assert_allclose(got["gspo_bias"], 0.0, atol=1e-12)
    assert np.all(got["bias"] <= got["worst_case"] + 1e-12)
    assert np.all(got["worst_case"] <= got["valid_bound"] + 1e-12)
    # The worst case is attained by A* = max|A| sign(p - q p / E_q q).
    a_star = np.abs(adv).max(-1, keepdims=True) * np.sign(p - q * p / c[:, None])
    np.testing.assert_allclose(gepo_bias(p, q, a_star)["bias"], got["worst_case"], rtol=1e-10)
