"""Policy-gradient loss terms for GEPO and the baselines verl lacks. Pure torch, no verl import.

Each ``*_loss_terms`` function returns :class:`LossTerms`: a per-token loss matrix [B, T] that an
engine aggregates (verl's ``agg_loss`` modes), plus the importance weights and clip mask it used,
for metrics. The functions know nothing about configs, micro-batches or engines; the adapters in
``verl_ext.verl_losses`` read verl's config and call them.

Notation: ``log_p`` [B, T] learner token log-probs (with gradient), ``log_q`` [B, T] sampler token
log-probs (the distribution the rollout was drawn from), ``advantages`` [B, T] (a sequence's
advantage repeated over its tokens for outcome rewards), ``response_mask`` [B, T].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_ext.algos import importance as iw

# exp() of a log-weight beyond this overflows float32 in the surrogate. With A > 0 the clip
# discards such weights anyway; with A < 0 (no dual clip) the loss is capped at |A| e^20 and its
# gradient vanishes there -- the same choice as verl's gspo (which clamps the log-ratio at 10).
LOG_WEIGHT_CLAMP = 20.0


@dataclass
class LossTerms:
    """What a loss computed, before aggregation.

    Attributes:
        loss_mat: [B, T] per-token loss (to be masked and aggregated by the engine).
        weight: importance weights the loss used, detached: [B] for sequence-level losses,
            [B, T] for token-level ones.
        clipped: [B, T] bool, True where the clipped branch of the surrogate was active.
    """

    loss_mat: torch.Tensor
    weight: torch.Tensor
    clipped: torch.Tensor


def clipped_surrogate(
    log_weight: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's pessimistic clipped surrogate max(-A w, -A clip(w, 1 - low, 1 + high)).

    Args:
        log_weight: [B] (sequence-level, broadcast over tokens) or [B, T] log importance weights.
        advantages: [B, T].

    Returns:
        (loss_mat [B, T], weight (shape of log_weight, detached), clipped [B, T] bool).
    """
    if log_weight.dim() == 1:
        log_weight = log_weight.unsqueeze(-1)
    weight = torch.exp(log_weight.clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP))
    unclipped = -advantages * weight
    clipped_loss = -advantages * weight.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped_loss)
    clipped = (clipped_loss > unclipped).expand_as(advantages)
    return loss_mat, weight.detach().squeeze(-1), clipped


def gepo_loss_terms(
    log_p: torch.Tensor,
    log_q: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    group_index: torch.Tensor | None = None,
    log_denominator: torch.Tensor | None = None,
    reduction: iw.SequenceReduction = "mean",
) -> LossTerms:
    """GEPO: the clipped surrogate with the group-expectation weight w_i = p_i / E_q[q].

    E_q[q] = sum_j q_j^2 / sum_j q_j over the G responses of sequence i's prompt; gradient flows
    through p_i only. Pass ``log_denominator`` [B] computed upstream over whole groups (exact
    whatever the micro-batching), or ``group_index`` [B] when the batch holds whole groups.
    """
    log_weight = iw.group_expectation_log_weight(
        log_p, log_q, response_mask, group_index=group_index, log_denominator=log_denominator, reduction=reduction
    )
    return LossTerms(*clipped_surrogate(log_weight, advantages, clip_low, clip_high))


def eqp_loss_terms(
    log_p: torch.Tensor,
    log_q: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    group_index: torch.Tensor,
    reduction: iw.SequenceReduction = "mean",
) -> LossTerms:
    """EqP: w_i = p_i / sum_j qhat_j p_j with qhat_j = q_j / sum_k q_k over i's group.

    Unlike GEPO the denominator is an expectation of the *learner's* probabilities under the
    group's normalised sampler probabilities, and gradient flows through it too -- so the whole
    group must be in the batch (``group_index`` is required).
    """
    index, num_groups = iw.dense_group_index(group_index.to(log_p.device))
    seq_log_p = iw.sequence_log_prob(log_p, response_mask, reduction)
    seq_log_q = iw.sequence_log_prob(log_q.detach(), response_mask, reduction)
    log_q_hat = seq_log_q - iw.segment_logsumexp(seq_log_q, index, num_groups)[index]
    log_denominator = iw.segment_logsumexp(log_q_hat + seq_log_p, index, num_groups)[index]
    return LossTerms(*clipped_surrogate(seq_log_p - log_denominator, advantages, clip_low, clip_high))


def gepo_adaptive_loss_terms(
    log_p: torch.Tensor,
    log_q: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    kl_threshold: float,
    group_index: torch.Tensor | None = None,
    log_denominator: torch.Tensor | None = None,
    reduction: iw.SequenceReduction = "mean",
) -> LossTerms:
    """GEPO-adaptive (the reference code's "gepo+"): per sequence, q_i if fresh, E_q[q] if stale.

    A sequence whose token-mean KL(sampler || learner) (k3, learner detached) is below
    ``kl_threshold`` uses the sequence weight p_i / q_i (GSPO's); otherwise GEPO's p_i / E_q[q].
    """
    seq_log_q = iw.sequence_log_prob(log_q.detach(), response_mask, reduction)
    if log_denominator is None:
        if group_index is None:
            raise ValueError("gepo_adaptive needs group_index or log_denominator")
        log_denominator = iw.group_expectation_log_denominator(seq_log_q, group_index)
    seq_kl = iw.sequence_log_prob(iw.k3_sampler_learner_kl(log_p.detach(), log_q), response_mask, "mean")
    log_den = torch.where(seq_kl < kl_threshold, seq_log_q, log_denominator.detach())
    log_weight = iw.sequence_log_prob(log_p, response_mask, reduction) - log_den
    return LossTerms(*clipped_surrogate(log_weight, advantages, clip_low, clip_high))


def gepo_tr_loss_terms(
    log_p: torch.Tensor,
    log_q: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    group_index: torch.Tensor | None = None,
    log_denominator: torch.Tensor | None = None,
    reduction: iw.SequenceReduction = "mean",
) -> LossTerms:
    """GEPO-TR: GEPO's group-expectation gradient inside PPO's trust region on p_i / q_i.

    GEPO clips w_i = p_i / E_q[q] against a per-group constant, so it bounds nothing about how
    far p has moved from the q that drew the sample. Here the clip decision is PPO's on the
    sequence ratio r_i = p_i / q_i, and the detached group factor c_i = q_i / E_q[q] scales it:

        loss_i = c_i * max(-A r_i, -A clip(r_i, 1 - low, 1 + high)),   c_i = sg(q_i / E_q[q])

    Inside the trust region the gradient is -A (p_i / E_q[q]) grad log p_i, exactly GEPO's; once
    r_i leaves the band in the advantage's direction the sequence gives no gradient. c_i lies in
    (0, G] (q_i / E_q[q] <= sum_j q_j / max_j q_j). ``weight`` reports c_i r_i = p_i / E_q[q].
    """
    seq_log_q = iw.sequence_log_prob(log_q.detach(), response_mask, reduction)
    if log_denominator is None:
        if group_index is None:
            raise ValueError("gepo_tr needs group_index or log_denominator")
        log_denominator = iw.group_expectation_log_denominator(seq_log_q, group_index)
    seq_log_ratio = iw.sequence_log_prob(log_p, response_mask, reduction) - seq_log_q
    loss_mat, ratio, clipped = clipped_surrogate(seq_log_ratio, advantages, clip_low, clip_high)
    group_factor = torch.exp(seq_log_q - log_denominator.detach())
    return LossTerms(group_factor.unsqueeze(-1) * loss_mat, group_factor * ratio, clipped)


def topr_loss_terms(
    log_p: torch.Tensor,
    log_q: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    reduction: iw.SequenceReduction = "sum",
) -> LossTerms:
    """TOPR (Tapered Off-Policy REINFORCE, Le Roux et al. 2025).

    loss_it = -w_i A_it log p_it with w_i = 1 for A_i >= 0 (positive examples are taken as they
    are, like SFT) and w_i = sg(min(p_i / q_i, 1)) for A_i < 0 (negative examples truncated to
    [0, 1] so an unlikely-under-p sample cannot dominate). p_i / q_i is the full trajectory ratio
    (reduction="sum") as in the paper; "mean" uses the length-normalised one.
    """
    seq_log_ratio = iw.sequence_log_weight(log_p.detach(), log_q, response_mask, reduction)
    seq_adv = iw.sequence_log_prob(advantages, response_mask, "mean")
    truncated = torch.exp(seq_log_ratio.clamp(max=0.0))
    weight = torch.where(seq_adv >= 0, torch.ones_like(truncated), truncated)
    loss_mat = -weight.unsqueeze(-1) * advantages * log_p
    clipped = ((seq_adv < 0) & (seq_log_ratio > 0)).unsqueeze(-1).expand_as(advantages)
    return LossTerms(loss_mat, weight.detach(), clipped)


def token_clipped_loss_terms(
    log_p: torch.Tensor,
    log_q: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> LossTerms:
    """GRPO's token-level clipped surrogate with w_it = p_it / q_it (no dual clip)."""
    return LossTerms(*clipped_surrogate(iw.token_log_weight(log_p, log_q), advantages, clip_low, clip_high))


def delta_l_sequence_weights(response_mask: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Delta-L normalisation's per-sequence weights x_i = L_i^-alpha / sum_j L_j^-alpha: [B, T] -> [B].

    L_i is the response length. alpha = 1 gives the minimum-variance unbiased combination (the
    paper's theory); the paper uses 0.75 for math. Empty responses get weight 0. float64.
    """
    if alpha < 0:
        raise ValueError(f"delta_l alpha must be >= 0, got {alpha}")
    lengths = response_mask.to(torch.float64).sum(dim=-1)
    inv = torch.where(lengths > 0, lengths.clamp(min=1.0).pow(-alpha), torch.zeros_like(lengths))
    total = inv.sum()
    return inv / total if total > 0 else torch.zeros_like(inv)


def delta_l_aggregate(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    alpha: float,
    max_length: int | None = None,
    global_batch_size: int | None = None,
    dp_size: int = 1,
) -> torch.Tensor:
    """Delta-L's unbiased, length-aware aggregation: (1 / M) sum_i x_i sum_t loss_it. -> scalar.

    M (``max_length``, default T) is a constant, as in Dr.GRPO, so the gradient scale does not
    depend on the batch's lengths. When the loss sees one micro-batch of a larger batch
    (``global_batch_size``, ``dp_size`` as in verl's ``agg_loss``), each micro-batch is weighted
    by its share of the global batch, so summing micro-batch losses keeps the whole-batch scale;
    the weights x_i are then normalised within the micro-batch (exact when every micro-batch has
    the same mean L^-alpha, an approximation otherwise).
    """
    x = delta_l_sequence_weights(response_mask, alpha).to(loss_mat.dtype)
    per_seq = (loss_mat * response_mask.to(loss_mat.dtype)).sum(dim=-1)
    m = max_length if max_length is not None else response_mask.shape[-1]
    loss = (x * per_seq).sum() / m
    if global_batch_size is not None:
        local = int((response_mask.sum(dim=-1) > 0).sum())
        loss = loss * local / global_batch_size * dp_size
    return loss
