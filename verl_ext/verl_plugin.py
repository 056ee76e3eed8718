"""Registers HeteroRL's policy losses and advantage estimators into verl's registries.

Loaded by ``import verl`` in every process (entry point group ``verl.plugins`` in pyproject.toml).
verl only logs a failing plugin at DEBUG level, so ``tests/test_verl_plugin_on_cpu.py`` asserts
that the names below arrived.

Registered policy losses (``actor_rollout_ref.actor.policy_loss.loss_mode``):
    gepo, eqp, gepo_adaptive, gepo_tr, topr, delta_l. verl's own vanilla (GRPO, Dr.GRPO, BNPO's surrogate),
    gspo, geo_mean (GMPO) and cispo are used as they are (docs/algorithms.md: where they differ
    from their papers).
Registered advantage estimators (``algorithm.adv_estimator``): bnpo.

Every loss here has verl's signature (see ``verl.workers.utils.losses.ppo_loss``) plus two
optional keyword arguments that verl never passes but the project's engines do:
``group_log_denominator`` [B] (GEPO's log E_q[q], computed over whole prompt groups upstream) and
``group_index`` [B] (prompt-group labels). Without them, groups are taken as contiguous runs of
``policy_loss.group_size`` sequences, and a batch that does not split into whole groups is an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_adv_est, register_policy_loss
from verl.workers.config import PolicyLossConfig

from verl_ext.algos import advantages as adv_lib
from verl_ext.algos import importance as iw
from verl_ext.algos import losses
from verl_ext.algos.diagnostics import importance_weight_stats, sampler_learner_kl
from verl_ext.group_index import uid_group_index

HETERORL_LOSS_MODES = ("gepo", "eqp", "gepo_adaptive", "gepo_tr", "topr", "delta_l")
HETERORL_ADV_ESTIMATORS = ("bnpo",)


@dataclass
class HeteroPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus the hyper-parameters of HeteroRL's losses.

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=verl_ext.verl_plugin.HeteroPolicyLossConfig``
    (the recipe's presets do). verl's own losses ignore the extra fields, except
    ``sampler_kl_coef``, which the project's loss bridge applies to every loss.
    """

    group_size: int = 0
    """Responses per prompt (G, = ``rollout.n``). Used to form prompt groups when no per-sequence
    denominator or group index reaches the loss. 0 = unknown (GEPO then needs one of those)."""

    group_scope: str = "group"
    """Over what GEPO's E_q[q] is estimated. "group": each prompt's G responses (the paper's
    definition; exact). "micro_batch": the whole micro-batch as one group -- what the reference
    code does after shuffling, mixing prompts; only for reproducing it."""

    seq_reduction: str = "mean"
    """Sequence log-probability used in sequence-level weights (GEPO, EqP, GEPO-adaptive).
    "mean": length-normalised geometric mean, as the paper's code; "sum": full sequence."""

    adaptive_kl_threshold: float = 0.002
    """gepo_adaptive: a sequence whose token-mean KL(sampler || learner) is below this uses p_i/q_i."""

    delta_l_alpha: float = 1.0
    """delta_l: exponent of the length weights L_i^-alpha (1 = minimum variance; paper uses 0.75 for math)."""

    topr_reduction: str = "sum"
    """topr: trajectory ratio for truncating negative examples. "sum": full sequence (the paper); "mean"."""

    sampler_kl_coef: float = 0.0
    """Weight of the KL(sampler || learner) penalty added to the loss (the paper's runs: 0.005). 0 = off."""

    sampler_kl_estimator: str = "k3"
    """Per-token penalty. "k3": (p/q - 1) - log(p/q), unbiased for KL(sampler || learner) under
    sampler tokens. "reference": (q/p - 1) - log(q/p), what the GEPO reference code computes."""

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        choices = {
            "group_scope": ("group", "micro_batch"),
            "seq_reduction": ("mean", "sum"),
            "topr_reduction": ("mean", "sum"),
            "sampler_kl_estimator": ("k3", "reference"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"policy_loss.{name}={getattr(self, name)!r}; expected one of {allowed}")
        if self.group_size < 0:
            raise ValueError(f"policy_loss.group_size must be >= 0, got {self.group_size}")
        if self.sampler_kl_coef < 0:
            raise ValueError(f"policy_loss.sampler_kl_coef must be >= 0, got {self.sampler_kl_coef}")
        if self.delta_l_alpha < 0:
            raise ValueError(f"policy_loss.delta_l_alpha must be >= 0, got {self.delta_l_alpha}")
        if self.adaptive_kl_threshold < 0:
            raise ValueError(f"policy_loss.adaptive_kl_threshold must be >= 0, got {self.adaptive_kl_threshold}")


_DEFAULTS = HeteroPolicyLossConfig()


def loss_option(config: Any, name: str) -> Any:
    """A HeteroPolicyLossConfig field from an actor config, or its default when the user kept
    verl's plain PolicyLossConfig (so verl's own configs work unchanged)."""
    policy_loss = None if config is None else config.get("policy_loss", None)
    value = None if policy_loss is None else policy_loss.get(name, None)
    return getattr(_DEFAULTS, name) if value is None else value


def clip_range(config: Any) -> tuple[float, float]:
    """(low, high) clip range from verl's actor config (clip_ratio_low/high default to clip_ratio)."""
    clip = config.get("clip_ratio", 0.2)
    low = config.get("clip_ratio_low", None)
    high = config.get("clip_ratio_high", None)
    return (clip if low is None else low), (clip if high is None else high)


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
    if loss_option(config, "group_scope") == "micro_batch":
        return torch.zeros(batch_size, dtype=torch.long, device=device), None
    group_size = int(loss_option(config, "group_size")) or int(_get(config, "rollout_n", 0) or 0)
    check_contiguous_groups(config)
    return iw.contiguous_group_index(batch_size, group_size).to(device), None


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
    loss_mat = terms.loss_mat
    if rollout_is_weights is not None:
        loss_mat = loss_mat * rollout_is_weights
    if loss is None:
        loss = agg_loss(
            loss_mat=loss_mat,
            loss_mask=response_mask,
            loss_agg_mode=loss_agg_mode,
            **(config.get("global_batch_info", None) or {}),
        )
    mask = response_mask.bool()
    n_tokens = mask.sum().clamp(min=1)
    metrics = {
        "actor/pg_clipfrac": ((terms.clipped & mask).sum() / n_tokens).item(),
        "actor/ppo_kl": ((old_log_prob - log_prob.detach()) * mask).sum().div(n_tokens).item(),
        "is/kl_sampler_learner": sampler_learner_kl(log_prob, old_log_prob, response_mask),
    }
    metrics.update(importance_weight_stats(terms.weight, response_mask))
    return loss, metrics


def _group_aware(fn):
    """Mark a loss as accepting ``group_log_denominator`` / ``group_index`` (the loss bridge checks)."""
    fn.accepts_group_info = True
    return fn


def _group_denominator_loss(name: str, terms_fn: Callable[..., losses.LossTerms], doc: str,
                            options: Callable[[Any], dict] = lambda config: {}):
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
        terms = terms_fn(
            log_prob, old_log_prob, advantages, response_mask,
            clip_low=low, clip_high=high, group_index=gi, log_denominator=log_den,
            reduction=loss_option(config, "seq_reduction"), **options(config),
        )  # fmt: skip
        return _finish(terms, old_log_prob, log_prob, response_mask, loss_agg_mode, config, rollout_is_weights)

    loss.__name__ = loss.__qualname__ = f"compute_policy_loss_{name}"
    loss.__doc__ = doc + " All tensors [B, T] but the optional group arguments [B]."
    return register_policy_loss(name)(loss)


compute_policy_loss_gepo = _group_denominator_loss(
    "gepo", losses.gepo_loss_terms,
    "GEPO (Group Expectation Policy Optimization, arXiv 2508.17850): "
    ":func:`verl_ext.algos.losses.gepo_loss_terms`.",
)  # fmt: skip
compute_policy_loss_gepo_adaptive = _group_denominator_loss(
    "gepo_adaptive", losses.gepo_adaptive_loss_terms,
    "GEPO-adaptive (the reference code's \"gepo+\"): p_i/q_i for fresh sequences, p_i/E_q[q] for stale; "
    ":func:`verl_ext.algos.losses.gepo_adaptive_loss_terms`.",
    lambda config: {"kl_threshold": float(loss_option(config, "adaptive_kl_threshold"))},
)  # fmt: skip
compute_policy_loss_gepo_tr = _group_denominator_loss(
    "gepo_tr", losses.gepo_tr_loss_terms,
    "GEPO-TR: GEPO's gradient p_i/E_q[q] inside PPO's clip band on p_i/q_i; "
    ":func:`verl_ext.algos.losses.gepo_tr_loss_terms`.",
)  # fmt: skip


@register_policy_loss("eqp")
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
    terms = losses.eqp_loss_terms(
        log_prob, old_log_prob, advantages, response_mask,
        clip_low=low, clip_high=high, group_index=gi, reduction=loss_option(config, "seq_reduction"),
    )  # fmt: skip
    return _finish(terms, old_log_prob, log_prob, response_mask, loss_agg_mode, config, rollout_is_weights)


@register_policy_loss("topr")
def compute_policy_loss_topr(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """TOPR (Tapered Off-Policy REINFORCE). See :func:`verl_ext.algos.losses.topr_loss_terms`."""
    terms = losses.topr_loss_terms(
        log_prob, old_log_prob, advantages, response_mask, reduction=loss_option(config, "topr_reduction")
    )
    return _finish(terms, old_log_prob, log_prob, response_mask, loss_agg_mode, config, rollout_is_weights)


@register_policy_loss("delta_l")
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
        loss_mat, response_mask, float(loss_option(config, "delta_l_alpha")), scale,
        global_batch_size=info.get("global_batch_size"), dp_size=int(info.get("dp_size") or 1),
    )  # fmt: skip
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


# The CPU backend for verl's own trainer (platform, hf_cpu rollout, ray_mailbox weight sync); its
# patches of verl internals apply only when verl picks the CPU platform (no accelerator present).
# A failure here must not take the losses above with it (verl logs a failing plugin only at DEBUG).
try:
    from verl_ext.cpu import register as _register_cpu_backend

    _register_cpu_backend()
except Exception as _exc:  # pragma: no cover - depends on the installed verl
    import logging as _logging

    _logging.getLogger(__name__).warning("HeteroRL's CPU backend for verl was not registered: %r", _exc)
