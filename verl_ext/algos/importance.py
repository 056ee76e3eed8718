"""Importance weights at token, sequence and group-expectation level.

Pure torch, no verl import. Notation (the GEPO paper's): q is the sampler's policy (the one that
generated the rollout, possibly many versions old), p the learner's current policy. Shapes:
B sequences, T response tokens; ``response_mask`` is 1 (or True) on real response tokens.

Everything is computed in log space: full-sequence probabilities of long completions underflow
float32 (and float64) long before their log-probabilities stop being finite.
"""

from __future__ import annotations

from typing import Literal

import torch

SequenceReduction = Literal["mean", "sum"]


def sequence_log_prob(
    token_log_prob: torch.Tensor, response_mask: torch.Tensor, reduction: SequenceReduction = "mean"
) -> torch.Tensor:
    """Per-sequence log-probability from per-token log-probabilities.

    Args:
        token_log_prob: [B, T] log pi(y_t | x, y_<t).
        response_mask: [B, T] 1/True on response tokens.
        reduction: ``"mean"``: mean over the sequence's tokens, i.e. the log of the
            length-normalised geometric mean (GSPO's and the GEPO code's choice);
            ``"sum"``: the full sequence log-probability log pi(y | x).

    Returns:
        [B] sequence log-probabilities. A fully masked row gives 0 (probability 1 of an empty
        response), never NaN.
    """
    mask = response_mask.to(token_log_prob.dtype)
    total = (token_log_prob * mask).sum(dim=-1)
    if reduction == "sum":
        return total
    if reduction == "mean":
        return total / mask.sum(dim=-1).clamp(min=1.0)
    raise ValueError(f"sequence reduction must be 'mean' or 'sum', got {reduction!r}")


def dense_group_index(group_index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary group labels [B] (e.g. hashed prompt uids) to 0..G-1; returns (index [B], G)."""
    if group_index.dim() != 1:
        raise ValueError(f"group_index must be 1-D [B], got shape {tuple(group_index.shape)}")
    _, inverse = torch.unique(group_index, return_inverse=True)
    return inverse, int(inverse.max().item()) + 1 if inverse.numel() else 0


def leader_group_index(group_index: torch.Tensor) -> torch.Tensor:
    """Group labels [B] as each sequence's group's first row (in 0..B-1; equal label = same prompt,
    as for :func:`dense_group_index`, whose labels these are not), by comparing every pair of
    labels: O(B^2) work, but shapes fixed by B, no sort and no read of G to the host -- what one
    compiled graph can hold (``torch.unique`` has a data-dependent size, and reading G back breaks
    the graph), and a single reduction there."""
    if group_index.dim() != 1:
        raise ValueError(f"group_index must be 1-D [B], got shape {tuple(group_index.shape)}")
    n = group_index.shape[0]
    rows = torch.arange(n, device=group_index.device)
    same = group_index.unsqueeze(0) == group_index.unsqueeze(1)
    return torch.where(same, rows.unsqueeze(0), n).amin(dim=1)


def segment_group_index(group_index: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Labels [B] and a number of segments for :func:`segment_logsumexp`: (index, G) from
    :func:`dense_group_index` in eager mode; under ``torch.compile`` (index, B) from
    :func:`leader_group_index` -- B slots bound the G groups, the slots no group leads stay empty and
    are never gathered, so every group's value is the same and one graph serves every group count."""
    if torch.compiler.is_compiling():
        return leader_group_index(group_index), group_index.shape[0]
    return dense_group_index(group_index)


def contiguous_group_index(batch_size: int, group_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Group labels [B] for a batch laid out as whole prompt groups of ``group_size`` in a row, made
    on ``device`` (the batch's; None: torch's default device).

    Raises:
        ValueError: if the batch cannot be split into whole groups -- computing a group statistic
            over a partial group would silently mix prompts or drop responses.
    """
    if group_size < 1:
        raise ValueError(
            f"group_size must be >= 1 to form prompt groups, got {group_size}; set "
            "actor_rollout_ref.actor.policy_loss.group_size to rollout.n or pass per-sequence denominators"
        )
    if batch_size % group_size != 0:
        raise ValueError(
            f"batch of {batch_size} sequences cannot be split into whole prompt groups of "
            f"group_size={group_size}; make micro-batches a multiple of rollout.n, or compute the "
            "group denominators upstream over whole groups"
        )
    return torch.arange(batch_size, device=device) // group_size


def segment_logsumexp(values: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """log(sum_{j in g} exp(values_j)) for each group g. values [B], group_index [B] in 0..G-1 -> [G].

    Exact and finite for values down to -1e4 (the per-group max is subtracted before exp).
    Under ``torch.compile``: the same sums as masked reductions over [G, B] pairs (no scatter, no
    atomics; fused into two reductions by inductor), for the B slots of :func:`segment_group_index`.
    """
    if torch.compiler.is_compiling():
        return _pairwise_segment_logsumexp(values, group_index, num_groups)
    neg_inf = torch.full((num_groups,), float("-inf"), dtype=values.dtype, device=values.device)
    # the shift is a constant for the gradient: d/dv of log-sum-exp is the softmax whatever it is
    group_max = neg_inf.scatter_reduce(0, group_index, values.detach(), reduce="amax", include_self=True)
    shifted = torch.exp(values - group_max[group_index])
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add(0, group_index, shifted)
    return torch.log(sums) + group_max


def _pairwise_segment_logsumexp(values: torch.Tensor, group_index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """:func:`segment_logsumexp` by masked reductions over every (group, sequence) pair; an empty
    group gives -inf, and no gradient reaches a value through another group's exp."""
    member = group_index.unsqueeze(0) == torch.arange(num_groups, device=values.device).unsqueeze(1)
    group_max = torch.where(member, values.detach().unsqueeze(0), float("-inf")).amax(dim=1)
    shift = torch.where(torch.isfinite(group_max), group_max, 0.0).unsqueeze(1)
    # -inf off the group before exp: exp(0) of a masked entry would carry a gradient, a large one overflow
    shifted = torch.where(member, values.unsqueeze(0) - shift, float("-inf"))
    return torch.log(torch.exp(shifted).sum(dim=1)) + shift.squeeze(1)


def group_expectation_log_denominator(seq_log_q: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """GEPO's denominator log E_q[q], estimated over each sequence's prompt group.

    For sequence i in group g: log( sum_{j in g} q_j^2 / sum_{j in g} q_j ), computed as
    logsumexp_j(2 log q_j) - logsumexp_j(log q_j).

    Args:
        seq_log_q: [B] sampler sequence log-probabilities (see :func:`sequence_log_prob`).
        group_index: [B] group labels (any integers; equal label = same prompt).

    Returns:
        [B] the group's log denominator, repeated for every member. Carries gradient only if
        ``seq_log_q`` does (callers pass detached sampler log-probs).
    """
    if seq_log_q.shape != group_index.shape:
        raise ValueError(
            f"seq_log_q {tuple(seq_log_q.shape)} and group_index {tuple(group_index.shape)} must both be [B]"
        )
    index, num_groups = segment_group_index(group_index.to(seq_log_q.device))
    log_sum_sq = segment_logsumexp(2.0 * seq_log_q, index, num_groups)
    log_sum = segment_logsumexp(seq_log_q, index, num_groups)
    return (log_sum_sq - log_sum)[index]


def token_log_weight(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Token-level log importance weight log(p_t / q_t): [B, T] -> [B, T] (GRPO, PPO)."""
    return log_p - log_q


def sequence_log_weight(
    log_p: torch.Tensor,
    log_q: torch.Tensor,
    response_mask: torch.Tensor,
    reduction: SequenceReduction = "mean",
) -> torch.Tensor:
    """Sequence-level log importance weight log(p_i / q_i) (GSPO with reduction="mean"). [B, T] -> [B]."""
    return sequence_log_prob(log_p, response_mask, reduction) - sequence_log_prob(log_q, response_mask, reduction)


def group_expectation_log_weight(
    log_p: torch.Tensor,
    log_q: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: torch.Tensor | None = None,
    log_denominator: torch.Tensor | None = None,
    reduction: SequenceReduction = "mean",
) -> torch.Tensor:
    """GEPO's log importance weight log(p_i / E_q[q]) per sequence: [B, T] -> [B].

    The denominator is detached (gradient flows through p_i only, as in the paper). Give either
    ``log_denominator`` [B] (computed upstream over whole groups, the exact path when a micro-batch
    holds partial groups) or ``group_index`` [B].

    Note: on-policy (p == q) the weight is q_i / E_q[q], not 1: GEPO reweights sequences inside a
    group even with no staleness, and clipping can be active at staleness 0.
    """
    seq_log_p = sequence_log_prob(log_p, response_mask, reduction)
    if log_denominator is None:
        seq_log_q = sequence_log_prob(log_q.detach(), response_mask, reduction)
        log_denominator = resolve_log_denominator(seq_log_q, group_index, None, "group_expectation_log_weight")
    return seq_log_p - log_denominator.detach()


def resolve_log_denominator(
    seq_log_q: torch.Tensor,
    group_index: torch.Tensor | None,
    log_denominator: torch.Tensor | None,
    caller: str,
) -> torch.Tensor:
    """The one rule for where GEPO's denominator log E_q[q] comes from, [B]: ``log_denominator``
    when given (computed upstream over whole groups, exact when a micro-batch holds partial
    groups), else estimated from ``seq_log_q`` [B] over the groups of ``group_index`` [B].
    Raises ValueError naming ``caller`` when neither is given."""
    if log_denominator is not None:
        return log_denominator
    if group_index is None:
        raise ValueError(f"{caller} needs group_index or log_denominator")
    return group_expectation_log_denominator(seq_log_q, group_index)


def k3_sampler_learner_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(q || p) from tokens sampled by q: (p/q - 1) - log(p/q). [B, T] -> [B, T].

    Unbiased for KL(sampler || learner) and >= 0 everywhere.
    """
    log_ratio = (log_p - log_q).clamp(-20.0, 20.0)
    return torch.expm1(log_ratio) - log_ratio


def normalised_ess(weights: torch.Tensor) -> float:
    """Effective sample size over n, (sum w)^2 / (n sum w^2), in float64: 1 when every weight is
    equal, towards 1/n as one weight dominates; 1 for no weights, 0 when all are 0.

    Args:
        weights: any shape, the weights to pool (already masked to the valid entries).
    """
    w = weights.detach().to(torch.float64).reshape(-1)
    if w.numel() == 0:
        return 1.0
    sum_sq = w.square().sum()
    return float(w.sum() ** 2 / (w.numel() * sum_sq)) if bool(sum_sq > 0) else 0.0
