"""verl_ext.analysis.stats: paired t interval and test, power and minimum detectable effect, against
hand computation, scipy's own tests and a seeded simulation."""

import math

import numpy as np
import pytest
from scipy import stats

from verl_ext.analysis.stats import binomial_eval_sd, holm_adjusted, mde, paired_test, t_test_power


def test_paired_test_matches_hand_computation():
    # d = 1, 2, 3, 4, 5: mean 3, sd sqrt(2.5), se sqrt(0.5); t_{0.975, 4} = 2.7764451051977987
    r = paired_test([1, 2, 3, 4, 5])
    assert (r.n, r.mean) == (5, 3.0)
    assert r.sd == pytest.approx(math.sqrt(2.5)) and r.se == pytest.approx(math.sqrt(0.5))
    half = 2.7764451051977987 * math.sqrt(0.5)
    assert (r.ci_low, r.ci_high) == pytest.approx((3 - half, 3 + half))
    assert r.t == pytest.approx(3 / math.sqrt(0.5))
    assert r.p == pytest.approx(0.01324, abs=1e-5)  # two-sided, 4 df, t = 4.2426 (tables: 0.01 < p < 0.02)


@pytest.mark.parametrize("alpha", [0.05, 0.1])
def test_paired_test_agrees_with_scipy(alpha):
    rng = np.random.default_rng(3)
    a, b = rng.normal(0.4, 0.05, 7), rng.normal(0.37, 0.05, 7)
    r = paired_test(list(a - b), alpha=alpha)
    ref = stats.ttest_rel(a, b)
    assert r.t == pytest.approx(ref.statistic) and r.p == pytest.approx(ref.pvalue)
    lo, hi = ref.confidence_interval(confidence_level=1 - alpha)
    assert (r.ci_low, r.ci_high) == pytest.approx((lo, hi))


def test_paired_test_edge_cases():
    assert math.isnan(paired_test([]).mean) and paired_test([]).n == 0
    one = paired_test([0.2])
    assert one.mean == 0.2 and math.isnan(one.ci_low) and math.isnan(one.p)
    flat = paired_test([0.25, 0.25, 0.25])  # exact in binary: sd is exactly 0
    assert (flat.ci_low, flat.ci_high, flat.p) == (0.25, 0.25, 0.0) and flat.t == math.inf
    zero = paired_test([0.0, 0.0])
    assert zero.p == 1.0
    with pytest.raises(ValueError, match="finite"):
        paired_test([0.1, float("nan")])
    with pytest.raises(ValueError, match="alpha"):
        paired_test([0.1, 0.2], alpha=1.5)


def test_mde_has_the_requested_power_and_matches_the_normal_approximation():
    for n in (5, 10):
        e = mde(0.05, n)
        assert t_test_power(e, 0.05, n) == pytest.approx(0.8, abs=1e-9)
        approx = (stats.t.ppf(0.975, n - 1) + stats.t.ppf(0.8, n - 1)) * 0.05 / math.sqrt(n)
        assert e == pytest.approx(approx, rel=0.05)
    # known value (G*Power, one-sample t, two-sided 5%, 80% power, n = 10): d = 0.996
    assert mde(1.0, 10) == pytest.approx(0.996, abs=1e-3)
    assert mde(0.05, 10) < mde(0.05, 5) and mde(0.1, 5) == pytest.approx(2 * mde(0.05, 5))
    assert t_test_power(0.0, 1.0, 5) == pytest.approx(0.05)


def test_mde_power_by_simulation():
    """At the MDE a seeded simulation of the paired t test rejects about 80% of the time."""
    rng = np.random.default_rng(0)
    n, sd = 6, 0.04
    e = mde(sd, n)
    draws = rng.normal(e, sd, size=(20_000, n))
    t = draws.mean(1) / (draws.std(1, ddof=1) / math.sqrt(n))
    rejected = np.mean(np.abs(t) > stats.t.ppf(0.975, n - 1))
    assert rejected == pytest.approx(0.8, abs=0.015)


def test_mde_and_binomial_sd_reject_bad_input():
    with pytest.raises(ValueError, match="n="):
        mde(0.1, 1)
    with pytest.raises(ValueError, match="sd="):
        mde(0.0, 5)
    with pytest.raises(ValueError, match="power"):
        mde(0.1, 5, power=0.01)
    with pytest.raises(ValueError, match="problems"):
        binomial_eval_sd(0.3, 0)


def test_binomial_eval_sd():
    assert binomial_eval_sd(0.5, 64) == pytest.approx(0.0625)
    assert binomial_eval_sd(0.3, 512, evaluations=5) == pytest.approx(math.sqrt(0.21 / 2560))
    assert binomial_eval_sd(0.3, 256, samples=4) == binomial_eval_sd(0.3, 512, samples=2)


def test_holm_adjusted_by_hand_keeps_order_nan_and_cap():
    # sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> monotone 0.06
    assert holm_adjusted([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    out = holm_adjusted([0.01, math.nan, 0.02])  # NaN is not one of the family: k = 2
    assert out[0] == pytest.approx(0.02) and math.isnan(out[1]) and out[2] == pytest.approx(0.02)
    assert holm_adjusted([0.6, 0.7]) == [1.0, 1.0]
    assert holm_adjusted([]) == []
    with pytest.raises(ValueError, match="1.5"):
        holm_adjusted([0.1, 1.5])


def test_holm_controls_the_family_wise_error_and_is_never_weaker_than_bonferroni():
    rng = np.random.default_rng(0)
    k, alpha, draws = 5, 0.05, 20000
    null = rng.uniform(size=(draws, k))  # every hypothesis true
    any_rejected = sum(min(holm_adjusted(row)) < alpha for row in null)
    assert any_rejected / draws <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / draws)
    mixed = np.concatenate([rng.uniform(0, 0.02, size=(2000, 2)), rng.uniform(size=(2000, 3))], axis=1)
    holm = sum(sum(p < alpha for p in holm_adjusted(row)) for row in mixed)
    bonferroni = sum(sum(p * k < alpha for p in row) for row in mixed)
    assert holm > bonferroni  # step-down rejects strictly more here, and never fewer per row
    assert all(sum(p < alpha for p in holm_adjusted(row)) >= sum(p * k < alpha for p in row) for row in mixed)
