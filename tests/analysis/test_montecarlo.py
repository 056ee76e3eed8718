"""Closed forms against seeded Monte Carlo, with tolerances from the MC standard error.

Each test makes k comparisons ``|exact - mc| <= z se`` with ``z = z_threshold(ALPHA, k)``:
the chance that a *correct* formula fails any of them is below ALPHA (Bonferroni).
"""

import numpy as np
import pytest

from verl_ext.analysis.montecarlo import (
    group_estimates,
    group_expectation_estimate,
    mc_bernoulli_weight_variance,
    mc_discrete_weight_variance,
    mc_gaussian_weight_variance,
    mc_gepo_bias,
    mean_and_se,
    variance_and_se,
    z_threshold,
)
from verl_ext.analysis.variance import (
    bernoulli_weight_variance,
    discrete_weight_variance,
    gaussian_weight_variance,
    gepo_bias,
)

ALPHA = 1e-6
KEYS = ("ratio", "group_expectation", "expectation", "kl")


def _assert_agree(exact: dict, mc: dict, keys, z: float):
    for key in keys:
        se = mc[key + "_se"]
        if se == 0:  # degenerate (constant) weight, e.g. p = q: the MC value is exact
            assert float(exact[key]) == pytest.approx(mc[key], abs=1e-12), key
            continue
        assert abs(float(exact[key]) - mc[key]) <= z * se, (key, float(exact[key]), mc[key], se)


def test_z_threshold():
    assert z_threshold(0.05, 1) == pytest.approx(1.959964, rel=1e-6)
    assert z_threshold(1e-6, 10) > z_threshold(1e-6, 1)
    with pytest.raises(ValueError):
        z_threshold(0.0, 1)
    with pytest.raises(ValueError):
        z_threshold(0.1, 0)


def test_standard_errors_are_calibrated(rng):
    """The SE helpers match the spread of their estimates over independent replications."""
    reps = np.array([[*mean_and_se(x), *variance_and_se(x)] for x in rng.exponential(size=(400, 500))])
    # Exponential(1): mean 1, variance 1.  Empirical sd across replications vs mean reported SE.
    for est_col, se_col in ((0, 1), (2, 3)):
        spread = reps[:, est_col].std(ddof=1)
        reported = reps[:, se_col].mean()
        # The sd of 400 replications is itself known to ~ 1/sqrt(2*399) = 3.5% (normal theory);
        # 6 such relative standard errors (plus heavy-tail slack for the variance) bound it.
        assert abs(spread / reported - 1) < 6 * (1 / np.sqrt(2 * 399)) * (1 if est_col == 0 else 2)


@pytest.mark.parametrize("a, b", [(0.3, 0.6), (0.9, 0.2), (0.5, 0.1), (0.05, 0.05)])
def test_bernoulli_closed_form_matches_mc(a, b, rng):
    mc = mc_bernoulli_weight_variance(a, b, 200_000, rng)
    exact = bernoulli_weight_variance(a, b)
    keys = KEYS if a != 0.5 else ("ratio", "expectation", "kl")  # a = 1/2: p/E_q q is constant
    _assert_agree(exact, mc, keys, z_threshold(ALPHA, len(keys)))
    if a == 0.5:
        assert mc["group_expectation"] == pytest.approx(0.0, abs=1e-20)


def test_mc_check_has_power(rng):
    """A formula off by a few percent is rejected by the same tolerance."""
    a, b = 0.3, 0.6
    mc = mc_bernoulli_weight_variance(a, b, 200_000, rng)
    exact = bernoulli_weight_variance(a, b)
    wrong = {k: v * 1.05 for k, v in exact.items()}
    z = z_threshold(ALPHA, 4)
    assert all(abs(wrong[k] - mc[k]) > z * mc[k + "_se"] for k in ("ratio", "group_expectation", "expectation"))


@pytest.mark.parametrize("mu_p, mu_q", [(0.0, 0.0), (0.4, -0.1), (-0.5, 0.3), (1.0, 0.2)])
def test_gaussian_closed_form_matches_mc(mu_p, mu_q, rng):
    mc = mc_gaussian_weight_variance(mu_p, mu_q, 300_000, rng)
    exact = gaussian_weight_variance(mu_p, mu_q)
    keys = KEYS if mu_p != mu_q else ("group_expectation", "expectation")  # KL, ratio var = 0
    _assert_agree(exact, mc, keys, z_threshold(ALPHA, len(keys)))


def test_discrete_with_advantage_matches_mc(rng):
    n_pairs = 4
    z = z_threshold(ALPHA, 4 * n_pairs)
    for _ in range(n_pairs):
        q = rng.dirichlet(np.ones(6))
        p = rng.dirichlet(np.ones(6))
        adv = rng.uniform(-1, 1, 6)
        mc = mc_discrete_weight_variance(p, q, 200_000, rng, advantage=adv)
        _assert_agree(discrete_weight_variance(p, q, adv), mc, KEYS, z)


def test_gepo_bias_matches_mc(rng):
    n_pairs = 4
    z = z_threshold(ALPHA, 3 * n_pairs)
    for _ in range(n_pairs):
        q = rng.dirichlet(np.ones(5))
        p = rng.dirichlet(np.ones(5))
        adv = rng.uniform(-1, 1, 5)
        mc = mc_gepo_bias(p, q, adv, 200_000, rng)
        target = float((p * adv).sum())
        gepo_mean = float((q * p * adv).sum() / (q**2).sum())
        assert abs(mc["target"] - target) <= z * mc["target_se"]
        assert abs(mc["gspo"] - target) <= z * mc["gspo_se"]  # p/q is unbiased
        assert abs(mc["gepo"] - gepo_mean) <= z * mc["gepo_se"]
        # and the bias from MC agrees with the exact one to within the combined error
        se = np.hypot(mc["target_se"], mc["gepo_se"])
        bias = gepo_bias(p, q, adv)["bias"]
        assert abs(abs(mc["target"] - mc["gepo"]) - bias) <= z * se


def test_group_expectation_estimate_limits(rng):
    """GEPO's in-group sum q^2/sum q tends to sum q^3/sum q^2, the plain mean to E_q[q]."""
    q = np.array([0.6, 0.25, 0.1, 0.05])
    y = rng.choice(4, size=400_000, p=q)
    qy = q[y]
    ratio = float(group_expectation_estimate(qy))
    # delta-method SE of a ratio of means R = mean(u)/mean(v): sd(u - R v)/(sqrt(n) mean(v))
    se = float(np.std(qy**2 - ratio * qy, ddof=1) / (np.sqrt(qy.size) * qy.mean()))
    z = z_threshold(ALPHA, 2)
    assert abs(ratio - (q**3).sum() / (q**2).sum()) <= z * se
    mean, mean_se = mean_and_se(qy)
    assert abs(mean - (q**2).sum()) <= z * mean_se
    # the two limits differ by far more than the noise: the in-group estimate is not E_q[q]
    assert abs((q**3).sum() / (q**2).sum() - (q**2).sum()) > 10 * z * se


def test_group_expectation_estimate_small_cases():
    np.testing.assert_allclose(group_expectation_estimate([[0.2, 0.2], [0.1, 0.3]]), [0.2, 0.25])
    with pytest.raises(ValueError, match="at least one member"):
        group_expectation_estimate([0.0, 0.0])
    with pytest.raises(ValueError, match="non-negative"):
        group_expectation_estimate([0.1, -0.1])


def test_group_estimates(rng):
    q = np.array([0.5, 0.2, 0.2, 0.1])
    p = np.array([0.1, 0.2, 0.3, 0.4])
    adv = np.array([-1.0, 0.5, 0.2, 1.0])
    est = group_estimates(p, q, adv, group_size=8, n_groups=50_000, rng=rng)
    assert est["gspo"].shape == est["gepo"].shape == (50_000,)
    z = z_threshold(ALPHA, 2)
    m, se = mean_and_se(est["gspo"])
    assert abs(m - est["target"]) <= z * se  # unbiased
    m, se = mean_and_se(est["gepo_exact"])
    assert abs(m - (q * p * adv).sum() / (q**2).sum()) <= z * se
    with pytest.raises(ValueError, match="group_size"):
        group_estimates(p, q, adv, group_size=0, n_groups=3, rng=rng)


def test_mc_input_validation(rng):
    with pytest.raises(ValueError, match="n_samples"):
        mc_bernoulli_weight_variance(0.3, 0.4, 1, rng)
    with pytest.raises(ValueError, match=r"got b = 1\.0"):
        mc_bernoulli_weight_variance(0.3, 1.0, 100, rng)
    with pytest.raises(ValueError, match="single distributions"):
        mc_discrete_weight_variance(np.full((2, 2), 0.5), np.full((2, 2), 0.5), 100, rng)
