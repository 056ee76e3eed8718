"""HeteroRL's policy losses and advantage estimators, registered into verl's registries.

Loaded by ``import verl`` in every process (entry point ``heterorl`` of group ``verl.plugins``;
verl logs a failing plugin only at DEBUG, so ``tests/test_verl_plugin.py`` asserts the names). Losses
(``policy_loss.loss_mode``): gepo, eqp, gepo_adaptive, gepo_tr, gepo_tc, topr, delta_l, m2po, vespo,
options :class:`verl_ext.algos.config.HeteroPolicyLossConfig`; verl's own are used as they are
(docs/algorithms.md). Advantage estimators (``algorithm.adv_estimator``): bnpo.

Every loss has verl's signature (``verl.workers.utils.losses.ppo_loss``) plus optional keywords the
project's engines pass: ``group_log_denominator`` [B] (GEPO's log E_q[q] over whole prompt groups)
and ``group_index`` [B]; without them, groups are contiguous runs of ``policy_loss.group_size``
sequences and a batch of partial groups is an error. The sampler-KL term has one owner,
:func:`add_sampler_kl`: the loss bridge adds it after any policy loss (:func:`policy_loss_fn`), and
verl's registry holds each loss with it added (:func:`_register`: verl's ``ppo_loss`` calls only that).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch
from verl.trainer.ppo.core_algos import agg_loss, get_policy_loss_fn, register_adv_est, register_policy_loss

from verl_ext.algos import advantages as adv_lib
from verl_ext.algos import compiled
from verl_ext.algos import importance as iw
from verl_ext.algos import losses
from verl_ext.algos.diagnostics import importance_weight_stats, sampler_learner_kl
from verl_ext.group_index import uid_group_index
from verl_ext.algos.config import clip_range, loss_option

HETERORL_LOSS_MODES = ("gepo", "eqp", "gepo_adaptive", "gepo_tr", "gepo_tc", "topr", "delta_l", "m2po", "vespo")


def resolve_groups(
    config: Any,
    batch_size: int,
    group_index: Optional[torch.Tensor],
    group_log_denominator: Optional[torch.Tensor],
    device: torch.device,
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(group_index, log_denominator) for a group-level loss, most exact source first."""
    if group_log_denominator is not None:
        return group_index, group_log_denominator.to(device)
    if group_index is not None:
        return group_index.to(device), None
    group_size = int(loss_option(config, "group_size")) or int(_get(config, "rollout_n", 0) or 0)
    check_contiguous_groups(config)
    return iw.contiguous_group_index(batch_size, group_size, device=device), None


def _get(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)


def check_contiguous_groups(config: Any) -> None:
    """Refuse to take contiguous runs of G sequences as prompt groups when verl may have moved them.

    verl's stock ``ppo_loss`` passes no group ids. Its v1 trainer keeps each prompt's G responses
    next to each other only with one data-parallel rank (``_balance_batch``,
    ``trainer/ppo/v1/trainer_base.py:1608``, reorders across ranks), no shuffle and fixed-size
    micro-batches of whole groups; otherwise a group-level loss would mix prompts silently.
    """
    problems = []
    if bool(_get(config, "shuffle", False)):
        problems.append("actor_rollout_ref.actor.shuffle=true")
    if bool(_get(config, "use_dynamic_bsz", False)):
        problems.append("actor_rollout_ref.actor.use_dynamic_bsz=true")
    info = _get(config, "global_batch_info", None) or {}
    dp_size = info.get("dp_size", 1) if hasattr(info, "get") else 1
    if dp_size is not None and int(dp_size) > 1:
        problems.append(f"{int(dp_size)} data-parallel ranks")
    if problems:
        raise ValueError(
            f"loss_mode={_get(_get(config, 'policy_loss', {}), 'loss_mode', '?')!r} "
            f"needs whole prompt groups, but verl's stock trainer gives the loss no group ids and with "
            f"{', '.join(problems)} it does not keep a prompt's responses together. Train with the project's "
            "trainer, which computes the group denominators exactly on the driver (python -m recipe.gepo.main_gepo "
            "hetero.engine=verl ...), or use one data-parallel rank with actor.shuffle=false and "
            "actor.use_dynamic_bsz=false."
        )


def sampler_kl_penalty(
    log_prob: torch.Tensor,
    sampler_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    global_batch_info: Optional[dict] = None,
) -> torch.Tensor:
    """The paper's KL(sampler || learner) penalty: per-token k3 estimate, token-mean per sequence,
    mean over sequences. Tensors [B, T] -> scalar (gradient through ``log_prob``).
    ``global_batch_info`` (verl's) scales a micro-batch's share so micro-batch losses sum up."""
    kl = iw.k3_sampler_learner_kl(log_prob, sampler_log_prob)
    return agg_loss(
        loss_mat=kl, loss_mask=response_mask, loss_agg_mode="seq-mean-token-mean", **(global_batch_info or {})
    )


def _finish(
    terms: losses.LossTerms,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: Any,
    rollout_is_weights: Optional[torch.Tensor],
    loss: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Aggregate a loss matrix the verl way and attach the shared metrics."""
    info = (config.get("global_batch_info", None) if config is not None else None) or {}
    loss_mat = terms.loss_mat
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights
    if loss is None:
        loss = agg_loss(loss_mat=loss_mat, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **info)
    mask = response_mask.bool()
    n_tokens = mask.sum().clamp(min=1)
    metrics = {
        "actor/pg_clipfrac": ((terms.clipped & mask).sum() / n_tokens).item(),
        "actor/ppo_kl": ((old_log_prob - log_prob.detach()) * mask).sum().div(n_tokens).item(),
        "is/kl_sampler_learner": sampler_learner_kl(log_prob, old_log_prob, response_mask),
    }
    metrics.update(importance_weight_stats(terms.weight, response_mask))
    metrics.update(terms.metrics)
    return loss, metrics


def _group_aware(fn):
    """Mark a loss as accepting ``group_log_denominator`` / ``group_index`` (the loss bridge checks)."""
    fn.accepts_group_info = True
    return fn


def add_sampler_kl(
    loss: torch.Tensor,
    config: Any,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    global_batch_info: Optional[dict] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The sampler-KL term, the one place it is added: ``loss + policy_loss.sampler_kl_coef x``
    :func:`sampler_kl_penalty` against the old policy the caller passes (the sampler's q; the
    proximal policy under the bridge's rollout correction; verl's recomputed old policy when verl
    uses one), and the penalty; ``(loss, None)`` when the coefficient is 0."""
    coef = float(loss_option(config, "sampler_kl_coef"))
    if not coef > 0:
        return loss, None
    penalty = sampler_kl_penalty(log_prob, old_log_prob, response_mask, global_batch_info)
    return loss + coef * penalty, penalty


_POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, float]]]] = {}
"""The project's policy losses alone, by loss_mode (verl's registry holds them with the term added)."""


def policy_loss_fn(loss_mode: str) -> Callable[..., tuple[torch.Tensor, dict[str, float]]]:
    """The policy loss ``loss_mode`` alone, without the sampler-KL term: the project's from
    :data:`_POLICY_LOSSES`, verl's built-ins from verl's registry (which has none of the term)."""
    return _POLICY_LOSSES.get(loss_mode) or get_policy_loss_fn(loss_mode)


def _register(name: str, fn: Callable) -> Callable:
    """Register ``fn`` (a policy loss alone) as verl's loss ``name`` with :func:`add_sampler_kl`
    added after it, and keep ``fn`` for :func:`policy_loss_fn`; returns ``fn``."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)  # keeps the name, module and marks (accepts_group_info)
    def with_sampler_kl(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, float]]:
        loss, metrics = fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        config, log_prob, old_log_prob, response_mask = (
            bound.arguments[k] for k in ("config", "log_prob", "old_log_prob", "response_mask")
        )
        info = (config.get("global_batch_info", None) if config is not None else None) or {}
        loss, penalty = add_sampler_kl(loss, config, log_prob, old_log_prob, response_mask, info)
        if penalty is not None:
            with torch.no_grad():
                # this micro-batch's own value: verl averages pg metrics over micro-batches
                metrics["actor/sampler_kl_penalty"] = sampler_kl_penalty(log_prob, old_log_prob, response_mask).item()
        return loss, metrics

    _POLICY_LOSSES[name] = fn
    register_policy_loss(name)(with_sampler_kl)
    return fn


def _register_as(name: str) -> Callable[[Callable], Callable]:
    """:func:`_register` as a decorator."""
    return lambda fn: _register(name, fn)


def _terms_fn(name: str, eager: Callable[..., losses.LossTerms], config: Any) -> Callable[..., losses.LossTerms]:
    """``eager``, or its torch.compile'd form (:mod:`verl_ext.algos.compiled`) under ``policy_loss.compile``."""
    return compiled.compiled_loss_terms(name) if bool(loss_option(config, "compile")) else eager


def _group_denominator_loss(
    name: str, terms_fn: Callable[..., losses.LossTerms], doc: str, options: Callable[[Any], dict] = lambda config: {}
):
    """Register ``name``: a loss whose terms take the clip range and GEPO's group denominator
    (from upstream per-sequence values, a ``group_index``, or contiguous ``group_size`` groups, as
    :func:`resolve_groups` finds them); ``options(config)`` adds its own keyword arguments."""

    @_group_aware
    def loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "seq-mean-token-mean",
        config: Any = None,
        rollout_is_weights: Optional[torch.Tensor] = None,
        group_log_denominator: Optional[torch.Tensor] = None,
        group_index: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        low, high = clip_range(config)
        gi, log_den = resolve_groups(config, log_prob.shape[0], group_index, group_log_denominator, log_prob.device)
        terms = _terms_fn(name, terms_fn, config)(
            log_prob,
            old_log_prob,
            advantages,
            response_mask,
            clip_low=low,
            clip_high=high,
            group_index=gi,
            log_denominator=log_den,
            reduction=loss_option(config, "seq_reduction"),
            **options(config),
        )
        return _finish(terms, old_log_prob, log_prob, response_mask, loss_agg_mode, config, rollout_is_weights)

    loss.__name__ = loss.__qualname__ = f"compute_policy_loss_{name}"
    loss.__doc__ = doc + " All tensors [B, T] but the optional group arguments [B]."
    return _register(name, loss)


compute_policy_loss_gepo = _group_denominator_loss(
    "gepo",
    losses.gepo_loss_terms,
    "GEPO (Group Expectation Policy Optimization, arXiv 2508.17850): :func:`verl_ext.algos.losses.gepo_loss_terms`.",
)
compute_policy_loss_gepo_adaptive = _group_denominator_loss(
    "gepo_adaptive",
    losses.gepo_adaptive_loss_terms,
    'GEPO-adaptive (the reference code\'s "gepo+"): p_i/q_i for fresh sequences, p_i/E_q[q] for stale; '
    ":func:`verl_ext.algos.losses.gepo_adaptive_loss_terms`.",
    lambda config: {"kl_threshold": float(loss_option(config, "adaptive_kl_threshold"))},
)
compute_policy_loss_gepo_tr = _group_denominator_loss(
    "gepo_tr",
    losses.gepo_tr_loss_terms,
    "GEPO-TR: GEPO's gradient p_i/E_q[q] inside PPO's clip band on p_i/q_i; "
    ":func:`verl_ext.algos.losses.gepo_tr_loss_terms`.",
)


compute_policy_loss_gepo_tc = _group_denominator_loss(
    "gepo_tc",
    losses.gepo_token_clip_loss_terms,
    "GEPO-TC: GEPO's weight p_i/E_q[q] on every token, gradient removed where GRPO's token clip on "
    "p_it/q_it acts (``policy_loss.tc_ess_bound``: the band shrinks with the batch's ESS); "
    ":func:`verl_ext.algos.losses.gepo_token_clip_loss_terms`.",
    lambda config: {"ess_bound": bool(loss_option(config, "tc_ess_bound"))},
)


def _token_loss(
    name: str, terms_fn: Callable[..., losses.LossTerms], doc: str, options: Callable[[Any], dict] = lambda config: {}
):
    """Register ``name``: a loss whose terms need no prompt groups, only its own options
    (``options(config)``)."""

    def loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        terms = terms_fn(log_prob, old_log_prob, advantages, response_mask, **options(config))
        return _finish(terms, old_log_prob, log_prob, response_mask, loss_agg_mode, config, rollout_is_weights)

    loss.__name__ = loss.__qualname__ = f"compute_policy_loss_{name}"
    loss.__doc__ = doc + " All tensors [B, T]."
    return _register(name, loss)


compute_policy_loss_m2po = _token_loss(
    "m2po",
    losses.m2po_loss_terms,
    "M2PO: unclipped token IS with the second-moment mask, taken over the tokens of the (micro-)batch "
    "this call sees; :func:`verl_ext.algos.losses.m2po_loss_terms`.",
    lambda config: {"threshold": float(loss_option(config, "m2po_threshold"))},
)
compute_policy_loss_vespo = _token_loss(
    "vespo",
    losses.vespo_loss_terms,
    "VESPO: REINFORCE with the sequence coefficient phi(p(y)/q(y)); :func:`verl_ext.algos.losses.vespo_loss_terms`.",
    lambda config: {
        name: float(loss_option(config, f"vespo_{name}")) for name in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")
    },
)
compute_policy_loss_topr = _token_loss(
    "topr",
    losses.topr_loss_terms,
    "TOPR (Tapered Off-Policy REINFORCE); :func:`verl_ext.algos.losses.topr_loss_terms`.",
    lambda config: {"reduction": loss_option(config, "topr_reduction")},
)


@_register_as("eqp")
@_group_aware
def compute_policy_loss_eqp(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    group_log_denominator: Optional[torch.Tensor] = None,
    group_index: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """EqP: group expectation with gradient through the denominator. Needs whole groups in the
    batch (``group_index`` or contiguous ``group_size`` groups); an upstream denominator cannot be
    used because it would carry no gradient."""
    low, high = clip_range(config)
    gi, _ = resolve_groups(config, log_prob.shape[0], group_index, None, log_prob.device)
    terms = _terms_fn("eqp", losses.eqp_loss_terms, config)(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        clip_low=low,
        clip_high=high,
        group_index=gi,
        reduction=loss_option(config, "seq_reduction"),
    )
    return _finish(terms, old_log_prob, log_prob, response_mask, loss_agg_mode, config, rollout_is_weights)


@_register_as("delta_l")
def compute_policy_loss_delta_l(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Delta-L normalisation: GRPO's clipped token surrogate aggregated as
    (1/M) sum_i x_i sum_t loss_it with x_i = L_i^-alpha / sum_j L_j^-alpha. ``loss_agg_mode`` is
    ignored (the aggregation *is* the method); M = ``loss_scale_factor`` or the padded length.
    Micro-batches are scaled by their share of the global batch; the weights normalise within
    the micro-batch the loss sees (see :func:`verl_ext.algos.losses.delta_l_aggregate`)."""
    low, high = clip_range(config)
    terms = losses.token_clipped_loss_terms(
        log_prob, old_log_prob, advantages, response_mask, clip_low=low, clip_high=high
    )
    loss_mat = terms.loss_mat if rollout_is_weights is None else terms.loss_mat * rollout_is_weights
    info = (config.get("global_batch_info", None) if config is not None else None) or {}
    scale = config.get("loss_scale_factor", None) if config is not None else None
    loss = losses.delta_l_aggregate(
        loss_mat,
        response_mask,
        float(loss_option(config, "delta_l_alpha")),
        scale,
        global_batch_size=info.get("global_batch_size"),
        dp_size=int(info.get("dp_size") or 1),
    )
    return _finish(terms, old_log_prob, log_prob, response_mask, loss_agg_mode, config, None, loss=loss)


@register_adv_est("bnpo")
def compute_bnpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Any = None,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BNPO advantages (the BNPO paper's Beta normalisation) for outcome rewards.

    Args:
        token_level_rewards: [B, T]; the sequence reward is their sum, and must lie in [0, 1].
        response_mask: [B, T].
        index: [B] prompt uids (verl's ``uid``).

    Returns:
        (advantages, returns), both [B, T]: the sequence advantage on every response token.
    """
    if index is None:
        raise ValueError("bnpo needs the prompt uid index to form groups")
    scores = token_level_rewards.sum(dim=-1)
    with torch.no_grad():
        adv = adv_lib.bnpo_advantages(scores, uid_group_index(index, scores.device))
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv
