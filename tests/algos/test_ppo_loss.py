"""Every loss driven through verl's own ``verl.workers.utils.losses.ppo_loss`` on CPU.

The actor config is composed by hydra from verl's packaged ``ppo_trainer`` config (with
``policy_loss._target_=verl_ext.algos.config.HeteroPolicyLossConfig``) and instantiated with verl's
``omega_conf_to_dataclass``; the batch is a TensorDict laid out as verl's engines hand it to the
loss: padded ``prompts``/``responses`` + ``attention_mask`` (or nested jagged prompts/responses),
padded ``response_mask``/``old_log_probs``/``advantages``, global batch info as non-tensor data,
and the model's log-probs over the *whole* sequences as a jagged nested tensor (ppo_loss slices
the response part out with ``no_padding_2_padding``).
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn
from verl.utils import tensordict_utils as tu
from verl.workers.utils.losses import ppo_loss

from verl_ext.algos import losses
from verl_ext.algos.config import HeteroPolicyLossConfig
from verl_ext.algos.objective import compute_actor_loss
from verl_ext.algos.registry import HETERORL_LOSS_MODES, policy_loss_fn

from . import reference as ref
from .verl_helpers import actor_from_section, composed_actor_section

VERL_BUILTINS = ("vanilla", "gspo", "geo_mean", "cispo")
# the required project losses; grpo_token is checked when the plugin declares it
REQUIRED = ("gepo", "eqp", "gepo_adaptive", "gepo_tr", "gepo_tc", "topr", "delta_l", "m2po", "vespo")
ALL_LOSSES = tuple(sorted(set(VERL_BUILTINS) | set(REQUIRED) | set(HETERORL_LOSS_MODES)))
GROUP = 3
IS_KEYS = {"is/weight_mean", "is/weight_min", "is/weight_max", "is/weight_var", "is/kl_sampler_learner"}


@pytest.fixture(scope="module")
def actor_yaml():
    return composed_actor_section(
        "actor_rollout_ref.actor.policy_loss._target_=verl_ext.algos.config.HeteroPolicyLossConfig",
        f"+actor_rollout_ref.actor.policy_loss.group_size={GROUP}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
    )


def make_config(actor_yaml, loss_mode, **overrides):
    config = actor_from_section(actor_yaml, **{"policy_loss.loss_mode": loss_mode, **overrides})
    assert isinstance(config.policy_loss, HeteroPolicyLossConfig)
    return config


def make_data(seed: int, n_groups: int = 3, layout: str = "padded", dtype=torch.float64):
    """(TensorDict, model_output, leaf log-prob values, padded response log-probs, padded batch)."""
    g = torch.Generator().manual_seed(seed)
    B, P, R = n_groups * GROUP, 4, 6
    pl = torch.randint(1, P + 1, (B,), generator=g)
    rl = torch.randint(1, R + 1, (B,), generator=g)
    prompts = torch.randint(5, 100, (B, P), generator=g)
    responses = torch.randint(5, 100, (B, R), generator=g)
    attn = torch.zeros(B, P + R, dtype=torch.long)
    rmask = torch.zeros(B, R, dtype=torch.long)
    for i in range(B):
        attn[i, P - pl[i] : P] = 1  # left-padded prompt
        attn[i, P : P + rl[i]] = 1  # right-padded response
        rmask[i, : rl[i]] = 1
    old = -(0.05 + 2.0 * torch.rand(B, R, generator=g, dtype=torch.float64)) * rmask
    resp_lp = (old + 0.25 * torch.randn(B, R, generator=g, dtype=torch.float64)) * rmask
    adv = (torch.randn(B, 1, generator=g, dtype=torch.float64) * rmask).to(dtype)
    # model output over whole sequences: the response's token log-probs sit at positions
    # pl-1 .. pl+rl-2 (logits at t predict token t+1); everything else is junk that must be ignored
    pieces = []
    for i in range(B):
        v = 50.0 + torch.rand(int(pl[i] + rl[i]), generator=g, dtype=torch.float64)
        v[pl[i] - 1 : pl[i] - 1 + rl[i]] = resp_lp[i, : rl[i]]
        pieces.append(v)
    leaf = torch.cat(pieces).to(dtype).requires_grad_(True)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), (pl + rl).cumsum(0)])
    log_probs = torch.nested.nested_tensor_from_jagged(leaf, offsets=offsets)
    fields = {"response_mask": rmask, "old_log_probs": old.to(dtype), "advantages": adv}
    if layout == "padded":
        fields.update(prompts=prompts, responses=responses, attention_mask=attn)
    else:
        fields["prompts"] = torch.nested.as_nested_tensor(
            [prompts[i, P - pl[i] :] for i in range(B)], layout=torch.jagged
        )
        fields["responses"] = torch.nested.as_nested_tensor(
            [responses[i, : rl[i]] for i in range(B)], layout=torch.jagged
        )
    data = TensorDict(fields, batch_size=[B])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(rmask.sum()), global_batch_size=B)
    batch = ref.Batch(resp_lp.to(dtype), old.to(dtype), adv, rmask.bool(), torch.arange(B) // GROUP)
    return data, {"log_probs": log_probs}, leaf, (pl, rl), batch


def _metric_values(metrics):
    return {k: (v.aggregate() if hasattr(v, "aggregate") else v) for k, v in metrics.items()}


def test_required_losses_are_registered_and_declared():
    for name in REQUIRED:
        assert name in POLICY_LOSS_REGISTRY
        assert name in HETERORL_LOSS_MODES
    for name in HETERORL_LOSS_MODES:
        assert name in POLICY_LOSS_REGISTRY


@pytest.mark.parametrize("layout", ["padded", "nested"])
@pytest.mark.parametrize("loss_mode", ALL_LOSSES)
def test_every_loss_through_verl_ppo_loss(actor_yaml, loss_mode, layout):
    config = make_config(actor_yaml, loss_mode)
    data, model_output, leaf, (pl, rl), b = make_data(seed=3, layout=layout)
    loss, metrics = ppo_loss(config, model_output, data)
    values = _metric_values(metrics)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert {"actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac"} <= set(values)
    if loss_mode not in VERL_BUILTINS:
        assert IS_KEYS <= set(values), sorted(values)
    assert all(torch.isfinite(torch.tensor(float(v))) for v in values.values())
    assert abs(values["actor/pg_loss"] - loss.item()) < 1e-12

    # the registered function called directly on the padded tensors, same (mutated) config
    lp = b.log_p.clone().requires_grad_(True)
    direct, direct_metrics = get_policy_loss_fn(loss_mode)(
        old_log_prob=b.log_q,
        log_prob=lp,
        advantages=b.advantages,
        response_mask=b.mask,
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=None,
    )
    assert abs(loss.item() - direct.item()) < 1e-12
    for key, value in direct_metrics.items():
        assert abs(values[key] - value) < 1e-12, key

    # gradients: response positions get the direct call's gradient, the junk positions none
    loss.backward()
    direct.backward()
    pos = 0
    for i in range(b.mask.shape[0]):
        n = int(pl[i] + rl[i])
        seg = leaf.grad[pos : pos + n]
        start = int(pl[i]) - 1
        torch.testing.assert_close(seg[start : start + int(rl[i])], lp.grad[i, : int(rl[i])], rtol=1e-10, atol=1e-14)
        assert torch.count_nonzero(seg[:start]) == 0 and torch.count_nonzero(seg[start + int(rl[i]) :]) == 0
        pos += n
    assert lp.grad.abs().sum() > 0


@pytest.mark.parametrize("mode", ref.AGG_MODES)
def test_gepo_through_ppo_loss_equals_pure_terms_and_reference(actor_yaml, mode):
    config = make_config(actor_yaml, "gepo", loss_agg_mode=mode)
    data, model_output, _, _, b = make_data(seed=4, n_groups=4)
    loss, _ = ppo_loss(config, model_output, data)
    terms = losses.gepo_loss_terms(
        b.log_p, b.log_q, b.advantages, b.mask, clip_low=0.2, clip_high=0.28, group_index=torch.arange(12) // GROUP
    )
    pure = ref.aggregate(ref._rows(terms.loss_mat * b.mask), b.mask, mode)
    rows, _, _ = ref.gepo(b, 0.2, 0.28)
    assert abs(loss.item() - pure) < 1e-12
    assert abs(loss.item() - ref.aggregate(rows, b.mask, mode)) < 1e-10


@pytest.mark.parametrize("loss_mode", ["gepo", "eqp", "gepo_adaptive", "gepo_tr", "gepo_tc"])
def test_ppo_loss_batch_not_whole_groups_raises(actor_yaml, loss_mode):
    config = make_config(actor_yaml, loss_mode)
    data, model_output, _, _, _ = make_data(seed=5)
    # drop one sequence: 8 sequences cannot be split into groups of 3
    keep = torch.arange(8)
    nested = model_output["log_probs"]
    offsets = nested.offsets()
    sub = torch.nested.nested_tensor_from_jagged(nested.values()[: offsets[8]], offsets=offsets[:9])
    sub_data = data[keep]
    tu.assign_non_tensor(
        sub_data, dp_size=1, batch_num_tokens=int(sub_data["response_mask"].sum()), global_batch_size=8
    )
    with pytest.raises(ValueError, match="group_size"):
        ppo_loss(config, {"log_probs": sub}, sub_data)


def test_gepo_through_ppo_loss_with_hydra_sum_reduction(actor_yaml):
    """Loss options set by hydra reach the loss through omega_conf_to_dataclass."""
    data, model_output, _, _, b = make_data(seed=6)
    cfg_sum = make_config(actor_yaml, "gepo", **{"policy_loss.seq_reduction": "sum"})
    loss_sum, _ = ppo_loss(cfg_sum, model_output, data)
    rows_sum, _, _ = ref.gepo(b, 0.2, 0.28, reduction="sum")
    assert abs(loss_sum.item() - ref.aggregate(rows_sum, b.mask, "token-mean")) < 1e-10


# ---- policy_loss.sampler_kl_coef under verl's own ppo_loss (python -m verl.trainer.main_ppo) ----


def _torch_penalty(log_p, log_q, mask):
    """Independent float64 penalty: k3 per token, token-mean per sequence, mean over sequences."""
    r = log_p - log_q
    m = mask.to(log_p.dtype)
    return (((torch.exp(r) - 1 - r) * m).sum(-1) / m.sum(-1)).mean()


@pytest.mark.parametrize("loss_mode", HETERORL_LOSS_MODES)
def test_sampler_kl_coef_reaches_the_loss_through_verl_ppo_loss(actor_yaml, loss_mode):
    """verl's stock ppo_loss calls only the registered function: the penalty must act there, by
    coef x KL(sampler || learner) in value and in gradient, reported as actor/sampler_kl_penalty."""
    coef = 0.5
    results = {}
    for c in (0.0, coef):
        config = make_config(actor_yaml, loss_mode, **{"policy_loss.sampler_kl_coef": c})
        data, model_output, leaf, _, b = make_data(seed=7)
        loss, metrics = ppo_loss(config, model_output, data)
        loss.backward()
        results[c] = (loss.item(), leaf.grad.clone(), _metric_values(metrics))
    want = ref.sampler_kl(b)
    assert want > 1e-3
    assert abs((results[coef][0] - results[0.0][0]) - coef * want) < 1e-12
    assert abs(results[coef][2]["actor/sampler_kl_penalty"] - want) < 1e-12
    assert "actor/sampler_kl_penalty" not in results[0.0][2]
    # gradient: coef x the penalty's, at the response positions of the jagged model output
    _, model_output, leaf, (pl, rl), b = make_data(seed=7)
    lp = b.log_p.clone().requires_grad_(True)
    _torch_penalty(lp, b.log_q, b.mask).backward()
    diff = results[coef][1] - results[0.0][1]
    pos = 0
    for i in range(b.mask.shape[0]):
        start, n = int(pl[i]) - 1, int(rl[i])
        torch.testing.assert_close(diff[pos + start : pos + start + n], coef * lp.grad[i, :n], rtol=1e-9, atol=1e-13)
        pos += int(pl[i] + rl[i])


@pytest.mark.parametrize("loss_mode", HETERORL_LOSS_MODES)
def test_the_penalty_is_added_once_on_each_route(actor_yaml, loss_mode):
    """The policy loss alone (what the bridge takes) has no penalty whatever the coefficient; verl's
    registry entry adds exactly coef x penalty once; the bridge's total adds it once too."""
    alone, registered = policy_loss_fn(loss_mode), get_policy_loss_fn(loss_mode)
    assert alone is not registered and registered.__wrapped__ is alone
    _, _, _, _, b = make_data(seed=8)
    plain = make_config(actor_yaml, loss_mode)
    with_coef = make_config(actor_yaml, loss_mode, **{"policy_loss.sampler_kl_coef": 0.5})
    kw = dict(
        old_log_prob=b.log_q, log_prob=b.log_p, advantages=b.advantages, response_mask=b.mask, rollout_is_weights=None
    )
    base, _ = alone(loss_agg_mode=plain.loss_agg_mode, config=plain, **kw)
    left_out, metrics = alone(loss_agg_mode=with_coef.loss_agg_mode, config=with_coef, **kw)
    added, _ = registered(loss_agg_mode=with_coef.loss_agg_mode, config=with_coef, **kw)
    assert left_out.item() == base.item() and "actor/sampler_kl_penalty" not in metrics
    assert abs(added.item() - base.item() - 0.5 * ref.sampler_kl(b)) < 1e-12
    total, bridge_metrics = compute_actor_loss(with_coef, b.log_p, b.log_q, b.advantages, b.mask)
    assert abs(total.item() - bridge_metrics["actor/pg_loss"] - 0.5 * ref.sampler_kl(b)) < 1e-12
