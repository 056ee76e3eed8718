"""The guard that stops a group-level loss from reading contiguous runs of G sequences as prompt
groups when verl may have moved them (``check_contiguous_groups`` in verl_ext/algos/registry.py).

The actor config is verl's own: composed by hydra from verl's packaged ``ppo_trainer`` config and
turned into verl's ActorConfig by ``omega_conf_to_dataclass`` -- with verl's plain
``PolicyLossConfig`` (no ``group_size``), so G comes from ``rollout_n`` (= ``rollout.n`` = 4).

What is pinned: each of ``actor.shuffle=true``, ``actor.use_dynamic_bsz=true`` and more than one
data-parallel rank (``global_batch_info["dp_size"]``, which verl's ``ppo_loss`` fills in) is
refused with a message naming it; none of them passes. The registered ``gepo`` loss, fetched
through ``get_policy_loss_fn`` as verl's ``ppo_loss`` does, forms groups of 4 from ``rollout_n``
on a batch of 8 and refuses under shuffle or several ranks, unless it is given group ids.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import ActorConfig

from tests.algos.verl_helpers import actor_from_section, composed_actor_section
from verl_ext.algos.registry import check_contiguous_groups

ROLLOUT_N = 4
BATCH = 8
RESPONSE_LEN = 6

SHUFFLE = "actor_rollout_ref.actor.shuffle=true"
DYNAMIC = "actor_rollout_ref.actor.use_dynamic_bsz=true"


@pytest.fixture(scope="module")
def actor_yaml():
    return composed_actor_section(
        f"actor_rollout_ref.rollout.n={ROLLOUT_N}",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gepo",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={BATCH}",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    )


def actor_config(actor_yaml, **overrides) -> ActorConfig:
    """verl's ActorConfig from the composed actor section, with ``key=value`` overrides."""
    return actor_from_section(actor_yaml, **overrides)


def test_composed_config_is_verls_with_no_group_size(actor_yaml):
    config = actor_config(actor_yaml)
    assert config.rollout_n == ROLLOUT_N and config.policy_loss.loss_mode == "gepo"
    assert "group_size" not in {f.name for f in dataclasses.fields(config.policy_loss)}
    assert not config.shuffle and not config.use_dynamic_bsz and config.global_batch_info == {}


# ---- check_contiguous_groups --------------------------------------------------------------------


def test_guard_passes_when_groups_stay_contiguous(actor_yaml):
    """No shuffle, fixed micro-batches, one rank (also when verl filled dp_size=1): no error."""
    check_contiguous_groups(actor_config(actor_yaml))
    config = actor_config(actor_yaml)
    config.global_batch_info.update(dp_size=1, batch_num_tokens=40, global_batch_size=BATCH, loss_scale_factor=None)
    check_contiguous_groups(config)


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"shuffle": True}, SHUFFLE),
        ({"use_dynamic_bsz": True}, DYNAMIC),
        ({"global_batch_info": {"dp_size": 2}}, "2 data-parallel ranks"),
    ],
    ids=["shuffle", "dynamic_bsz", "dp2"],
)
def test_guard_names_what_moves_the_groups(actor_yaml, overrides, named):
    config = actor_config(actor_yaml, **overrides)
    with pytest.raises(ValueError) as err:
        check_contiguous_groups(config)
    message = str(err.value)
    assert named in message
    assert "loss_mode='gepo'" in message
    problems = [SHUFFLE in message, DYNAMIC in message, re.search(r"\d+ data-parallel ranks", message) is not None]
    assert sum(problems) == 1, message  # only the problem that is there


def test_guard_names_every_problem_at_once(actor_yaml):
    config = actor_config(actor_yaml, shuffle=True, use_dynamic_bsz=True, global_batch_info={"dp_size": 4})
    with pytest.raises(ValueError) as err:
        check_contiguous_groups(config)
    assert SHUFFLE in str(err.value) and DYNAMIC in str(err.value) and "4 data-parallel ranks" in str(err.value)


def test_guard_reads_a_plain_dictconfig_too(actor_yaml):
    """The loss may see the actor config as an OmegaConf node (same keys): the guard reads both."""
    check_contiguous_groups(OmegaConf.create(actor_yaml))
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.shuffle=true"):
        check_contiguous_groups(OmegaConf.create(dict(actor_yaml, shuffle=True)))


# ---- the registered gepo loss, as verl's ppo_loss calls it --------------------------------------


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, RESPONSE_LEN + 1, (BATCH,), generator=g)
    mask = (torch.arange(RESPONSE_LEN)[None, :] < lengths[:, None]).to(torch.float64)
    old = -(0.1 + 2.0 * torch.rand(BATCH, RESPONSE_LEN, generator=g, dtype=torch.float64)) * mask
    new = (old + 0.3 * torch.randn(BATCH, RESPONSE_LEN, generator=g, dtype=torch.float64)) * mask
    adv = torch.randn(BATCH, 1, generator=g, dtype=torch.float64) * mask
    return old, new, adv, mask


def _gepo(config, **group_info):
    old, new, adv, mask = _batch()
    fn = get_policy_loss_fn("gepo")
    return fn(
        old_log_prob=old,
        log_prob=new,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=None,
        **group_info,
    )


def _with_ppo_loss_info(config: ActorConfig, dp_size: int) -> ActorConfig:
    """What verl's ppo_loss writes into the config before calling the policy loss."""
    _, _, _, mask = _batch()
    config.global_batch_info.update(
        dp_size=dp_size, batch_num_tokens=int(mask.sum()), global_batch_size=BATCH * dp_size, loss_scale_factor=None
    )
    return config


def test_gepo_takes_groups_of_rollout_n(actor_yaml):
    """Without policy_loss.group_size, 8 sequences are read as 2 groups of rollout_n=4: the loss equals
    the one with explicit group ids [0,0,0,0,1,1,1,1] and differs from groups of 2."""
    config = _with_ppo_loss_info(actor_config(actor_yaml), dp_size=1)
    loss, metrics = _gepo(config)
    assert torch.isfinite(loss) and "is/weight_mean" in metrics
    fours, _ = _gepo(config, group_index=torch.arange(BATCH) // ROLLOUT_N)
    twos, _ = _gepo(config, group_index=torch.arange(BATCH) // 2)
    assert torch.equal(loss, fours)
    assert not torch.allclose(loss, twos)


@pytest.mark.parametrize(
    "overrides, dp_size, named",
    [({"shuffle": True}, 1, SHUFFLE), ({}, 2, "2 data-parallel ranks")],
    ids=["shuffle", "dp2"],
)
def test_gepo_refuses_contiguous_groups_verl_may_have_moved(actor_yaml, overrides, dp_size, named):
    """Under shuffle or several ranks the same call raises; given group ids it runs (the guard only
    protects the contiguous fallback)."""
    config = _with_ppo_loss_info(actor_config(actor_yaml, **overrides), dp_size=dp_size)
    with pytest.raises(ValueError) as err:
        _gepo(config)
    assert named in str(err.value)
    loss, _ = _gepo(config, group_index=torch.arange(BATCH) // ROLLOUT_N)
    assert torch.isfinite(loss)
