"""The actor objective: the one place where an engine turns a batch into the actor's loss.

Both engines call :func:`compute_actor_loss`: the embedded learner on its whole batch, the verl
engine's worker (``verl_ext/algos/worker_loss.py``) on each unpadded micro-batch. It owns every
term, added in verl's ``ppo_loss`` order (so for verl's own losses the result equals ``ppo_loss``):
the policy loss from verl's registry by ``policy_loss.loss_mode`` (GEPO's group denominators passed
to the losses that take them); the sampler-KL penalty (``policy_loss.sampler_kl_coef`` > 0,
:func:`verl_ext.algos.registry.add_sampler_kl`); the entropy bonus (``- actor.entropy_coeff x entropy``
under ``loss_agg_mode``, when the engine supplies ``entropy``); the KL-to-reference term
(``actor.use_kl_loss``, ``kl_loss_coef``, ``kl_loss_type``); rollout correction (verl's
``rollout_is_weights``, or ``algorithm.rollout_correction`` computed here: :class:`RolloutCorrection`);
uniform metrics (``actor/*``, ``is/*`` weight statistics, and
:func:`gradient_mechanism_metrics`: what the loss does to each token's gradient). The trainer loop
never knows which algorithm it runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch
from omegaconf import DictConfig
from verl.trainer.ppo.core_algos import agg_loss, kl_penalty

from verl_ext.algos import importance as iw
from verl_ext.algos.diagnostics import importance_weight_stats, sampler_learner_kl

# the sampler-KL term's owner lives with the losses: verl's registry adds it to the project's losses
# (verl's own ppo_loss calls nothing else); the bridge takes the losses alone and adds it here
from verl_ext.algos.registry import HETERORL_LOSS_MODES, add_sampler_kl, policy_loss_fn

# verl's built-in losses whose importance weight is per sequence (length-normalised), not per token
_SEQUENCE_LEVEL_BUILTINS = {"gspo", "geo_mean"}


@dataclasses.dataclass(frozen=True)
class RolloutCorrection:
    """verl's ``algorithm.rollout_correction`` as the embedded engine applies it: decoupled mode,
    computed by verl's own ``compute_rollout_correction_and_rejection_mask``. The proximal ("old")
    policy is the learner itself before the update (one optimiser step per batch), so the loss's
    ratio is p / sg(p); the IS weight w(sg(p) / q) multiplies the per-token loss and rejection
    sampling removes tokens (or whole sequences) from the loss's mask. Field names and meanings
    are verl's (``verl/trainer/config/algorithm.py``, ``RolloutCorrectionConfig``)."""

    # "token": one weight per token; "sequence": one per sequence (product of the token ratios);
    # None: no IS weight (rejection sampling only)
    rollout_is: Optional[str]
    # a float C: truncated IS, min(w, C) (TIS); "lower_upper" (e.g. "0.5_5.0"): IcePop, w outside
    # [lower, upper] set to 0
    rollout_is_threshold: Union[float, str] = 2.0
    # rescale the weights to mean 1 over the batch
    rollout_is_batch_normalize: bool = False
    # rejection sampling criteria, comma separated (verl's names: token_k1, seq_sum_k1, seq_mean_k3, ...);
    # None: off
    rollout_rs: Optional[str] = None
    # one threshold per criterion ("lower_upper" for the k1 ones); required with rollout_rs
    rollout_rs_threshold: Optional[Union[float, str]] = None

    def __post_init__(self) -> None:
        if self.rollout_is not in (None, "token", "sequence"):
            raise ValueError(
                f"algorithm.rollout_correction.rollout_is={self.rollout_is!r}: expected token, sequence or null"
            )
        if self.rollout_is is None and self.rollout_rs is None:
            raise ValueError("algorithm.rollout_correction: rollout_is and rollout_rs are both null (nothing to do)")
        # verl's own parser decides what a threshold may be: run its function once on one token
        one = torch.zeros(1, 1)
        try:
            self.apply(one, one, torch.ones(1, 1, dtype=torch.bool))
        except (ValueError, TypeError) as exc:
            raise ValueError(
                f"algorithm.rollout_correction (rollout_is={self.rollout_is!r}, "
                f"rollout_is_threshold={self.rollout_is_threshold!r}, rollout_rs={self.rollout_rs!r}, "
                f"rollout_rs_threshold={self.rollout_rs_threshold!r}): {exc}"
            ) from None

    @property
    def icepop(self) -> bool:
        """True when the IS threshold is verl's "lower_upper" form (weights outside are zeroed)."""
        return isinstance(self.rollout_is_threshold, str) and "_" in self.rollout_is_threshold

    def bounds(self) -> tuple[Optional[float], float]:
        """(lower or None, upper) of the IS threshold."""
        if self.icepop:
            lower, upper = str(self.rollout_is_threshold).split("_", 1)
            return float(lower), float(upper)
        return None, float(self.rollout_is_threshold)

    def apply(
        self, proximal_log_prob: torch.Tensor, sampler_log_prob: torch.Tensor, response_mask: torch.Tensor
    ) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        """verl's weights and rejection: (weights [B, T] without gradient, zero on padding, or None
        when ``rollout_is`` is null; the loss mask [B, T] bool with rejected tokens removed)."""
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

        mask = response_mask.bool()
        weights, kept, _ = compute_rollout_correction_and_rejection_mask(
            proximal_log_prob.detach() * mask,
            sampler_log_prob * mask,
            mask.float(),
            **dataclasses.asdict(self),
        )
        if weights is not None:
            weights = weights.batch["rollout_is_weights"].detach()
        return weights, kept.bool() & mask


def rollout_correction_settings(algorithm_config: Any) -> Optional[RolloutCorrection]:
    """verl's ``algorithm.rollout_correction`` (a DictConfig, dict or verl's typed config) as the
    embedded engine applies it, or None when it is off (``rollout_is`` and ``rollout_rs`` null).
    Bypass mode (the sampler as the old policy, no proximal one) is refused, naming the key: the
    embedded engine's losses already see the sampler's q as their old policy without correction."""
    rc = algorithm_config.get("rollout_correction", None) if hasattr(algorithm_config, "get") else None
    if rc is None:
        return None
    rollout_is = rc.get("rollout_is", None)
    rollout_rs = rc.get("rollout_rs", None)
    rollout_is = None if rollout_is in ("", "null") else rollout_is
    rollout_rs = None if rollout_rs in ("", "null") else rollout_rs
    if rollout_is is None and rollout_rs is None:
        return None
    if rc.get("bypass_mode", False):
        raise ValueError(
            "algorithm.rollout_correction.bypass_mode=true: the embedded engine runs verl's decoupled mode only "
            "(bypass_mode=false); without any rollout correction its losses already use the sampler's q as old policy"
        )
    threshold = rc.get("rollout_is_threshold", 2.0)
    if isinstance(threshold, str) and "_" not in threshold:
        try:
            threshold = float(threshold)
        except ValueError:
            pass  # verl's parser names it in RolloutCorrection.__post_init__
    elif isinstance(threshold, int) and not isinstance(threshold, bool):
        threshold = float(threshold)
    return RolloutCorrection(
        rollout_is=rollout_is,
        rollout_is_threshold=threshold,
        rollout_is_batch_normalize=bool(rc.get("rollout_is_batch_normalize", False)),
        rollout_rs=rollout_rs,
        rollout_rs_threshold=rc.get("rollout_rs_threshold", None),
    )


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


def gradient_mechanism_metrics(
    pg_loss: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    global_batch_info: Optional[dict] = None,
) -> dict[str, float]:
    """What the policy loss does to each token's gradient, whatever the loss: g = d pg_loss /
    d log_prob [B, T] (autograd through the loss only, not the model; the graph is kept for the
    engine's backward) against the plain REINFORCE gradient under the same aggregation,
    g_ref = d agg_loss(-A x log_prob) / d log_prob. Only tokens with A != 0 count.

    - ``is/clipfrac_pos_adv`` / ``is/clipfrac_neg_adv``: share of tokens with A > 0 / A < 0 whose
      gradient the loss removes (g == 0 exactly: a PPO / sequence clip or a dual clip acted).
    - ``is/zero_grad_seq_frac``: share of sequences (A != 0) whose every token's gradient is removed.
    - ``is/grad_weight_pos_adv`` / ``is/grad_weight_neg_adv``: mean over sequences with A > 0
      (right answers in a mixed group) / A < 0 (wrong ones) of the token-mean of g / g_ref: the
      weight the loss gives a sequence relative to on-policy REINFORCE (1 for GRPO on-policy,
      q_i / E_q[q] for GEPO).

    A key is left out when it is undefined (no token of that sign); empty dict when ``log_prob``
    has no gradient (a metrics-only call). Shapes: [B, T] inputs.
    """
    if not (log_prob.requires_grad and pg_loss.requires_grad):
        return {}
    (grad,) = torch.autograd.grad(pg_loss, log_prob, retain_graph=True, allow_unused=True)
    if grad is None:
        return {}
    with torch.enable_grad():
        unit = torch.zeros_like(log_prob, dtype=torch.float64, requires_grad=True)
        ref = agg_loss(
            loss_mat=-advantages.double() * unit,
            loss_mask=response_mask,
            loss_agg_mode=loss_agg_mode,
            **(global_batch_info or {}),
        )
        (grad_ref,) = torch.autograd.grad(ref, unit)
    with torch.no_grad():
        mask = response_mask.bool()
        adv = advantages.detach()
        live = mask & (adv != 0) & (grad_ref != 0)
        zero = grad.detach() == 0
        out: dict[str, float] = {}
        for name, side in (("pos", adv > 0), ("neg", adv < 0)):
            tokens = live & side
            if not tokens.any():
                continue  # undefined (no such token): left out rather than a NaN in metrics.jsonl
            out[f"is/clipfrac_{name}_adv"] = float(zero[tokens].double().mean())
            weight = torch.where(tokens, grad.detach().double() / torch.where(tokens, grad_ref, 1.0), 0.0)
            n_tok = tokens.sum(-1)
            seqs = n_tok > 0
            out[f"is/grad_weight_{name}_adv"] = float((weight.sum(-1)[seqs] / n_tok[seqs]).mean())
        seq_live = live.any(-1)
        if seq_live.any():
            seq_zero = (zero | ~live).all(-1) & seq_live
            out["is/zero_grad_seq_frac"] = float(seq_zero[seq_live].double().mean())
    return out


def _policy_loss(
    config: Any,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    group_log_denominator: Optional[torch.Tensor],
    group_index: Optional[torch.Tensor],
    rollout_is_weights: Optional[torch.Tensor],
) -> tuple[torch.Tensor, dict[str, float]]:
    """The registered policy loss with ``is/*`` metrics filled in for losses that do not report them."""
    loss_mode = config.policy_loss.get("loss_mode", "vanilla")
    loss_fn = policy_loss_fn(loss_mode)  # the policy loss alone: compute_actor_loss adds the other terms
    if isinstance(config, DictConfig) and loss_mode not in HETERORL_LOSS_MODES:
        raise TypeError(
            f"verl's built-in loss {loss_mode!r} needs a verl ActorConfig, got a DictConfig; convert it with "
            "verl.utils.config.omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)"
        )
    extra = {}
    if getattr(loss_fn, "accepts_group_info", False):
        extra = {"group_log_denominator": group_log_denominator, "group_index": group_index}
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
    return pg_loss, metrics


def compute_actor_loss(
    config: Any,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    group_log_denominator: Optional[torch.Tensor] = None,
    group_index: Optional[torch.Tensor] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    ref_log_prob: Optional[torch.Tensor] = None,
    rollout_correction: Optional[RolloutCorrection] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The whole actor objective of one (micro-)batch; see the module docstring for the terms.

    loss = policy_loss + sampler_kl_coef x sampler_KL - entropy_coeff x entropy + kl_loss_coef x KL_ref

    Args:
        config: verl ``ActorConfig`` (``omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)``).
            The project's own losses also take the actor DictConfig; verl's built-ins do not.
            ``config.global_batch_info`` (filled by verl's engine per micro-batch, by the embedded
            learner once) sets the aggregation's normalisation, as in verl.
        log_prob: [B, T] learner token log-probs, with gradient.
        old_log_prob: [B, T] the sampler's token log-probs q (verl engine: ``old_log_probs``).
        advantages: [B, T].
        response_mask: [B, T] (bool or 0/1).
        group_log_denominator: [B] GEPO's log E_q[q] over each sequence's whole prompt group.
        group_index: [B] prompt-group labels.
        rollout_is_weights: [B, T] rollout-correction weights computed elsewhere (verl's driver).
        entropy: [B, T] token entropies of the learner's softmax(logits / T), with gradient. The
            bonus is subtracted whenever given (as verl's ppo_loss does); required when
            ``actor.entropy_coeff`` != 0.
        ref_log_prob: [B, T] the reference policy's token log-probs; required when
            ``actor.use_kl_loss``.
        rollout_correction: decoupled truncated IS computed here: the loss's old policy becomes
            sg(log_prob) and its per-token loss is weighted by min(sg(p) / q, C); ``is/*`` metrics
            stay sampler-vs-learner. Not together with ``rollout_is_weights``.

    Returns:
        (scalar loss, metrics): ``actor/pg_loss`` (policy loss alone), ``actor/loss`` (the total),
        the loss's own metrics, ``is/*``; ``actor/sampler_kl_penalty`` when that penalty is on,
        ``actor/entropy_loss`` when entropy is given, ``actor/kl_loss`` and ``actor/kl_coef`` with
        ``use_kl_loss``, ``is/tis_weight_mean`` and ``is/tis_truncated_frac`` with rollout correction.
    """
    response_mask = response_mask.bool()
    entropy_coeff = float(config.get("entropy_coeff", 0.0) or 0.0)
    if entropy is None and entropy_coeff != 0:
        raise ValueError(
            f"actor_rollout_ref.actor.entropy_coeff={entropy_coeff} needs the learner's token entropies; the engine "
            "passed none"
        )
    use_kl_loss = bool(config.get("use_kl_loss", False))
    if use_kl_loss and ref_log_prob is None:
        raise ValueError(
            "actor_rollout_ref.actor.use_kl_loss=true needs the reference policy's log-probs (ref_log_prob); the "
            "engine passed none"
        )

    sampler_log_prob = old_log_prob
    data_mask = response_mask
    if rollout_correction is not None:
        if rollout_is_weights is not None:
            raise ValueError(
                "pass either rollout_is_weights (computed by verl's driver) or rollout_correction, not both"
            )
        # verl's decoupled mode with the learner before this update as the proximal policy; rejected
        # tokens leave the mask of every term, as verl's driver removes them from response_mask
        old_log_prob = log_prob.detach()
        rollout_is_weights, response_mask = rollout_correction.apply(old_log_prob, sampler_log_prob, data_mask)

    pg_loss, metrics = _policy_loss(
        config,
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        group_log_denominator,
        group_index,
        rollout_is_weights,
    )
    metrics["actor/pg_loss"] = pg_loss.detach().item()

    info = config.get("global_batch_info", None) or {}
    metrics.update(gradient_mechanism_metrics(pg_loss, log_prob, advantages, response_mask, config.loss_agg_mode, info))
    # against the loss's old policy: with rollout correction that is the proximal policy, as the
    # sampler enters verl's decoupled objective through the IS weight only
    loss, penalty = add_sampler_kl(pg_loss, config, log_prob, old_log_prob, response_mask, info or None)
    if penalty is not None:
        metrics["actor/sampler_kl_penalty"] = penalty.detach().item()
    if entropy is not None:
        entropy_loss = agg_loss(loss_mat=entropy, loss_mask=response_mask, loss_agg_mode=config.loss_agg_mode, **info)
        loss = loss - entropy_coeff * entropy_loss
        metrics["actor/entropy_loss"] = entropy_loss.detach().item()
    if use_kl_loss:
        kld = kl_penalty(logprob=log_prob, ref_logprob=ref_log_prob, kl_penalty=config.kl_loss_type)
        kl_loss = agg_loss(loss_mat=kld, loss_mask=response_mask, loss_agg_mode=config.loss_agg_mode, **info)
        loss = loss + kl_loss * config.kl_loss_coef
        metrics["actor/kl_loss"] = kl_loss.detach().item()
        metrics["actor/kl_coef"] = float(config.kl_loss_coef)
    metrics["actor/loss"] = loss.detach().item()
    if rollout_correction is not None:
        metrics.update(
            _rollout_correction_metrics(
                rollout_correction, old_log_prob, sampler_log_prob, data_mask, response_mask, rollout_is_weights
            )
        )
    return loss, metrics


def _rollout_correction_metrics(
    settings: RolloutCorrection,
    proximal_log_prob: torch.Tensor,
    sampler_log_prob: torch.Tensor,
    data_mask: torch.Tensor,
    kept: torch.Tensor,
    weights: Optional[torch.Tensor],
) -> dict[str, float]:
    """The loss saw old = the learner itself: weights and KL against the sampler over the batch's
    tokens; ``is/tis_*`` the correction's weights (truncated: above the upper bound; IcePop: outside
    the bounds), ``is/rs_rejected_frac`` the share of tokens rejection sampling removed."""
    raw = torch.exp((proximal_log_prob - sampler_log_prob).clamp(-20.0, 20.0))
    out = importance_weight_stats(raw, data_mask)
    out["is/kl_sampler_learner"] = sampler_learner_kl(proximal_log_prob, sampler_log_prob, data_mask)
    if weights is not None:
        out["is/tis_weight_mean"] = float(weights[data_mask].mean())
        if settings.rollout_is == "sequence":
            # verl's sequence weight is exp(sum of token log-ratios), truncated as a whole
            raw = torch.exp(
                ((proximal_log_prob - sampler_log_prob) * data_mask).sum(-1, keepdim=True).clamp(-20.0, 20.0)
            ).expand_as(raw)
        lower, upper = settings.bounds()
        outside = raw[data_mask] > upper
        if lower is not None:
            outside = outside | (raw[data_mask] < lower)
        out["is/tis_truncated_frac"] = float(outside.double().mean())
    if settings.rollout_rs is not None:
        out["is/rs_rejected_frac"] = float((data_mask & ~kept).sum() / data_mask.sum().clamp(min=1))
    return out
