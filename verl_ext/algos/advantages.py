"""BNPO's outcome advantages over prompt groups (GRPO and Dr.GRPO use verl's own estimator), and
:func:`sequence_advantages`, one advantage per sequence from any estimator in verl's registry.
Pure torch / numpy at import; verl is imported only when an estimator is looked up.

:func:`bnpo_advantages` takes one scalar score per sequence ([B]) and group labels ([B], equal
label = same prompt) and returns one advantage per sequence ([B]); engines broadcast it over
response tokens. :func:`bnpo_group_mismatch` is what a learner can check of one group's reported
BNPO advantages without the rest of the sampler's batch.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, Mapping, Optional

import numpy as np
import torch

from verl_ext.algos.importance import dense_group_index


def _group_means(scores: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[num_groups] mean score of each group (``index``: dense labels [B])."""
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add(
        0, index, torch.ones_like(scores)
    )
    return torch.zeros_like(count).index_add(0, index, scores) / count


def beta_pdf(x: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """Density of Beta(alpha, beta) at x in [0, 1] (float64 inside for accuracy)."""
    x64 = x.to(torch.float64)
    log_norm = math.lgamma(alpha + beta) - math.lgamma(alpha) - math.lgamma(beta)
    log_pdf = log_norm + (alpha - 1) * torch.log(x64) + (beta - 1) * torch.log1p(-x64)
    # 0 * log(0) terms: Beta(1, b) at 0 and Beta(a, 1) at 1 are finite
    log_pdf = torch.nan_to_num(log_pdf, nan=log_norm, neginf=-math.inf)
    return torch.exp(log_pdf).to(x.dtype)


def bnpo_normalization_params(group_means: torch.Tensor) -> tuple[float, float]:
    """BNPO's normalisation Beta(alpha, beta) from the batch's group mean rewards [G].

    A Beta(a, b) is fitted to the group means by the method of moments (batch mean mu, variance
    v: a = mu k, b = (1 - mu) k, k = mu (1 - mu) / v - 1); then alpha = max(1 + a/3, 1),
    beta = max(1 + b/3, 1) (the BNPO paper's choice). When the moments admit no Beta (v = 0, or
    v >= mu (1 - mu)) the normalisation falls back to Beta(1, 1): density 1, i.e. Dr.GRPO.
    """
    mu = float(group_means.mean())
    var = float(group_means.var(unbiased=False)) if group_means.numel() > 1 else 0.0
    spread = mu * (1.0 - mu)
    if var <= 0.0 or var >= spread:
        return 1.0, 1.0
    k = spread / var - 1.0
    a, b = mu * k, (1.0 - mu) * k
    return max(1.0 + a / 3.0, 1.0), max(1.0 + b / 3.0, 1.0)


BNPO_MAX_ABS_ADVANTAGE = 5.0
"""|A| bound of :func:`bnpo_advantages` (this project's; the density is tiny near p_g = 0 or 1)."""


def bnpo_advantages(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    max_abs_advantage: float = BNPO_MAX_ABS_ADVANTAGE,
    mean_clip: float = 1e-3,
) -> torch.Tensor:
    """BNPO (Beta Normalization Policy Optimization) advantages, the paper's definition.

    A_i = (r_i - p_g) / f(p_g; alpha, beta), with p_g the group's mean reward (the estimate of the
    prompt's success probability) and f the Beta density of :func:`bnpo_normalization_params`.
    This is *not* TRL's "bnpo" loss aggregation (token sum / total tokens).

    Args:
        scores: [B] rewards in [0, 1] (the Beta model needs a success probability).
        group_index: [B] group labels.
        max_abs_advantage: |A| is clamped to this; the density is small near p_g = 0 or 1 and would
            otherwise blow single sequences up (the paper clamps too; the bound is this project's).
        mean_clip: p_g is clamped into [mean_clip, 1 - mean_clip] before the density is taken.

    Returns:
        [B] advantages; groups whose rewards all tie give exactly 0.
    """
    scores = scores.to(torch.float32) if not scores.is_floating_point() else scores
    bad = (scores < 0) | (scores > 1) | ~torch.isfinite(scores)
    if bool(bad.any()):
        raise ValueError(
            f"bnpo needs rewards in [0, 1]; got {scores[bad][:5].tolist()} -- rescale the reward or use grpo"
        )
    index, num_groups = dense_group_index(group_index.to(scores.device))
    group_means = _group_means(scores, index, num_groups)
    mean = group_means[index]
    alpha, beta = bnpo_normalization_params(group_means)
    density = beta_pdf(mean.clamp(mean_clip, 1.0 - mean_clip), alpha, beta)
    adv = (scores - mean) / density
    return adv.clamp(-max_abs_advantage, max_abs_advantage)


def bnpo_group_mismatch(
    rewards: np.ndarray,
    advantages: np.ndarray,
    max_abs_advantage: float = BNPO_MAX_ABS_ADVANTAGE,
    tolerance: float = 1e-4,
) -> Optional[str]:
    """What one group's reported BNPO advantages can be checked for without the rest of its batch.

    Within a group, :func:`bnpo_advantages` is A_i = clamp(c (r_i - mean r), +-max_abs) with one
    c = 1 / f(p_g) > 0; only c depends on the other groups of the batch (through the Beta fit).
    So the group's advantages must be proportional to its reward deviations with one positive
    factor, up to the clamp: this catches flipped signs, forged single responses and advantages
    copied from another group; it cannot see the scale c (a liar can scale its group's advantages,
    within the clamp).

    Args:
        rewards: [G] the group's rewards (as recomputed by the checker).
        advantages: [G] the reported per-sequence advantages.

    Returns:
        None when consistent, else what is wrong.
    """
    r = np.asarray(rewards, np.float64)
    a = np.asarray(advantages, np.float64)
    if r.shape != a.shape or r.ndim != 1:
        return f"advantages of shape {a.shape} for rewards of shape {r.shape}"
    if not np.isfinite(a).all():
        return "non-finite advantages"
    d = r - r.mean()
    moving = np.abs(d) > 1e-9
    if np.abs(a[~moving]).max(initial=0.0) > tolerance:
        return "a response with the group's mean reward has a non-zero advantage"
    if not moving.any():
        return None
    if not (np.sign(a[moving]) == np.sign(d[moving])).all():
        return "an advantage's sign differs from its reward's deviation from the group mean"
    clamped = moving & (np.abs(a) >= max_abs_advantage - tolerance)
    if np.abs(a).max() > max_abs_advantage + tolerance:
        return f"|advantage| above the clamp {max_abs_advantage:g}"
    free = moving & ~clamped
    if free.any():
        c = float((a[free] * d[free]).sum() / (d[free] ** 2).sum())  # least squares, one factor
        if np.abs(a[free] - c * d[free]).max() > tolerance:
            return "advantages are not one positive multiple of the reward deviations"
        if clamped.any() and (c * np.abs(d[clamped])).min() < max_abs_advantage - tolerance:
            return "a clamped advantage whose unclamped value would be inside the clamp"
    return None


@functools.lru_cache(maxsize=None)
def _parameters(fn: Callable) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(fn).parameters  # read once per estimator: the learner calls this for every group


ADVANTAGE_INPUTS = ("token_level_rewards", "response_mask", "index", "norm_adv_by_std_in_grpo", "config")
"""What :func:`sequence_advantages` gives an estimator: rewards, masks and group ids (no critic
values, reward baselines or log-probs)."""


def unfed_advantage_inputs(name: str) -> list[str]:
    """The required arguments of verl's estimator ``name`` that :func:`sequence_advantages` cannot
    give (``gae`` needs ``values``, ``remax`` ``reward_baselines``, ...): empty when it can run."""
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    params = _parameters(get_adv_estimator_fn(name))
    return [
        k
        for k, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and k not in ADVANTAGE_INPUTS
    ]


def sequence_advantages(
    rewards: torch.Tensor, response_mask: torch.Tensor, uids: list[str], algorithm_config: Any
) -> torch.Tensor:
    """One advantage per sequence from verl's registered estimator. rewards [B], mask [B, R] -> [B].

    The reward sits on the last response token, as verl's reward managers put it.
    """
    name = algorithm_config.get("adv_estimator", "grpo")
    name = getattr(name, "value", name)
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    fn = get_adv_estimator_fn(name)
    lengths = response_mask.sum(dim=-1)
    token_rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    rows = torch.arange(len(rewards), device=response_mask.device)
    token_rewards[rows, (lengths - 1).clamp(min=0)] = rewards.float()
    kwargs: dict[str, Any] = {"token_level_rewards": token_rewards, "response_mask": response_mask.float()}
    params = _parameters(fn)
    if "index" in params:
        kwargs["index"] = np.array(uids, dtype=object)
    if "norm_adv_by_std_in_grpo" in params:
        kwargs["norm_adv_by_std_in_grpo"] = bool(algorithm_config.get("norm_adv_by_std_in_grpo", True))
    if "config" in params:
        kwargs["config"] = algorithm_config
    advantages, _ = fn(**kwargs)
    return (advantages * response_mask).sum(dim=-1) / lengths.clamp(min=1)
