"""verl_ext.algos.objective.gradient_mechanism_metrics: what each loss does to each token's gradient,
measured by autograd and checked against closed forms."""

import math

import pytest
import torch
from verl.utils.config import omega_conf_to_dataclass

from tests.research.study.conftest import compose_cfg
from verl_ext.algos.importance import group_expectation_log_denominator, sequence_log_prob
from verl_ext.algos.objective import compute_actor_loss

B, T, G = 16, 6, 8


def _actor(preset: str):
    cfg = compose_cfg([f"algorithm_preset={preset}", "actor_rollout_ref.actor.policy_loss.sampler_kl_coef=0"])
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def _batch(shift: torch.Tensor | None = None):
    g = torch.Generator().manual_seed(0)
    q = -torch.rand(B, T, generator=g, dtype=torch.float64)
    p = (q if shift is None else q + shift).clone().requires_grad_(True)
    mask = torch.ones(B, T, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0] * (B // 2), dtype=torch.float64)[:, None].expand(B, T).contiguous()
    index = torch.arange(B) // G
    den = group_expectation_log_denominator(sequence_log_prob(q, mask, "mean"), index)
    return p, q, adv, mask, index, den


def _metrics(preset, shift=None):
    p, q, adv, mask, index, den = _batch(shift)
    _, m = compute_actor_loss(_actor(preset), p, q, adv, mask, group_log_denominator=den, group_index=index)
    return m, (p, q, adv, mask, index, den)


def test_grpo_on_policy_weights_are_one_and_nothing_is_clipped():
    m, _ = _metrics("grpo_paper")
    assert m["is/grad_weight_pos_adv"] == pytest.approx(1.0) and m["is/grad_weight_neg_adv"] == pytest.approx(1.0)
    assert m["is/clipfrac_pos_adv"] == m["is/clipfrac_neg_adv"] == m["is/zero_grad_seq_frac"] == 0.0


def test_gepo_on_policy_weight_is_q_over_its_group_expectation():
    """GEPO's weight on-policy is q_i / E_q[q] (length-normalised), not 1: the metric finds it."""
    m, (p, q, adv, mask, index, den) = _metrics("gepo")
    w = torch.exp(sequence_log_prob(q, mask, "mean") - den)
    pos, neg = adv[:, 0] > 0, adv[:, 0] < 0
    assert m["is/grad_weight_pos_adv"] == pytest.approx(float(w[pos].mean()))
    assert m["is/grad_weight_neg_adv"] == pytest.approx(float(w[neg].mean()))
    assert not math.isclose(float(w[pos].mean()), 1.0, abs_tol=1e-3)


def test_clip_fractions_split_by_advantage_sign():
    """One token of a positive-advantage sequence far above 1 + eps and one of a negative one far
    below 1 - eps: GRPO's clip removes exactly those two tokens' gradients."""
    shift = torch.zeros(B, T, dtype=torch.float64)
    shift[0, 0], shift[1, 0] = 1.0, -1.0  # row 0: A > 0, ratio e; row 1: A < 0, ratio 1/e
    m, _ = _metrics("grpo_paper", shift)
    n_side = (B // 2) * T
    assert m["is/clipfrac_pos_adv"] == pytest.approx(1 / n_side) and m["is/clipfrac_neg_adv"] == pytest.approx(
        1 / n_side
    )
    assert m["is/zero_grad_seq_frac"] == 0.0


def test_gspo_sequence_clip_removes_whole_sequences():
    shift = torch.zeros(B, T, dtype=torch.float64)
    shift[0] = 0.01  # row 0's length-normalised ratio e^0.01, far outside GSPO's [1 - 3e-4, 1 + 4e-4]
    m, _ = _metrics("gspo", shift)
    assert m["is/zero_grad_seq_frac"] == pytest.approx(1 / B)
    assert m["is/clipfrac_pos_adv"] == pytest.approx(1 / (B // 2)) and m["is/clipfrac_neg_adv"] == 0.0
    assert "is/zero_grad_seq_frac" in _metrics("gspo_wide", shift)[0]
    assert _metrics("gspo_wide", shift)[0]["is/zero_grad_seq_frac"] == 0.0  # inside 0.2


def test_no_gradient_no_metrics():
    p, q, adv, mask, index, den = _batch()
    _, m = compute_actor_loss(_actor("grpo"), p.detach(), q, adv, mask)
    assert not any(k.startswith("is/grad_weight") for k in m)
