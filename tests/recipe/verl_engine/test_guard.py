"""The bypass guard: verl's apply_bypass_mode really replaces the loss (the hazard), and the verl
engine refuses such a config at start and re-checks before every update."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from verl.protocol import DataProto
from verl.trainer.ppo.rollout_corr_helper import apply_bypass_mode

from recipe.gepo.verl_engine.launch_plan import (
    ForcedLossModeError,
    check_loss_mode_unchanged,
    check_no_forced_bypass,
    requested_loss_mode,
)

ROOT = Path(__file__).resolve().parents[3]


def gepo_cfg(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "recipe" / "gepo" / "config"), version_base=None):
        return compose(config_name="gepo_trainer", overrides=["hetero.engine=verl", *overrides])


def test_verl_bypass_mode_silently_replaces_gepo():
    """What verl's async trainers do with bypass_mode=true: the loss asked for is gone."""
    cfg = gepo_cfg("algorithm.rollout_correction.bypass_mode=true")
    assert requested_loss_mode(cfg) == "gepo"
    batch = DataProto.from_dict(tensors={"rollout_log_probs": -torch.rand(2, 3)})
    apply_bypass_mode(batch, cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.actor.policy_loss)
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "bypass_mode"
    # ... and the runtime half of the guard catches exactly that
    with pytest.raises(ForcedLossModeError, match="from 'gepo' to 'bypass_mode'"):
        check_loss_mode_unchanged("gepo", cfg.actor_rollout_ref.actor)


def test_guard_fires_at_start_with_a_clear_message():
    cfg = gepo_cfg("algorithm.rollout_correction.bypass_mode=true")
    with pytest.raises(ForcedLossModeError) as err:
        check_no_forced_bypass(cfg)
    message = str(err.value)
    assert "loss_mode='gepo'" in message and "bypass_mode=false" in message
    assert "verl_engine.old_log_prob=sampler" in message


def test_guard_passes_gepo_without_bypass_and_bypass_mode_asked_for_itself():
    check_no_forced_bypass(gepo_cfg())
    check_no_forced_bypass(
        gepo_cfg(
            "algorithm.rollout_correction.bypass_mode=true",
            "actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
        )
    )
    cfg = gepo_cfg()
    check_loss_mode_unchanged("gepo", cfg.actor_rollout_ref.actor)
