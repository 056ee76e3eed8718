"""Worker-side actor loss for verl's engine workers: verl's ``ppo_loss`` with the project's objective.

verl's ``verl.workers.utils.losses.ppo_loss`` calls the registered policy loss without any group
information, so GEPO's exact denominator (computed on the driver over whole prompt groups:
:mod:`recipe.gepo.verl_engine.batch_rules`) would be lost. :func:`hetero_ppo_loss` has the same
signature and inputs (a micro-batch TensorDict and the engine's model output) and keeps only what is
verl-specific: unpadding the model output, the global-batch normalisation info and verl's ``Metric``
aggregation types. The objective is :func:`verl_ext.algos.objective.compute_actor_loss`, the embedded
learner's, with ``group_log_denominator`` [B] forwarded when the batch carries it, so both engines
give the same loss on the same batch. Without the field the losses fall back to contiguous groups of
``policy_loss.group_size`` within the micro-batch, and fail loudly if it does not split into whole groups.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from tensordict import TensorDict
from verl.utils.metric import AggregationType, Metric
from verl.workers.utils.losses import ppo_loss as verl_ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from verl_ext.algos.objective import compute_actor_loss

GROUP_LOG_DENOMINATOR = "group_log_denominator"
"""Name of the per-sequence field [B] that carries log E_q[q] from the driver to the loss
(:mod:`recipe.gepo.verl_engine.batch_rules` writes it)."""

# compute_actor_loss's loss-valued metrics -> the names this worker reports (verl's where it has one)
_LOSS_METRICS = {
    "actor/pg_loss": "actor/pg_loss",
    "actor/loss": "actor/policy_loss",
    "actor/sampler_kl_penalty": "actor/sampler_kl_penalty",
    "actor/entropy_loss": "actor/entropy_loss",
    "actor/kl_loss": "kl_loss",
}


def _per_sequence(data: TensorDict, key: str) -> torch.Tensor | None:
    """A [B] per-sequence field of the micro-batch, or None if absent."""
    if key not in data.keys():
        return None
    value = data[key]
    if value.is_nested:
        value = value.to_padded_tensor(0.0)
    return value.reshape(-1)


def hetero_ppo_loss(config: Any, model_output: dict, data: TensorDict, dp_group: Any = None):
    """Drop-in replacement of verl's ``ppo_loss`` (same arguments, same return: ``(loss, metrics)``).

    Args:
        config: verl ``ActorConfig`` (with ``HeteroPolicyLossConfig`` as ``policy_loss``).
        model_output: the engine's output, ``log_probs`` (nested or flat over all tokens) and
            optionally ``entropy``.
        data: the micro-batch TensorDict as verl's engine hands it to the loss, plus optionally
            ``group_log_denominator`` [B].
        dp_group: unused (same signature as verl's).
    """
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    entropy = model_output.get("entropy", None)
    if entropy is not None:
        entropy = no_padding_2_padding(entropy, data)

    # the global-batch normalisation verl's agg_loss uses (identical to verl's ppo_loss)
    info = config.global_batch_info
    info["dp_size"] = data["dp_size"]
    info["batch_num_tokens"] = data["batch_num_tokens"]
    info["global_batch_size"] = data["global_batch_size"]
    info["loss_scale_factor"] = config.loss_scale_factor
    global_normalised = (
        info["dp_size"] > 1
        or info["batch_num_tokens"] is not None
        or info["global_batch_size"] is not None
        or config.loss_scale_factor is not None
    )
    loss_aggregation = AggregationType.SUM if global_normalised else AggregationType.MEAN

    denominator = _per_sequence(data, GROUP_LOG_DENOMINATOR)
    wanted = ["response_mask", "old_log_probs", "advantages"]
    wanted += [k for k in ("rollout_is_weights", "ref_log_prob") if k in data.keys()]
    padded = data.select(*wanted).to_padded_tensor()
    response_mask = padded["response_mask"].to(bool)
    if denominator is not None and denominator.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"{GROUP_LOG_DENOMINATOR} has {denominator.shape[0]} entries for a micro-batch of "
            f"{response_mask.shape[0]} sequences"
        )

    loss, values = compute_actor_loss(
        config,
        log_prob=log_prob,
        old_log_prob=padded["old_log_probs"],
        advantages=padded["advantages"],
        response_mask=response_mask,
        group_log_denominator=denominator,
        rollout_is_weights=padded.get("rollout_is_weights", None),
        entropy=entropy,
        ref_log_prob=padded.get("ref_log_prob", None),
    )
    # metrics a micro-batch may or may not define (the gradient-mechanism ones: no token with A > 0
    # -> no is/clipfrac_pos_adv) cannot go through verl's cross-rank aggregation, which needs the
    # same number of values from every rank; they are the embedded engine's (the study's)
    for key in _OPTIONAL_METRICS:
        values.pop(key, None)
    # loss-valued metrics are shares of the global batch when it is normalised globally (summed
    # over micro-batches); verl's own names where verl has one
    summed = {name: values.pop(key) for key, name in _LOSS_METRICS.items() if key in values}
    kl_coef = values.pop("actor/kl_coef", None)
    metrics: dict[str, Any] = {name: Metric(value=v, aggregation=_aggregation(name)) for name, v in values.items()}
    metrics.update({name: Metric(value=value, aggregation=loss_aggregation) for name, value in summed.items()})
    if kl_coef is not None:
        metrics["kl_coef"] = kl_coef
    metrics["actor/has_group_denominator"] = Metric(
        value=float(denominator is not None), aggregation=AggregationType.MEAN
    )
    return loss, metrics


_OPTIONAL_METRICS = (
    "is/clipfrac_pos_adv",
    "is/clipfrac_neg_adv",
    "is/grad_weight_pos_adv",
    "is/grad_weight_neg_adv",
    "is/zero_grad_seq_frac",
)


def _aggregation(name: str) -> AggregationType:
    """How verl combines a per-micro-batch metric over micro-batches and ranks: extremes stay
    extremes (``is/weight_max`` is the batch's largest weight, not a mean of maxima)."""
    if name.endswith("_max"):
        return AggregationType.MAX
    if name.endswith("_min"):
        return AggregationType.MIN
    return AggregationType.MEAN


def bridge_loss_fn(loss_fn: Any) -> partial:
    """verl's worker builds ``partial(ppo_loss, config=actor_config)``; return the same partial
    around :func:`hetero_ppo_loss`. Anything else (e.g. the distillation loss) is refused: the
    verl engine does not combine distillation with the denominator bridge."""
    if not (isinstance(loss_fn, partial) and loss_fn.func is verl_ppo_loss and "config" in loss_fn.keywords):
        raise TypeError(
            f"the verl engine replaces verl's ppo_loss only; the worker's loss is {loss_fn!r} "
            "(distillation is not supported by hetero.engine=verl)"
        )
    return partial(hetero_ppo_loss, config=loss_fn.keywords["config"])
