"""HeteroPolicyLossConfig validation and the group-splitting error of the registered group losses."""

from __future__ import annotations

import copy

import pytest
import torch
from hydra.errors import InstantiationException
from omegaconf import OmegaConf
from verl.utils.config import omega_conf_to_dataclass

from verl_ext.algos.config import HeteroPolicyLossConfig

from . import reference as ref
from .verl_helpers import actor_config, actor_from_section, call_loss, composed_actor_section


@pytest.mark.parametrize(
    "field,value",
    [
        ("seq_reduction", "max"),
        ("topr_reduction", "token"),
        ("group_size", -1),
        ("sampler_kl_coef", -0.005),
        ("delta_l_alpha", -0.5),
        ("adaptive_kl_threshold", -1e-3),
    ],
)
def test_bad_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        HeteroPolicyLossConfig(**{field: value})


def test_defaults_and_valid_values_accepted():
    c = HeteroPolicyLossConfig()
    assert (c.group_size, c.seq_reduction, c.sampler_kl_coef, c.delta_l_alpha) == (0, "mean", 0.0, 1.0)
    assert c.adaptive_kl_threshold == 0.002 and c.topr_reduction == "sum"
    # topr_reduction is topr's own option, seq_reduction GEPO's: accepted with their losses (the
    # guard refuses them with another)
    HeteroPolicyLossConfig(loss_mode="topr", topr_reduction="mean", group_size=8, sampler_kl_coef=0.005)
    HeteroPolicyLossConfig(loss_mode="gepo", seq_reduction="sum", group_size=8, sampler_kl_coef=0.005)


def test_new_loss_options_defaults():
    """The papers' / authors' values: M2PO's second-moment bound 0.04; VESPO's (k, lam) = (2, 3) for
    A >= 0 and (3, 2) for A < 0; GEPO-TC's ESS band off."""
    c = HeteroPolicyLossConfig()
    assert c.m2po_threshold == 0.04
    assert (c.vespo_k_pos, c.vespo_lambda_pos, c.vespo_k_neg, c.vespo_lambda_neg) == (2.0, 3.0, 3.0, 2.0)
    assert c.tc_ess_bound is False


POSITIVE_OPTIONS = [
    ("m2po_threshold", "m2po"),
    ("vespo_k_pos", "vespo"),
    ("vespo_lambda_pos", "vespo"),
    ("vespo_k_neg", "vespo"),
    ("vespo_lambda_neg", "vespo"),
]


@pytest.mark.parametrize("field,loss_mode", POSITIVE_OPTIONS)
@pytest.mark.parametrize("value", [0.0, -0.5, float("nan")])
def test_new_loss_options_must_be_positive(field, loss_mode, value):
    """Under the option's own loss (so the loss-specific guard is not what refuses it)."""
    with pytest.raises(ValueError, match=field) as err:
        HeteroPolicyLossConfig(loss_mode=loss_mode, **{field: value})
    assert "> 0" in str(err.value)
    ok = HeteroPolicyLossConfig(loss_mode=loss_mode, **{field: 0.5})
    assert getattr(ok, field) == 0.5


# (option, a non-default value, the loss that reads it)
LOSS_SPECIFIC = [
    ("m2po_threshold", 0.1, "m2po"),
    ("vespo_k_pos", 1.5, "vespo"),
    ("vespo_lambda_pos", 2.5, "vespo"),
    ("vespo_k_neg", 4.0, "vespo"),
    ("vespo_lambda_neg", 1.0, "vespo"),
    ("tc_ess_bound", True, "gepo_tc"),
    ("adaptive_kl_threshold", 0.01, "gepo_adaptive"),
    ("delta_l_alpha", 0.75, "delta_l"),
    ("topr_reduction", "mean", "topr"),
]


@pytest.mark.parametrize(
    "field,value,own_mode,other_mode",
    [
        (*case, other)
        for case in LOSS_SPECIFIC
        for other in ("gepo", "vanilla", "gepo_tr", "m2po", "vespo", "gepo_tc")
        if other != case[2]
    ],
)
def test_loss_specific_option_with_another_loss_raises_naming_it(field, value, own_mode, other_mode):
    with pytest.raises(ValueError, match=field) as err:
        HeteroPolicyLossConfig(loss_mode=other_mode, **{field: value})
    assert other_mode in str(err.value) and own_mode in str(err.value)
    # its own loss accepts it, and keeps the value
    assert getattr(HeteroPolicyLossConfig(loss_mode=own_mode, **{field: value}), field) == value
    # spelling out the default under another loss is harmless
    default = getattr(HeteroPolicyLossConfig(), field)
    assert getattr(HeteroPolicyLossConfig(loss_mode=other_mode, **{field: default}), field) == default


def test_loss_specific_guard_through_omega_conf_to_dataclass():
    """The guard also fires when the config arrives from YAML (as hydra hands it to verl)."""
    node = OmegaConf.create(
        {"_target_": "verl_ext.algos.config.HeteroPolicyLossConfig", "loss_mode": "gepo", "m2po_threshold": 0.1}
    )
    with pytest.raises((ValueError, InstantiationException), match="m2po_threshold"):
        omega_conf_to_dataclass(node)
    node.loss_mode = "m2po"
    assert omega_conf_to_dataclass(node).m2po_threshold == 0.1


def test_bad_value_through_omega_conf_to_dataclass_names_the_field():
    node = OmegaConf.create(
        {"_target_": "verl_ext.algos.config.HeteroPolicyLossConfig", "loss_mode": "gepo", "seq_reduction": "max"}
    )
    with pytest.raises((ValueError, InstantiationException), match="seq_reduction"):
        omega_conf_to_dataclass(node)
    good = omega_conf_to_dataclass(
        OmegaConf.create(
            {"_target_": "verl_ext.algos.config.HeteroPolicyLossConfig", "loss_mode": "gepo", "group_size": 8}
        )
    )
    assert isinstance(good, HeteroPolicyLossConfig) and good.group_size == 8


@pytest.mark.parametrize("loss_mode", ["gepo", "eqp", "gepo_adaptive"])
@pytest.mark.parametrize("group_size, rollout_n", [(0, 5), (5, 4)])
def test_batch_not_split_into_whole_groups_raises_clear_error(loss_mode, group_size, rollout_n):
    b = ref.make_batch(seed=70, n_groups=3, group_size=4)  # 12 sequences; 12 % 5 != 0
    with pytest.raises(ValueError, match="group_size") as err:
        call_loss(loss_mode, b, actor_config(loss_mode, rollout_n=rollout_n, group_size=group_size))
    assert "rollout.n" in str(err.value) or "whole" in str(err.value)


@pytest.mark.parametrize("loss_mode", ["gepo", "eqp", "gepo_adaptive"])
def test_unset_group_size_falls_back_to_verls_rollout_n(loss_mode):
    """verl's stock ActorConfig carries rollout_n; without policy_loss.group_size it is G."""
    b = ref.make_batch(seed=72, n_groups=3, group_size=4)
    explicit, _ = call_loss(loss_mode, b, actor_config(loss_mode, rollout_n=1, group_size=4))
    fallback, _ = call_loss(loss_mode, b, actor_config(loss_mode, rollout_n=4, group_size=0))
    assert torch.equal(explicit, fallback)


@pytest.mark.parametrize("loss_mode", ["gepo", "gepo_adaptive"])
def test_upstream_denominator_needs_no_group_size(loss_mode):
    b = ref.make_batch(seed=71)
    den = torch.tensor(
        ref.group_log_denominator(ref.seq_log_prob(b.log_q, b.mask), b.groups.tolist()), dtype=torch.float64
    )
    loss, _ = call_loss(loss_mode, b, actor_config(loss_mode, group_size=0), group_log_denominator=den)
    assert torch.isfinite(loss)


# ---- seq_reduction: read by the group-expectation losses only -----------------------------------

SEQ_REDUCTION_READERS = ("gepo", "eqp", "gepo_adaptive", "gepo_tr", "gepo_tc")
# verl's gspo / geo_mean always length-normalise; topr has topr_reduction; the rest are token-level
SEQ_REDUCTION_IGNORED_BY = ("vanilla", "gspo", "geo_mean", "cispo", "topr", "delta_l", "m2po", "vespo")


@pytest.mark.parametrize("loss_mode", SEQ_REDUCTION_IGNORED_BY)
def test_seq_reduction_sum_with_a_loss_that_ignores_it_fails_naming_the_key(loss_mode):
    with pytest.raises(ValueError, match="seq_reduction") as err:
        HeteroPolicyLossConfig(loss_mode=loss_mode, seq_reduction="sum")
    assert loss_mode in str(err.value) and "gepo" in str(err.value)
    # at start, from the YAML verl's trainer composes (hydra + omega_conf_to_dataclass)
    section = composed_actor_section(
        "actor_rollout_ref.actor.policy_loss._target_=verl_ext.algos.config.HeteroPolicyLossConfig",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
        "+actor_rollout_ref.actor.policy_loss.seq_reduction=sum",
    )
    with pytest.raises((ValueError, InstantiationException), match="seq_reduction"):
        actor_from_section(section)
    # the default spelled out is harmless
    assert HeteroPolicyLossConfig(loss_mode=loss_mode, seq_reduction="mean").seq_reduction == "mean"


@pytest.mark.parametrize("loss_mode", SEQ_REDUCTION_READERS)
def test_seq_reduction_sum_accepted_and_changes_the_loss_of_its_losses(loss_mode):
    b = ref.make_batch(seed=73, drift=0.4)
    mean_cfg = actor_config(loss_mode, "seq-mean-token-mean", group_size=4)
    sum_cfg = actor_config(loss_mode, "seq-mean-token-mean", group_size=4, seq_reduction="sum")
    assert sum_cfg.policy_loss.seq_reduction == "sum"
    mean_loss, _ = call_loss(loss_mode, b, mean_cfg)
    sum_loss, _ = call_loss(loss_mode, b, sum_cfg)
    assert abs(mean_loss.item() - sum_loss.item()) > 1e-6


def test_seq_reduction_readers_are_exactly_the_project_losses_that_read_it():
    """The guard's table against the code: every project loss, given an unvalidated YAML config
    (a DictConfig, which the project's losses take), changes its loss with seq_reduction=sum iff
    the table lists it. verl's own losses have no such field."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from verl_ext.algos.config import LOSS_SPECIFIC_OPTIONS
    from verl_ext.algos.registry import HETERORL_LOSS_MODES

    assert set(LOSS_SPECIFIC_OPTIONS["seq_reduction"]) == set(SEQ_REDUCTION_READERS)
    b = ref.make_batch(seed=74, drift=0.4)
    readers = set()
    base = composed_actor_section(  # composed once (~0.5 s); each loss gets a copy with its fields set
        "+actor_rollout_ref.actor.policy_loss.group_size=4",
        "+actor_rollout_ref.actor.policy_loss.seq_reduction=mean",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    )
    for loss_mode in HETERORL_LOSS_MODES:
        values = []
        for reduction in ("mean", "sum"):
            section = copy.deepcopy(base)
            section.policy_loss.loss_mode = loss_mode
            section.policy_loss.seq_reduction = reduction
            loss, _ = get_policy_loss_fn(loss_mode)(
                old_log_prob=b.log_q,
                log_prob=b.log_p,
                advantages=b.advantages,
                response_mask=b.mask,
                loss_agg_mode=section.loss_agg_mode,
                config=section,
                rollout_is_weights=None,
            )
            values.append(loss.item())
        if values[0] != values[1]:
            readers.add(loss_mode)
    assert readers == set(SEQ_REDUCTION_READERS)
