"""The paper's inequalities (Theorems 1-3, Figure 2) checked numerically.

What holds is asserted; where the paper's stated constant fails, the counter-example is
asserted as such (see docs/theory.md), so a change in the formulas cannot silently hide it.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import optimize

from verl_ext.analysis.figures import bernoulli_grid, gaussian_grid
from verl_ext.analysis.variance import (
    discrete_weight_variance,
    gepo_bias,
    theorem1_constants,
    theorem1_counterexample,
    theorem3_constants,
)


def _pairs(rng, n_pairs, n, concentration):
    q = rng.dirichlet(np.full(n, concentration), size=n_pairs)
    p = rng.dirichlet(np.full(n, concentration), size=n_pairs)
    q = np.maximum(q, 1e-12)
    q /= q.sum(-1, keepdims=True)
    return p, q


pair_params = st.tuples(st.integers(2, 10), st.integers(0, 2**32 - 1), st.sampled_from([0.1, 0.5, 1.0, 5.0]))


@settings(max_examples=60, deadline=None)
@given(pair_params)
def test_ratio_variance_at_least_exp_kl_minus_one(params):
    """Var_q[p/q] = E_p[p/q] - 1 >= exp(E_p log p/q) - 1 (Jensen)."""
    n, seed, conc = params
    p, q = _pairs(np.random.default_rng(seed), 64, n, conc)
    d = discrete_weight_variance(p, q)
    assert np.all(d["ratio"] >= np.expm1(d["kl"]) * (1 - 1e-9) - 1e-12)


@settings(max_examples=60, deadline=None)
@given(pair_params)
def test_theorem1_with_valid_constant(params):
    n, seed, conc = params
    p, q = _pairs(np.random.default_rng(seed), 64, n, conc)
    d = discrete_weight_variance(p, q)
    diff = d["ratio"] - d["group_expectation"]
    # relative slack: near-point-mass q makes both sides ~1e12, where float64 rounds at ~1e-4
    assert np.all(diff >= np.exp(d["kl"]) - theorem1_constants(q)["valid"] - 1e-9 * np.maximum(1, np.abs(diff)))


@settings(max_examples=60, deadline=None)
@given(pair_params)
def test_theorem3_with_valid_constant(params):
    n, seed, conc = params
    rng = np.random.default_rng(seed)
    p, q = _pairs(rng, 64, n, conc)
    adv = rng.choice([-1, 1], size=(64, n)) * rng.uniform(0.2, 2.0, size=(64, n))
    d = discrete_weight_variance(p, q, adv)
    c = theorem3_constants(q, adv)
    diff = d["ratio"] - d["group_expectation"]
    assert np.all(diff >= c["a_min"] ** 2 * np.exp(d["kl"]) - c["valid"] - 1e-9 * np.maximum(1, np.abs(diff)))


def test_theorem1_paper_constant_holds_for_bernoulli():
    """On two points C = 1/||q||^2 suffices (Var_q[p] <= ||q||^2 (1 - ||q||^2) there)."""
    g = bernoulli_grid(50)
    slack = g["ratio"] - g["group_expectation"] - (np.exp(g["kl"]) - 1 / g["expectation"])
    assert slack.min() >= -1e-12
    # direct check of the two-point inequality on a finer grid of b
    b = np.linspace(1e-3, 1 - 1e-3, 999)
    c = b**2 + (1 - b) ** 2
    assert np.all(b * (1 - b) <= c * (1 - c) + 1e-15)


@pytest.mark.parametrize("q0, m", [(0.5, 2), (0.5, 10), (0.4, 5), (0.3, 50)])
def test_theorem1_paper_constant_counterexample(q0, m):
    p, q = theorem1_counterexample(q0, m, eps=1e-3)
    d = discrete_weight_variance(p, q)
    diff = d["ratio"] - d["group_expectation"]
    assert diff < np.exp(d["kl"]) - theorem1_constants(q)["paper"]
    # Theorem 3 with A = +-1 (A_min = A_max = 1, C_adv = 1/||q||^2) fails on the same pair
    adv = np.where(np.arange(m + 1) == 0, 1.0, -1.0)
    d3 = discrete_weight_variance(p, q, adv)
    c3 = theorem3_constants(q, adv)
    assert d3["ratio"] - d3["group_expectation"] < np.exp(d3["kl"]) - c3["paper"]
    # point-mass limit: slack = 1/c - 1 - q0(1-q0)/c^2, computed by hand from the definitions
    p0, _ = theorem1_counterexample(q0, m, eps=0.0)
    d0 = discrete_weight_variance(p0, q)
    c = q0**2 + (1 - q0) ** 2 / m
    var_ratio = 1 / q0 - 1  # p/q = 1/q0 w.p. q0, else 0
    var_group = q0 * (1 - q0) / c**2  # p/c = 1/c w.p. q0, else 0
    assert d0["ratio"] == pytest.approx(var_ratio)
    assert d0["group_expectation"] == pytest.approx(var_group)
    assert var_ratio - var_group - (1 / q0 - 1 / c) == pytest.approx(1 / c - 1 - q0 * (1 - q0) / c**2)
    assert 1 / c - 1 - q0 * (1 - q0) / c**2 < 0


def test_theorem1_paper_constant_is_tight_for_uniform_q():
    """Uniform q on n points, point-mass p: Var difference = 0 = exp(KL) - 1/||q||^2 = n - n."""
    for n in (2, 5, 17):
        q = np.full(n, 1 / n)
        p = np.eye(n)[0]
        d = discrete_weight_variance(p, q)
        assert d["ratio"] - d["group_expectation"] == pytest.approx(0.0, abs=1e-9)
        assert np.exp(d["kl"]) - theorem1_constants(q)["paper"] == pytest.approx(0.0, abs=1e-9)


def test_theorem1_in_particular_statement_on_random_pairs(rng):
    """'KL > log(1/||q||^2) => Var[p/q] > Var[p/E_q q]': no counter-example on random pairs.

    (Numerical evidence only; the inequality the paper derives it from is false, see above.)"""
    hits = 0
    for n, conc in ((3, 0.3), (5, 0.5), (8, 1.0), (16, 0.2)):
        p, q = _pairs(rng, 20_000, n, conc)
        d = discrete_weight_variance(p, q)
        beyond = d["kl"] > np.log(theorem1_constants(q)["paper"])
        hits += int(beyond.sum())
        assert np.all(d["ratio"][beyond] > d["group_expectation"][beyond])
    assert hits > 1000  # the premise is not vacuous


def test_theorem2_paper_bound_counterexample():
    p = np.full(4, 0.25)
    q = np.array([0.97, 0.01, 0.01, 0.01])
    b = gepo_bias(p, q, 1.0)
    # by hand: E_p[A] = 1, E_q[p/E_q q] = <p, q>/||q||^2
    bias = abs(1 - 0.25 / (q**2).sum())
    assert b["bias"] == pytest.approx(bias)
    assert b["bias"] > b["paper_bound"] == pytest.approx(0.5 / math.sqrt((q**2).sum()))
    # the bound also fails against A with |A| <= 1 and mixed signs
    assert gepo_bias(p, q, [-1.0, 1.0, 1.0, 1.0])["bias"] > b["paper_bound"]


@settings(max_examples=60, deadline=None)
@given(pair_params)
def test_theorem2_valid_bound(params):
    n, seed, conc = params
    rng = np.random.default_rng(seed)
    p, q = _pairs(rng, 64, n, conc)
    adv = rng.uniform(-3, 3, size=(64, n))
    b = gepo_bias(p, q, adv)
    assert np.all(b["bias"] <= b["worst_case"] + 1e-9)
    assert np.all(b["worst_case"] <= b["valid_bound"] + 1e-9)


def test_figure2_claim_on_bernoulli_grid():
    """High KL: GEPO's weight has the lower variance everywhere; at low KL it does not."""
    g = bernoulli_grid(50)
    diff = g["ratio"] - g["group_expectation"]
    assert np.all(diff[g["kl"] >= 0.5] > 0)
    low = g["kl"] < 0.05
    assert np.any(diff[low] < 0) and np.any(diff[low] > 0)


def test_figure2_claim_on_gaussian_grid():
    """Gaussian: GEPO's weight has the lower variance exactly when KL exceeds a threshold."""
    g = gaussian_grid(41, quad=False)
    diff = g["ratio"] - g["group_expectation"]

    def gap(d2):  # Var[p/q] - Var[p/E_q q] as a function of d^2, by the closed forms
        return math.expm1(d2) - (2 / math.sqrt(3)) * math.exp(-d2 / 3) + math.exp(-d2 / 2)

    d2_star = optimize.brentq(gap, 0.0, 4.0)
    kl_star = d2_star / 2
    assert 0.02 < kl_star < 0.2
    np.testing.assert_array_equal(diff > 0, g["kl"] > kl_star)
