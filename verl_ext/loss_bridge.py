"""The one place where an engine turns a batch into the actor's policy loss.

Both engines call :func:`compute_actor_loss`: it looks the loss up in verl's registry by
``policy_loss.loss_mode`` (so any registered loss works, verl's or the project's), forwards the
per-sequence group information to the losses that take it, adds the KL(sampler || learner)
penalty when ``policy_loss.sampler_kl_coef`` > 0, and makes sure every loss reports the same
``is/*`` metrics. The trainer loop never knows which algorithm it runs.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from omegaconf import DictConfig
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn

from verl_ext.algos import importance as iw
from verl_ext.algos.diagnostics import importance_weight_stats, sampler_learner_kl
from verl_ext.verl_plugin import HETERORL_LOSS_MODES, loss_option

# verl's built-in losses whose importance weight is per sequence (length-normalised), not per token
_SEQUENCE_LEVEL_BUILTINS = {"gspo", "geo_mean"}


def sampler_kl_penalty(
    log_prob: torch.Tensor,
    sampler_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str = "k3",
    global_batch_info: Optional[dict] = None,
) -> torch.Tensor:
    """The paper's KL(sampler || learner) penalty: per-token estimate, token-mean per sequence,
    mean over sequences. Tensors [B, T] -> scalar (gradient through ``log_prob``).
    ``global_batch_info`` (verl's) scales a micro-batch's share so micro-batch losses sum up."""
    if estimator == "k3":
        kl = iw.k3_sampler_learner_kl(log_prob, sampler_log_prob)
    elif estimator == "reference":
        kl = iw.reference_code_kl(log_prob, sampler_log_prob)
    else:
        raise ValueError(f"sampler_kl_estimator must be 'k3' or 'reference', got {estimator!r}")
    return agg_loss(loss_mat=kl, loss_mask=response_mask, loss_agg_mode="seq-mean-token-mean", **(global_batch_info or {}))


def builtin_weight_stats(
    loss_mode: str, log_prob: torch.Tensor, old_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """``is/*`` weight statistics for verl's own losses, which do not report them."""
    with torch.no_grad():
        if loss_mode in _SEQUENCE_LEVEL_BUILTINS:
            weight = torch.exp(iw.sequence_log_weight(log_prob, old_log_prob, response_mask, "mean"))
        else:
            weight = torch.exp(iw.token_log_weight(log_prob, old_log_prob).clamp(-20.0, 20.0))
    return importance_weight_stats(weight, response_mask)


def compute_actor_loss(
    config: Any,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    group_log_denominator: Optional[torch.Tensor] = None,
    group_index: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss of the configured algorithm, plus the sampler-KL penalty, with uniform metrics.

    Args:
        config: verl ``ActorConfig`` (``omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)``).
            The project's own losses also take the actor DictConfig; verl's built-ins do not.
        log_prob: [B, T] learner token log-probs, with gradient.
        old_log_prob: [B, T] the sampler's token log-probs (the distribution the tokens came from).
        advantages: [B, T].
        response_mask: [B, T] bool.
        group_log_denominator: [B] GEPO's log E_q[q] over each sequence's whole prompt group.
        group_index: [B] prompt-group labels.
        rollout_is_weights: [B, T] verl rollout-correction weights, if any.

    Returns:
        (scalar loss, metrics) with ``actor/pg_loss``, ``actor/loss``, ``is/*`` keys and, when the
        penalty is on, ``actor/sampler_kl_penalty``.
    """
    loss_mode = config.policy_loss.get("loss_mode", "vanilla")
    loss_fn = get_policy_loss_fn(loss_mode)
    if isinstance(config, DictConfig) and loss_mode not in HETERORL_LOSS_MODES:
        raise TypeError(
            f"verl's built-in loss {loss_mode!r} needs a verl ActorConfig, got a DictConfig; convert it with "
            "verl.utils.config.omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)"
        )
    extra = {}
    if getattr(loss_fn, "accepts_group_info", False):
        extra = {"group_log_denominator": group_log_denominator, "group_index": group_index}
    response_mask = response_mask.bool()
    pg_loss, metrics = loss_fn(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=response_mask,
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=rollout_is_weights,
        **extra,
    )
    metrics = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in metrics.items()}
    if "is/weight_mean" not in metrics:
        metrics.update(builtin_weight_stats(loss_mode, log_prob, old_log_prob, response_mask))
    if "is/kl_sampler_learner" not in metrics:
        metrics["is/kl_sampler_learner"] = sampler_learner_kl(log_prob, old_log_prob, response_mask)
    metrics["actor/pg_loss"] = pg_loss.detach().item()

    loss = pg_loss
    coef = float(loss_option(config, "sampler_kl_coef"))
    if coef > 0:
        penalty = sampler_kl_penalty(
            log_prob, old_log_prob, response_mask, loss_option(config, "sampler_kl_estimator"),
            config.get("global_batch_info", None),
        )
        loss = loss + coef * penalty
        metrics["actor/sampler_kl_penalty"] = penalty.detach().item()
    metrics["actor/loss"] = loss.detach().item()
    return loss, metrics
