"""Policy-gradient loss terms for GEPO and the baselines verl lacks. Pure torch, no verl import.

Each ``*_loss_terms`` function returns :class:`LossTerms`: a per-token loss matrix [B, T] that an
engine aggregates (verl's ``agg_loss`` modes), plus the importance weights and clip mask it used,
for metrics. The functions know nothing about configs, micro-batches or engines; the adapters in
``verl_ext.algos.registry`` read verl's config and call them.

Notation: ``log_p`` [B, T] learner token log-probs (with gradient), ``log_q`` [B, T] sampler token
log-probs (the distribution the rollout was drawn from), ``advantages`` [B, T] (a sequence's
advantage repeated over its tokens for outcome rewards), ``response_mask`` [B, T].
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
        metrics: scalars of this loss's own, under their full metric names (e.g. M2PO's masked
            share), reported beside the shared ones by every engine.
    """

    loss_mat: torch.Tensor
    weight: torch.Tensor
    clipped: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


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
    index, num_groups = iw.segment_group_index(group_index.to(log_p.device))
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
    log_denominator = iw.resolve_log_denominator(seq_log_q, group_index, log_denominator, "gepo_adaptive")
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
    log_denominator = iw.resolve_log_denominator(seq_log_q, group_index, log_denominator, "gepo_tr")
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
    seq_log_ratio = iw.sequence_log_weight(log_p.detach(), log_q.detach(), response_mask, reduction)
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


def m2po_keep_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO's second-moment mask: drop the tokens with the largest squared log-ratio until the mean
    of the remaining ones' squared log-ratio is below ``threshold``. [B, T] -> [B, T] bool (True = kept).

    Greedy largest-first is the fewest tokens that bring the mean under the threshold. The mean is
    over the remaining tokens (a suffix mean of the sorted values); strict "<" and, when no suffix
    qualifies, only the smallest token kept -- as AReaL's implementation of the paper. Computed on
    detached values in float64; tokens outside ``response_mask`` stay False.
    """
    mask = response_mask.bool()
    keep = torch.zeros_like(mask)
    values = log_ratio.detach().to(torch.float64)[mask].square()
    n = values.numel()
    if n == 0:
        return keep
    ordered, order = torch.sort(values, descending=True)
    # suffix_mean[k] = mean of ordered[k:], the mean once the k largest are dropped
    suffix_sum = torch.flip(torch.cumsum(torch.flip(ordered, [0]), 0), [0])
    suffix_mean = suffix_sum / torch.arange(n, 0, -1, dtype=torch.float64, device=values.device)
    below = torch.nonzero(suffix_mean < threshold)
    first_kept = int(below[0]) if below.numel() else n - 1
    kept_sorted = torch.arange(n, device=values.device) >= first_kept
    kept = torch.empty_like(kept_sorted)
    kept[order] = kept_sorted
    keep[mask] = kept
    return keep


def m2po_loss_terms(
    log_p: torch.Tensor,
    log_q: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    threshold: float,
) -> LossTerms:
    """M2PO (Zheng et al. 2025, arXiv 2510.01161): token importance sampling without a clip, with the
    tokens of most extreme log-ratio masked so that the batch's second moment mean((log p/q)^2) stays
    under ``threshold`` (the paper: 0.04).

    loss_it = -M_it r_it A_it,  r_it = p_it / q_it (gradient through r),  M = :func:`m2po_keep_mask`.

    The mask is taken over the tokens this call sees (the embedded engine: the whole batch; verl's
    engine: each micro-batch, as AReaL does). ``clipped`` marks the masked tokens; ``weight`` is r;
    ``actor/m2po_masked_frac`` is the masked share of the response tokens.
    """
    log_ratio = iw.token_log_weight(log_p, log_q).clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)
    keep = m2po_keep_mask(log_ratio, response_mask, threshold)
    ratio = torch.exp(log_ratio)
    loss_mat = torch.where(keep, -advantages * ratio, torch.zeros_like(ratio))
    masked = response_mask.bool() & ~keep
    masked_frac = (masked.sum() / response_mask.bool().sum().clamp(min=1)).item()
    return LossTerms(loss_mat, ratio.detach(), masked, {"actor/m2po_masked_frac": masked_frac})


def vespo_log_coefficient(log_w: torch.Tensor, k: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """log phi(W) for VESPO's kernel phi(W) = W^k exp(lam (1 - W)) (phi(1) = 1), from log W. [B] -> [B]."""
    return lam + k * log_w - lam * torch.exp(log_w)


def vespo_loss_terms(
    log_p: torch.Tensor,
    log_q: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
) -> LossTerms:
    """VESPO (Shen et al. 2026, arXiv 2602.10693): REINFORCE on every token with the sequence's
    coefficient phi(W_i), W_i = p(y_i) / q(y_i) the full-sequence ratio (no length normalisation):

        loss_it = -sg(phi(W_i)) A_it log p_it,   phi(W) = W^k exp(lam (1 - W)),

    (k, lam) = (k_pos, lambda_pos) for A_i >= 0, (k_neg, lambda_neg) for A_i < 0 (the authors'
    code: (2, 3) and (3, 2)). phi is the coefficient on grad log p (= W f'(W) of the paper's
    reshaping kernel f); phi(1) = 1, phi -> 0 as W -> 0 or infinity. log W is clamped to +-20 as in
    the authors' code; computed in log space. ``weight`` reports phi [B]; ``clipped`` marks the
    tokens of sequences whose phi underflowed to 0.
    """
    token_log_ratio = (log_p.detach() - log_q.detach()).clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)
    log_w = iw.sequence_log_prob(token_log_ratio, response_mask, "sum").clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)
    seq_adv = iw.sequence_log_prob(advantages.detach(), response_mask, "mean")
    positive = seq_adv >= 0
    k = torch.where(positive, torch.full_like(log_w, k_pos), torch.full_like(log_w, k_neg))
    lam = torch.where(positive, torch.full_like(log_w, lambda_pos), torch.full_like(log_w, lambda_neg))
    phi = torch.exp(vespo_log_coefficient(log_w, k, lam))
    phi = torch.nan_to_num(phi, nan=0.0, posinf=0.0)
    loss_mat = -phi.unsqueeze(-1) * advantages * log_p
    clipped = (phi == 0).unsqueeze(-1).expand_as(advantages) & response_mask.bool()
    return LossTerms(loss_mat, phi.detach(), clipped)


def gepo_token_clip_loss_terms(
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
    ess_bound: bool = False,
) -> LossTerms:
    """GEPO-TC: GEPO's group weight w_i = p_i / E_q[q] under GRPO's token-level clip on p_it / q_it.

    Each token carries GEPO's weight, and its gradient is removed where PPO's token clip would act
    (A > 0 and r_it > 1 + high, or A < 0 and r_it < 1 - low; r_it = p_it / q_it):

        loss_it = -A_it sg(w_i) rho_it,   rho_it = exp(log p_it - sg(log p_it)) if kept, 1 if clipped,

    so its value is -A w_i and d loss / d log p_it = -A w_i on kept tokens, 0 on clipped ones: with
    ``reduction="mean"`` and token-mean aggregation, GEPO's gradient -A w_i (1/L) sum_t grad log p_it
    restricted to the tokens GRPO's clip keeps. On-policy (r = 1) nothing is clipped; under
    staleness the clip stops pushing down a wrong answer's tokens that p already made less likely
    than q did (GRPO's protection), which GEPO's sequence clip on p_i / E_q[q] does not track.

    ``ess_bound``: the clip band shrinks with the measured divergence of the batch,
    (low, high) x ESS, ESS = (sum r)^2 / (n sum r^2) over the response tokens' r_it (detached;
    1 on-policy, smaller the further p has moved from q) -- GEPO-TC-ESS; the factor is reported as
    ``actor/tc_band_scale``.
    """
    log_weight = iw.group_expectation_log_weight(
        log_p, log_q, response_mask, group_index=group_index, log_denominator=log_denominator, reduction=reduction
    )
    mask = response_mask.bool()
    token_log_ratio = iw.token_log_weight(log_p.detach(), log_q).clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)
    ratio = torch.exp(token_log_ratio)
    metrics = {}
    if ess_bound:
        ess = iw.normalised_ess(ratio[mask])
        clip_low, clip_high = clip_low * ess, clip_high * ess
        metrics["actor/tc_band_scale"] = float(ess)
    clipped = ((advantages > 0) & (ratio > 1.0 + clip_high)) | ((advantages < 0) & (ratio < 1.0 - clip_low))
    clipped = clipped & mask
    weight = torch.exp(log_weight.detach().clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP))
    rho = torch.where(clipped, torch.ones_like(log_p), torch.exp(log_p - log_p.detach()))
    loss_mat = -advantages * weight.unsqueeze(-1) * rho
    return LossTerms(loss_mat, weight, clipped, metrics)
