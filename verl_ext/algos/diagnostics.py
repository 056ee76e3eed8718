"""Per-batch diagnostics of importance weights and sampler-learner divergence (metric dicts).

Metric names are fixed (``is/*``) so both engines and every loss log the same keys.
"""

from __future__ import annotations

import torch

from verl_ext.algos import importance as iw


def _masked_values(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """The entries of a [B] (sequence-level) or [B, T] (token-level) tensor that count."""
    mask = response_mask.bool()
    if values.dim() == 1:
        return values[mask.any(dim=-1)]
    return values[mask]


def importance_weight_stats(weight: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """Mean, min, max, (population) variance and normalised effective sample size of the weights.

    Args:
        weight: [B] sequence-level or [B, T] token-level importance weights.
        response_mask: [B, T].

    Returns:
        ``is/weight_mean``, ``is/weight_min``, ``is/weight_max``, ``is/weight_var``, ``is/ess``
        (ESS / n = (sum w)^2 / (n sum w^2), 1 when all weights are equal).
    """
    w = _masked_values(weight.detach().to(torch.float64), response_mask)
    if w.numel() == 0:
        return {}
    return {
        "is/weight_mean": w.mean().item(),
        "is/weight_min": w.min().item(),
        "is/weight_max": w.max().item(),
        "is/weight_var": w.var(unbiased=False).item(),
        "is/ess": iw.normalised_ess(w),
    }


def sequence_sampler_learner_kl(log_p: torch.Tensor, log_q: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """KL(sampler || learner) per sequence: k3 per token, mean over the sequence's response tokens.
    (B, T) x3 -> [B] (0 for a sequence without tokens)."""
    kl = iw.k3_sampler_learner_kl(log_p.detach(), log_q.detach())
    return iw.sequence_log_prob(kl, response_mask, "mean")


def sampler_learner_kl(log_p: torch.Tensor, log_q: torch.Tensor, response_mask: torch.Tensor) -> float:
    """KL(sampler || learner) per token, k3 estimator, token-mean per sequence then mean over sequences."""
    seq_kl = sequence_sampler_learner_kl(log_p, log_q, response_mask)
    has_tokens = response_mask.bool().any(dim=-1)
    return seq_kl[has_tokens].mean().item() if bool(has_tokens.any()) else 0.0
