"""Guard against verl silently replacing the configured policy loss.

verl 0.9.1's async trainers (``one_step_off_policy``, ``fully_async_policy``, the separation
trainer) and the legacy ``RayPPOTrainer`` call ``apply_bypass_mode`` whenever
``algorithm.rollout_correction.bypass_mode`` is true, and that function overwrites
``policy_loss.loss_mode`` with ``"bypass_mode"`` -- a run asking for GEPO would train with a
different loss and say nothing. The verl engine gets the same effect that users want from
bypass mode (train on the sampler's log-probs) with ``verl_engine.old_log_prob=sampler``, so a
run asking for any loss other than ``bypass_mode`` together with ``bypass_mode=true`` is refused
at start, and the trainer re-checks the loss mode before every update.
"""

from __future__ import annotations

from typing import Any


class ForcedLossModeError(ValueError):
    """The config would let verl replace the configured policy loss."""


def requested_loss_mode(cfg: Any) -> str:
    return str(cfg.actor_rollout_ref.actor.policy_loss.get("loss_mode", "vanilla"))


def check_no_forced_bypass(cfg: Any) -> None:
    """Raise :class:`ForcedLossModeError` if verl could force ``loss_mode=bypass_mode`` on this run.

    Fires when ``algorithm.rollout_correction.bypass_mode`` is true and the requested loss is not
    ``bypass_mode`` itself, and when the legacy trainer (``trainer.use_v1=false``) is selected.
    """
    loss_mode = requested_loss_mode(cfg)
    rollout_corr = cfg.algorithm.get("rollout_correction", None)
    bypass = bool(rollout_corr is not None and rollout_corr.get("bypass_mode", False))
    if bypass and loss_mode != "bypass_mode":
        raise ForcedLossModeError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r} with "
            "algorithm.rollout_correction.bypass_mode=true: verl's async trainers replace the loss "
            "with 'bypass_mode' (apply_bypass_mode), so this run would not train with "
            f"{loss_mode!r}. Set algorithm.rollout_correction.bypass_mode=false; to train on the "
            "sampler's log-probs use verl_engine.old_log_prob=sampler (the default)."
        )
    if not cfg.trainer.get("use_v1", True):
        raise ForcedLossModeError(
            "trainer.use_v1=false selects verl's legacy RayPPOTrainer, which the verl engine does not "
            "extend (it would not carry GEPO's group denominators); set trainer.use_v1=true."
        )


def check_loss_mode_unchanged(expected: str, actor_cfg: Any) -> None:
    """Runtime half of the guard: the loss mode in the live config is still the one asked for."""
    current = str(actor_cfg.policy_loss.get("loss_mode", "vanilla"))
    if current != expected:
        raise ForcedLossModeError(
            f"policy_loss.loss_mode changed from {expected!r} to {current!r} during the run "
            "(something called verl's apply_bypass_mode?); refusing to train with a loss that was not asked for"
        )
