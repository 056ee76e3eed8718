"""The worker-side loss bridge, driven exactly as verl's engine drives ``ppo_loss``: a CPU
TensorDict micro-batch (padded prompts/responses, flat model output over all tokens) plus the
driver-side ``group_log_denominator``. It must give the loss of ``compute_actor_loss`` (the
embedded engine's) with that denominator, and reproduce verl's ``ppo_loss`` for verl's own losses (entropy bonus and KL-to-reference included),
apply the driver's rollout-correction weights, and refuse an entropy bonus it cannot compute."""

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.metric import AggregationType
from verl.workers.utils.losses import ppo_loss

from recipe.gepo.verl_engine.batch_rules import group_log_denominator
from verl_ext.algos.worker_loss import GROUP_LOG_DENOMINATOR, bridge_loss_fn, hetero_ppo_loss
from verl_ext.algos.objective import compute_actor_loss

ROOT = Path(__file__).resolve().parents[2]
G, GROUPS, P, T = 8, 3, 5, 9


def actor_config(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "recipe" / "gepo" / "config"), version_base=None):
        cfg = compose(config_name="gepo_trainer", overrides=list(overrides))
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def make_batch(seed=0):
    """A full batch of GROUPS prompt groups of G responses, rows shuffled, with uids."""
    gen = torch.Generator().manual_seed(seed)
    b = G * GROUPS
    uids = np.array([f"prompt-{i // G}" for i in range(b)], dtype=object)
    perm = torch.randperm(b, generator=gen)
    uids = uids[perm.numpy()]
    resp_len = torch.randint(3, T + 1, (b,), generator=gen)
    prompt_len = torch.randint(2, P + 1, (b,), generator=gen)
    response_mask = (torch.arange(T)[None, :] < resp_len[:, None]).long()
    old = -torch.rand(b, T, generator=gen, dtype=torch.float64) * 3 * response_mask
    new = old + 0.3 * torch.randn(b, T, generator=gen, dtype=torch.float64) * response_mask
    adv = torch.randn(b, 1, generator=gen, dtype=torch.float64).expand(-1, T) * response_mask
    ref = old + 0.1 * torch.randn(b, T, generator=gen, dtype=torch.float64) * response_mask
    entropy = torch.rand(b, T, generator=gen, dtype=torch.float64) * response_mask
    return dict(
        uids=uids,
        resp_len=resp_len,
        prompt_len=prompt_len,
        response_mask=response_mask,
        old=old,
        new=new,
        adv=adv,
        ref=ref,
        entropy=entropy,
    )


def micro_batch(batch, rows, with_denominator, den=None):
    """verl's micro-batch layout for ``rows``: left-padded prompts, right-padded responses, an
    attention mask, and the model output flattened over all real tokens (log-prob of token t at
    the position before it), as ``no_padding_2_padding`` reads it."""
    n = len(rows)
    prompts = torch.ones(n, P, dtype=torch.long)
    responses = torch.ones(n, T, dtype=torch.long)
    attention = torch.zeros(n, P + T, dtype=torch.long)
    flat_lp, flat_ent = [], []
    for j, i in enumerate(rows):
        pl, rl = int(batch["prompt_len"][i]), int(batch["resp_len"][i])
        attention[j, P - pl : P] = 1
        attention[j, P : P + rl] = 1
        for values, out in ((batch["new"][i], flat_lp), (batch["entropy"][i], flat_ent)):
            seq = torch.zeros(pl + rl, dtype=torch.float64)
            seq[pl - 1 : pl - 1 + rl] = values[:rl]
            out.append(seq)
    log_probs = torch.cat(flat_lp).requires_grad_(True)
    td = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "attention_mask": attention,
            "response_mask": batch["response_mask"][rows],
            "old_log_probs": batch["old"][rows],
            "advantages": batch["adv"][rows],
            "ref_log_prob": batch["ref"][rows],
        },
        batch_size=[n],
    )
    if with_denominator:
        td[GROUP_LOG_DENOMINATOR] = den[rows]
    tokens = int(batch["response_mask"][rows].sum())
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=tokens, global_batch_size=n)
    return td, {"log_probs": log_probs, "entropy": torch.cat(flat_ent)}


def test_bridge_carries_the_denominator_and_matches_compute_actor_loss():
    config = actor_config()  # algorithm_preset=gepo, sampler_kl_coef 0.005
    assert config.policy_loss.loss_mode == "gepo"
    batch = make_batch()
    # driver side: whole (shuffled) groups, uid object array
    den = group_log_denominator(batch["old"], batch["response_mask"], batch["uids"], "mean")
    rows = [0, 3, 4, 7, 11, 12, 17, 20, 21, 23]  # a micro-batch of partial groups
    td, out = micro_batch(batch, rows, with_denominator=True, den=den)
    loss, metrics = hetero_ppo_loss(config, out, td)
    loss.backward()
    grad_bridge = out["log_probs"].grad.clone()

    new = batch["new"][rows].clone().requires_grad_(True)
    ref_loss, ref_metrics = compute_actor_loss(
        config,
        new,
        batch["old"][rows],
        batch["adv"][rows],
        batch["response_mask"][rows].bool(),
        group_log_denominator=den[rows],
    )
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    assert metrics["actor/has_group_denominator"].aggregate() == 1.0
    assert metrics["actor/pg_loss"].aggregate() == pytest.approx(ref_metrics["actor/pg_loss"])
    assert metrics["is/weight_var"].aggregate() == pytest.approx(ref_metrics["is/weight_var"])
    # the same gradient reaches the model output, token for token
    mask = batch["response_mask"][rows].bool()
    flat_grads = []
    offset = 0
    for j, i in enumerate(rows):
        pl, rl = int(batch["prompt_len"][i]), int(batch["resp_len"][i])
        flat_grads.append(grad_bridge[offset + pl - 1 : offset + pl - 1 + rl])
        offset += pl + rl
    torch.testing.assert_close(torch.cat(flat_grads), new.grad[mask], rtol=1e-10, atol=1e-12)

    # verl's own ppo_loss drops the field: on the same micro-batch GEPO cannot form its groups
    with pytest.raises(ValueError, match="whole prompt groups"):
        ppo_loss(config, out, td)


def test_the_denominator_changes_the_loss_so_it_is_really_used():
    config = actor_config("actor_rollout_ref.rollout.n=4")  # contiguous fallback would use groups of 4
    batch = make_batch(seed=1)
    den = group_log_denominator(batch["old"], batch["response_mask"], batch["uids"], "mean")
    rows = list(range(8))
    with_den, _ = hetero_ppo_loss(config, *reversed(micro_batch(batch, rows, True, den)))
    without, m = hetero_ppo_loss(config, *reversed(micro_batch(batch, rows, False)))
    assert m["actor/has_group_denominator"].aggregate() == 0.0
    assert not torch.allclose(with_den, without)


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo"])
def test_bridge_reproduces_verl_ppo_loss_for_verl_losses(loss_mode):
    config = actor_config(
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
        "actor_rollout_ref.actor.policy_loss.sampler_kl_coef=0.0",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
    )
    batch = make_batch(seed=2)
    rows = list(range(0, 24, 2))
    td, out = micro_batch(batch, rows, with_denominator=False)
    ours, our_metrics = hetero_ppo_loss(config, out, td)
    td2, out2 = micro_batch(batch, rows, with_denominator=False)
    theirs, their_metrics = ppo_loss(config, out2, td2)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    for key in ("actor/pg_loss", "actor/entropy_loss", "kl_loss"):
        assert our_metrics[key].aggregate() == pytest.approx(their_metrics[key].aggregate(), rel=1e-10), key
    # the embedded engine's metric names come along
    assert "is/weight_mean" in our_metrics and "is/kl_sampler_learner" in our_metrics


def test_bridge_loss_fn_wraps_verls_partial_and_refuses_anything_else():
    config = actor_config()
    wrapped = bridge_loss_fn(partial(ppo_loss, config=config))
    assert wrapped.func is hetero_ppo_loss and wrapped.keywords["config"] is config
    with pytest.raises(TypeError, match="distillation"):
        bridge_loss_fn(partial(hetero_ppo_loss, config=config))


def test_bridge_applies_the_drivers_rollout_is_weights():
    """verl's trainer puts ``rollout_is_weights`` [B, T] into the batch (rollout correction on the
    driver); the bridged loss hands them to the objective: it equals compute_actor_loss with the
    weights and differs from the loss without them."""
    config = actor_config("actor_rollout_ref.actor.policy_loss.loss_mode=vanilla")
    batch = make_batch(seed=4)
    rows = list(range(0, 24, 3))
    gen = torch.Generator().manual_seed(5)
    weights = (0.5 + torch.rand(24, T, generator=gen, dtype=torch.float64)) * batch["response_mask"]
    td, out = micro_batch(batch, rows, with_denominator=False)
    td["rollout_is_weights"] = weights[rows]
    loss, metrics = hetero_ppo_loss(config, out, td)
    plain, _ = hetero_ppo_loss(
        actor_config("actor_rollout_ref.actor.policy_loss.loss_mode=vanilla"),
        *reversed(micro_batch(batch, rows, with_denominator=False)),
    )
    new = batch["new"][rows].clone().requires_grad_(True)
    want, _ = compute_actor_loss(
        actor_config("actor_rollout_ref.actor.policy_loss.loss_mode=vanilla"),
        new,
        batch["old"][rows],
        batch["adv"][rows],
        batch["response_mask"][rows].bool(),
        rollout_is_weights=weights[rows],
        entropy=batch["entropy"][rows],
    )
    # compute_actor_loss without verl's global-batch info normalises locally: the same here (one micro-batch)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(loss, plain)


def test_bridge_refuses_an_entropy_bonus_without_entropies_and_sums_loss_metrics():
    config = actor_config("actor_rollout_ref.actor.entropy_coeff=0.01")
    batch = make_batch(seed=6)
    td, out = micro_batch(batch, list(range(8)), with_denominator=False)
    del out["entropy"]
    with pytest.raises(ValueError, match="entropy_coeff=0.01"):
        hetero_ppo_loss(config, out, td)
    # globally normalised (batch_num_tokens / global_batch_size set): the loss-valued metrics are
    # micro-batch shares, summed by verl; the rest are means
    td, out = micro_batch(batch, list(range(8)), with_denominator=False)
    _, metrics = hetero_ppo_loss(actor_config("actor_rollout_ref.actor.entropy_coeff=0.01"), out, td)
    for name in ("actor/pg_loss", "actor/policy_loss", "actor/sampler_kl_penalty", "actor/entropy_loss"):
        assert metrics[name].aggregation == AggregationType.SUM, name
    assert metrics["is/weight_mean"].aggregation == AggregationType.MEAN
