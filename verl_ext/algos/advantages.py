"""Outcome advantages over prompt groups: GRPO, Dr.GRPO and BNPO. Pure torch, no verl import.

All functions take one scalar score per sequence ([B]) and group labels ([B], equal label = same
prompt) and return one advantage per sequence ([B]); engines broadcast it over response tokens.
"""

from __future__ import annotations

import math

import torch

from verl_ext.algos.importance import dense_group_index


def _group_mean_std(scores: torch.Tensor, index: torch.Tensor, num_groups: int):
    """Per-group mean and unbiased std (std 0 for singleton groups), both gathered back to [B]."""
    ones = torch.ones_like(scores)
    count = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add(0, index, ones)
    total = torch.zeros_like(count).index_add(0, index, scores)
    mean = total / count
    centred = scores - mean[index]
    sq = torch.zeros_like(count).index_add(0, index, centred.square())
    std = torch.sqrt(sq / (count - 1).clamp(min=1.0))
    return mean[index], std[index], count[index]


def group_normalized_advantages(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """GRPO's A_i = (r_i - mean_g r) / (std_g r + epsilon); Dr.GRPO's A_i = r_i - mean_g r (norm_by_std=False).

    Args:
        scores: [B] one reward per sequence.
        group_index: [B] group labels.
        norm_by_std: divide by the group's (unbiased) std, as GRPO does; Dr.GRPO does not.
        epsilon: added to the std so groups whose rewards all tie give 0, not NaN.

    Returns:
        [B] advantages. A singleton group gets advantage r_i (mean 0, std 1), as verl's GRPO does.
    """
    scores = scores.to(torch.float32) if not scores.is_floating_point() else scores
    index, num_groups = dense_group_index(group_index.to(scores.device))
    mean, std, count = _group_mean_std(scores, index, num_groups)
    singleton = count == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    centred = scores - mean
    if not norm_by_std:
        return centred
    std = torch.where(singleton, torch.ones_like(std), std)
    return centred / (std + epsilon)


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


def bnpo_advantages(
    scores: torch.Tensor,
    group_index: torch.Tensor,
    max_abs_advantage: float = 5.0,
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
    mean, _, _ = _group_mean_std(scores, index, num_groups)
    group_means = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_copy(0, index, mean)
    alpha, beta = bnpo_normalization_params(group_means)
    density = beta_pdf(mean.clamp(mean_clip, 1.0 - mean_clip), alpha, beta)
    adv = (scores - mean) / density
    return adv.clamp(-max_abs_advantage, max_abs_advantage)
