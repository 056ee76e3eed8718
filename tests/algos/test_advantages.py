"""BNPO advantages against the paper's formula (scipy), directly and through verl's estimator registry."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from verl.trainer.ppo.core_algos import get_adv_estimator_fn

from verl_ext.algos import advantages as adv_lib


# --------------------------------------------------------------------------- BNPO


def _bnpo_reference(scores: list[float], labels: list, max_abs: float = 5.0, mean_clip: float = 1e-3):
    """The BNPO paper's normalisation as stated in the issue, in float64 with scipy."""
    groups = {}
    for s, l in zip(scores, labels):
        groups.setdefault(l, []).append(s)
    means = {l: statistics.fmean(v) for l, v in groups.items()}
    gm = list(means.values())
    mu = statistics.fmean(gm)
    var = statistics.pvariance(gm)
    if var <= 0 or var >= mu * (1 - mu):
        alpha = beta = 1.0
    else:
        k = mu * (1 - mu) / var - 1
        a, b = mu * k, (1 - mu) * k
        alpha, beta = max(1 + a / 3, 1.0), max(1 + b / 3, 1.0)
    out = []
    for s, l in zip(scores, labels):
        p = min(max(means[l], mean_clip), 1 - mean_clip)
        a = (s - means[l]) / stats.beta.pdf(p, alpha, beta)
        out.append(min(max(a, -max_abs), max_abs))
    return out, (alpha, beta)


@pytest.mark.parametrize("seed", range(6))
def test_bnpo_advantages_match_paper_formula(seed):
    rng = np.random.default_rng(100 + seed)
    G, n_groups = 8, 6
    p_true = rng.uniform(0.05, 0.95, size=n_groups)
    scores = (rng.uniform(size=(n_groups, G)) < p_true[:, None]).astype(np.float64).ravel()
    labels = [f"uid-{g}" for g in range(n_groups) for _ in range(G)]
    order = rng.permutation(len(scores))  # shuffled, non-contiguous groups
    scores, labels = scores[order], [labels[i] for i in order]
    _, dense = np.unique(labels, return_inverse=True)
    got = adv_lib.bnpo_advantages(torch.from_numpy(scores), torch.from_numpy(dense))
    want, (alpha, beta) = _bnpo_reference(scores.tolist(), labels)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    # the params themselves
    means = torch.tensor(
        [statistics.fmean(scores[np.array(labels) == l].tolist()) for l in sorted(set(labels))], dtype=torch.float64
    )
    a2, b2 = adv_lib.bnpo_normalization_params(means)
    assert abs(a2 - alpha) < 1e-9 and abs(b2 - beta) < 1e-9


def test_bnpo_non_binary_rewards_and_clamp():
    """Fractional rewards in [0, 1]; a group mean near 0 has a tiny density -> |A| clamped."""
    scores = [0.0, 0.0, 0.0, 0.02, 0.5, 0.6, 0.7, 0.4, 0.9, 1.0, 0.8, 0.95, 0.3, 0.1, 0.2, 0.25]
    labels = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    want, (alpha, beta) = _bnpo_reference(scores, labels, max_abs=0.1)
    assert alpha > 1 and beta > 1  # a genuine Beta, not the fallback
    got = adv_lib.bnpo_advantages(
        torch.tensor(scores, dtype=torch.float64), torch.tensor(labels), max_abs_advantage=0.1
    )
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    assert got.abs().max().item() == pytest.approx(0.1)


@pytest.mark.parametrize(
    "scores,labels",
    [
        ([1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1]),  # all group means equal: v = 0 -> Beta(1, 1)
        ([1.0, 1.0, 0.0, 0.0], [0, 0, 1, 1]),  # means 1 and 0: v = mu (1 - mu) -> Beta(1, 1)
        ([1.0, 1.0, 1.0], [4, 4, 4]),  # one tied group
    ],
)
def test_bnpo_degenerate_moments_fall_back_to_dr_grpo(scores, labels):
    got = adv_lib.bnpo_advantages(torch.tensor(scores, dtype=torch.float64), torch.tensor(labels))
    want, ab = _bnpo_reference(scores, labels)
    assert ab == (1.0, 1.0)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))


@pytest.mark.parametrize("bad", [[1.5, 0.0], [-0.1, 0.0], [float("nan"), 0.0]])
def test_bnpo_rejects_rewards_outside_unit_interval(bad):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        adv_lib.bnpo_advantages(torch.tensor(bad), torch.tensor([0, 0]))


def test_beta_pdf_matches_scipy():
    x = torch.linspace(0.0, 1.0, 41, dtype=torch.float64)
    for a, b in [(1.0, 1.0), (2.5, 1.3), (1.0, 4.0), (3.0, 1.0), (7.2, 7.2)]:
        got = adv_lib.beta_pdf(x, a, b)
        want = torch.from_numpy(stats.beta.pdf(x.numpy(), a, b))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from([0.0, 0.25, 0.5, 1.0])), min_size=2, max_size=30))
def test_bnpo_hypothesis_vs_reference(pairs):
    labels = [l for l, _ in pairs]
    scores = [s for _, s in pairs]
    got = adv_lib.bnpo_advantages(torch.tensor(scores, dtype=torch.float64), torch.tensor(labels))
    want, _ = _bnpo_reference(scores, labels)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-8, atol=1e-10)


def test_bnpo_registered_estimator_through_verl_registry():
    """verl's registry hands uid strings and token-level rewards; advantages land on response tokens."""
    fn = get_adv_estimator_fn("bnpo")
    rng = np.random.default_rng(7)
    n, T = 24, 6
    scores = (rng.uniform(size=n) < 0.4).astype(np.float32)
    uids = np.array([f"{u:08x}-uid" for u in rng.integers(0, 2**31, size=6)], dtype=object)[np.arange(n) % 6]
    lengths = rng.integers(1, T + 1, size=n)
    mask = torch.from_numpy((np.arange(T)[None, :] < lengths[:, None]).astype(np.float32))
    rewards = torch.zeros(n, T)
    rewards[torch.arange(n), torch.from_numpy(lengths - 1)] = torch.from_numpy(scores)
    adv, ret = fn(token_level_rewards=rewards, response_mask=mask, index=uids, config=None)
    want, _ = _bnpo_reference(scores.astype(np.float64).tolist(), list(uids))
    want_mat = torch.tensor(want, dtype=torch.float32).unsqueeze(-1) * mask
    torch.testing.assert_close(adv, want_mat, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ret, adv)
    assert adv.abs().sum() > 0


# --------------------------------------------------------------------------- BNPO: one group's check


def _bnpo_batch(seed: int, G: int = 8, n_groups: int = 6, max_abs: float = adv_lib.BNPO_MAX_ABS_ADVANTAGE):
    rng = np.random.default_rng(200 + seed)
    p_true = rng.uniform(0.02, 0.98, size=n_groups)
    scores = (rng.uniform(size=(n_groups, G)) < p_true[:, None]).astype(np.float32)
    labels = torch.arange(n_groups).repeat_interleave(G)
    adv = adv_lib.bnpo_advantages(torch.from_numpy(scores.ravel()), labels, max_abs_advantage=max_abs)
    return scores, adv.numpy().reshape(n_groups, G)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("max_abs", [adv_lib.BNPO_MAX_ABS_ADVANTAGE, 0.5])  # 0.5: most groups clamped
def test_every_honest_bnpo_group_passes_the_group_check(seed, max_abs):
    scores, adv = _bnpo_batch(seed, max_abs=max_abs)
    for rewards, advantages in zip(scores, adv):
        assert adv_lib.bnpo_group_mismatch(rewards, advantages, max_abs_advantage=max_abs) is None, (
            rewards,
            advantages,
        )


def _forgeries(rewards: np.ndarray, advantages: np.ndarray) -> dict[str, np.ndarray]:
    flipped_one = advantages.copy()
    flipped_one[0] = -flipped_one[0]
    nudged = advantages.copy()
    nudged[np.argmax(np.abs(advantages) < adv_lib.BNPO_MAX_ABS_ADVANTAGE - 1e-3)] *= 1.5
    other = np.roll(rewards, 1)
    return {
        "all signs flipped": -advantages,
        "one sign flipped": flipped_one,
        "one response scaled": nudged,
        "another group's": (other - other.mean()) * 2.0,
        "past the clamp": advantages * 100.0,
        "nan": advantages * np.nan,
    }


def test_forged_bnpo_advantages_are_named():
    rewards = np.array([1, 0, 0, 1, 1, 0, 0, 0], np.float32)
    advantages = (rewards - rewards.mean()) * 1.7  # an honest group, factor 1.7, inside the clamp
    assert adv_lib.bnpo_group_mismatch(rewards, advantages) is None
    assert adv_lib.bnpo_group_mismatch(rewards, advantages * 2.5) is None  # the scale is what it cannot see
    for name, forged in _forgeries(rewards, advantages).items():
        assert adv_lib.bnpo_group_mismatch(rewards, forged) is not None, name
    ties = np.ones(8, np.float32)
    assert adv_lib.bnpo_group_mismatch(ties, np.zeros(8)) is None
    assert "mean reward" in adv_lib.bnpo_group_mismatch(ties, np.full(8, 0.1))
    assert "shape" in adv_lib.bnpo_group_mismatch(rewards, advantages[:4])
