"""verl_ext.algos.objective.compute_actor_loss: any registered loss + sampler-KL penalty + uniform is/* metrics."""

from __future__ import annotations

import math

import pytest
import torch
from verl.workers.config.actor import ActorConfig, PolicyLossConfig

from verl_ext.algos import objective
from verl_ext.algos.registry import sampler_kl_penalty

from . import reference as ref
from .verl_helpers import CLIP_HIGH, CLIP_LOW, actor_config

IS_KEYS = {"is/weight_mean", "is/weight_min", "is/weight_max", "is/weight_var", "is/kl_sampler_learner"}


def bridge(config, b, log_p=None, **kw):
    return objective.compute_actor_loss(
        config, b.log_p if log_p is None else log_p, b.log_q, b.advantages, b.mask, **kw
    )


def _penalty_torch(log_p, log_q, mask):
    """Independent torch float64 penalty (for the gradient): token-mean per sequence, sequence mean."""
    r = log_p - log_q
    per_tok = torch.exp(r) - 1 - r
    m = mask.to(log_p.dtype)
    return ((per_tok * m).sum(-1) / m.sum(-1)).mean()


@pytest.mark.parametrize("loss_mode", ["gepo", "vanilla", "gspo", "topr", "eqp"])
def test_sampler_kl_penalty_adds_coef_times_k3(loss_mode):
    b = ref.make_batch(seed=61, drift=0.3)
    coef = 0.5
    with_pen = actor_config(loss_mode, "seq-mean-token-mean", group_size=4, sampler_kl_coef=coef)
    without = actor_config(loss_mode, "seq-mean-token-mean", group_size=4)
    lp1 = b.log_p.clone().requires_grad_(True)
    lp0 = b.log_p.clone().requires_grad_(True)
    loss1, m1 = bridge(with_pen, b, lp1)
    loss0, m0 = bridge(without, b, lp0)
    want_pen = ref.sampler_kl(b)
    assert want_pen > 1e-3
    assert abs((loss1.item() - loss0.item()) - coef * want_pen) < 1e-12
    assert abs(m1["actor/sampler_kl_penalty"] - want_pen) < 1e-12
    assert m1["actor/loss"] == pytest.approx(loss1.item(), abs=1e-15)
    assert m1["actor/pg_loss"] == pytest.approx(loss0.item(), abs=1e-15)
    assert "actor/sampler_kl_penalty" not in m0 and m0["actor/loss"] == m0["actor/pg_loss"]
    # gradient: the penalty's gradient is added, scaled by coef
    loss1.backward()
    loss0.backward()
    lp2 = b.log_p.clone().requires_grad_(True)
    _penalty_torch(lp2, b.log_q, b.mask).backward()
    torch.testing.assert_close(lp1.grad - lp0.grad, coef * lp2.grad, rtol=1e-9, atol=1e-13)


def test_sampler_kl_penalty_function_direct():
    b = ref.make_batch(seed=62, drift=0.4)
    got = sampler_kl_penalty(b.log_p, b.log_q, b.mask)
    assert abs(got.item() - ref.sampler_kl(b)) < 1e-12


@pytest.mark.parametrize("loss_mode", ["vanilla", "cispo", "gspo", "geo_mean"])
def test_is_metrics_present_and_correct_for_verl_builtins(loss_mode):
    b = ref.make_batch(seed=63, drift=0.3)
    loss, metrics = bridge(actor_config(loss_mode, "token-mean"), b)
    assert torch.isfinite(loss)
    assert IS_KEYS <= set(metrics) and {"actor/pg_loss", "actor/loss", "actor/pg_clipfrac"} <= set(metrics)
    if loss_mode in ("gspo", "geo_mean"):  # length-normalised sequence ratio
        slp, slq = ref.seq_log_prob(b.log_p, b.mask), ref.seq_log_prob(b.log_q, b.mask)
        ws = [math.exp(p - q) for p, q in zip(slp, slq)]
    else:  # token ratios on response tokens
        ws = [math.exp(float(p - q)) for p, q, m in zip(b.log_p.flatten(), b.log_q.flatten(), b.mask.flatten()) if m]
    mean = math.fsum(ws) / len(ws)
    assert abs(metrics["is/weight_mean"] - mean) < 1e-10
    assert abs(metrics["is/weight_max"] - max(ws)) < 1e-10
    assert abs(metrics["is/weight_min"] - min(ws)) < 1e-10
    assert abs(metrics["is/weight_var"] - math.fsum((w - mean) ** 2 for w in ws) / len(ws)) < 1e-10
    assert abs(metrics["is/kl_sampler_learner"] - ref.sampler_kl(b)) < 1e-10


def test_bridge_with_verls_plain_policy_loss_config():
    """A user who keeps verl's PolicyLossConfig: the bridge uses the project defaults (no penalty)."""
    b = ref.make_batch(seed=64)
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode="token-mean",
        policy_loss=PolicyLossConfig(loss_mode="vanilla"),
    )
    loss, metrics = bridge(config, b)
    assert torch.isfinite(loss) and "actor/sampler_kl_penalty" not in metrics and IS_KEYS <= set(metrics)


def test_bridge_forwards_group_information_to_group_losses_only():
    b = ref.make_batch(seed=65, drift=0.25).rows(torch.randperm(12, generator=torch.Generator().manual_seed(9)))
    labels = (b.groups * 31 + 2).tolist()
    rows, _, _ = ref.gepo(b, CLIP_LOW, CLIP_HIGH, labels=labels)
    want = ref.aggregate(rows, b.mask, "token-mean")
    cfg = actor_config("gepo", "token-mean", group_size=4)
    by_index, _ = bridge(cfg, b, group_index=torch.tensor(labels))
    den = torch.tensor(ref.group_log_denominator(ref.seq_log_prob(b.log_q, b.mask), labels), dtype=torch.float64)
    by_den, _ = bridge(cfg, b, group_log_denominator=den)
    assert abs(by_index.item() - want) < 1e-12 and abs(by_den.item() - want) < 1e-12
    # verl's losses do not take group arguments: the bridge must not pass them
    loss, _ = bridge(
        actor_config("vanilla", "token-mean"), b, group_index=torch.tensor(labels), group_log_denominator=den
    )
    assert torch.isfinite(loss)


# --------------------------------------------------------------------------- on-policy identities


def test_gspo_on_policy_weight_is_exactly_one():
    b = ref.make_batch(seed=66, drift=0.0)
    lp = b.log_q.clone().requires_grad_(True)  # learner == sampler
    loss, metrics = objective.compute_actor_loss(
        actor_config("gspo", "seq-mean-token-mean"), lp, b.log_q, b.advantages, b.mask
    )
    assert metrics["is/weight_mean"] == 1.0 and metrics["is/weight_min"] == 1.0 and metrics["is/weight_max"] == 1.0
    assert metrics["is/weight_var"] == 0.0 and metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["is/kl_sampler_learner"] == 0.0


def test_gepo_on_policy_weight_is_q_over_group_expectation_and_clips():
    """With no staleness GEPO's weight is q_i / E_q[q] (not 1) and some tokens are clipped."""
    g = torch.Generator().manual_seed(67)
    B, T, G = 8, 6, 4
    mask = torch.ones(B, T, dtype=torch.bool)
    # sequence mean log-probs spread over ~1 nat within each group
    log_q = torch.linspace(-0.2, -1.4, B, dtype=torch.float64).unsqueeze(-1) + 0.05 * torch.randn(
        B, T, generator=g, dtype=torch.float64
    )
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0], dtype=torch.float64).unsqueeze(-1).expand(B, T)
    b = ref.Batch(log_q.clone(), log_q, adv, mask, torch.arange(B) // G)
    loss, metrics = objective.compute_actor_loss(
        actor_config("gepo", "token-mean", group_size=G), log_q.clone().requires_grad_(True), log_q, adv, mask
    )
    slq = ref.seq_log_prob(log_q, mask)
    ws = []
    for i in range(B):
        qs = [math.exp(slq[j]) for j in range(B) if j // G == i // G]
        ws.append(math.exp(slq[i]) / (sum(x * x for x in qs) / sum(qs)))
    assert abs(metrics["is/weight_max"] - max(ws)) < 1e-12 and abs(metrics["is/weight_min"] - min(ws)) < 1e-12
    assert abs(metrics["is/weight_mean"] - sum(ws) / B) < 1e-12
    assert max(ws) > 1 + CLIP_HIGH or min(ws) < 1 - CLIP_LOW
    _, _, clip_rows = ref.gepo(b, CLIP_LOW, CLIP_HIGH)
    want_clip = ref.clip_fraction(clip_rows, mask)
    assert want_clip > 0
    assert abs(metrics["actor/pg_clipfrac"] - want_clip) < 1e-6
    assert metrics["is/kl_sampler_learner"] == 0.0


# --------------------------------------------------------------------------- DictConfig (documented as accepted)


def _hydra_actor_node(loss_mode):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(
            config_name="ppo_trainer",
            overrides=[
                "actor_rollout_ref.actor.policy_loss._target_=verl_ext.algos.config.HeteroPolicyLossConfig",
                "+actor_rollout_ref.actor.policy_loss.group_size=4",
                f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
                "actor_rollout_ref.actor.clip_ratio_high=0.28",
                "+actor_rollout_ref.actor.policy_loss.sampler_kl_coef=0.25",
            ],
        )
    return cfg.actor_rollout_ref.actor


@pytest.mark.parametrize("loss_mode", ["gepo", "topr", "eqp"])
def test_bridge_accepts_hydra_dictconfig_for_project_losses(loss_mode):
    b = ref.make_batch(seed=68, drift=0.3)
    node = _hydra_actor_node(loss_mode)
    loss_dc, _ = bridge(node, b)
    loss_ac, _ = bridge(actor_config(loss_mode, "token-mean", group_size=4, sampler_kl_coef=0.25), b)
    assert abs(loss_dc.item() - loss_ac.item()) < 1e-12


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo"])
def test_bridge_refuses_hydra_dictconfig_for_verl_builtins_with_a_clear_error(loss_mode):
    """verl's built-ins need the ActorConfig dataclass; the bridge says so instead of failing inside verl."""
    b = ref.make_batch(seed=69, drift=0.3)
    with pytest.raises(TypeError, match=f"{loss_mode}.*omega_conf_to_dataclass"):
        bridge(_hydra_actor_node(loss_mode), b)
