"""The group-expectation losses traced whole by ``torch.compile``: the same maths as
:mod:`verl_ext.algos.losses` (the eager functions themselves are traced), one graph per loss.

Eager GEPO launches many small kernels. Here the group statistics use B segment slots, each
sequence's group named by its first row, and masked reductions over (group, sequence) pairs instead
of scatters (:func:`verl_ext.algos.importance.segment_group_index`, ``segment_logsumexp``): O(B^2)
work on [B] values, no sort, no atomics, no host read, so a loss's forward and backward trace with
``fullgraph=True`` and one graph serves every group count of a batch size. Only difference from the
eager functions: GEPO-TC-ESS's normalised ESS of p_it / q_it is computed in the graph
(:func:`token_ratio_ess`, float64) and read to the host once, after it, for ``actor/tc_band_scale``.
Selected by ``actor_rollout_ref.actor.policy_loss.compile=true`` (:data:`COMPILABLE_LOSS_TERMS`);
equal to the eager losses within float32 rounding (tests/algos/test_compiled_losses.py). Why and
what it gains: docs/benchmarks.md, "The compiled loss path".
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from verl_ext.algos import importance as iw
from verl_ext.algos import losses

#: loss_mode -> the eager loss-terms function the compiled path traces
COMPILABLE_LOSS_TERMS: dict[str, Callable[..., losses.LossTerms]] = {
    "gepo": losses.gepo_loss_terms,
    "eqp": losses.eqp_loss_terms,
    "gepo_adaptive": losses.gepo_adaptive_loss_terms,
    "gepo_tr": losses.gepo_tr_loss_terms,
    "gepo_tc": losses.gepo_token_clip_loss_terms,
}


def token_ratio_ess(log_p: torch.Tensor, log_q: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """:func:`verl_ext.algos.importance.normalised_ess` of the response tokens' r_it = p_it / q_it
    (learner detached, log-ratio clamped as GEPO-TC clamps it), as a 0-d float64 tensor and without
    boolean indexing or a host read, so it stays in a compiled graph: 1 with no response token,
    0 when every weight is 0."""
    log_ratio = iw.token_log_weight(log_p.detach(), log_q).clamp(-losses.LOG_WEIGHT_CLAMP, losses.LOG_WEIGHT_CLAMP)
    mask = response_mask.bool()
    w = torch.where(mask, torch.exp(log_ratio).to(torch.float64), 0.0)
    n = mask.sum().to(torch.float64)
    sum_sq = w.square().sum()
    positive = sum_sq > 0
    ess = torch.where(positive, w.sum().square() / torch.where(positive, n * sum_sq, 1.0), 0.0)
    return torch.where(n > 0, ess, 1.0)


def traceable_loss_terms(
    loss_mode: str,
    log_p: torch.Tensor,
    log_q: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``COMPILABLE_LOSS_TERMS[loss_mode](log_p, log_q, advantages, response_mask, **options)`` with
    no host read: (loss_mat, weight, clipped, band scale) -- the band scale is GEPO-TC-ESS's ESS
    factor (0-d tensor) when ``ess_bound`` is set, else None; the loss's other metrics are none."""
    terms_fn = COMPILABLE_LOSS_TERMS[loss_mode]
    band_scale = None
    if options.get("ess_bound", False):
        band_scale = token_ratio_ess(log_p, log_q, response_mask)
        options = dict(
            options,
            ess_bound=False,
            clip_low=options["clip_low"] * band_scale,
            clip_high=options["clip_high"] * band_scale,
        )
    terms = terms_fn(log_p, log_q, advantages, response_mask, **options)
    return terms.loss_mat, terms.weight, terms.clipped, band_scale


@functools.lru_cache(maxsize=None)
def compiled_loss_terms(
    loss_mode: str, backend: str = "inductor", mode: Optional[str] = None, dynamic: Optional[bool] = None
) -> Callable[..., losses.LossTerms]:
    """The loss-terms function of ``loss_mode`` (a key of :data:`COMPILABLE_LOSS_TERMS`), same
    arguments and :class:`~verl_ext.algos.losses.LossTerms`, run as one ``torch.compile(fullgraph=True)``
    graph. ``backend`` / ``mode`` / ``dynamic`` go to ``torch.compile`` (``dynamic=None``: static
    shapes first, a symbolic batch size after the first change, so varying micro-batches do not
    recompile each time). One compiled function per argument set, shared by every caller."""
    if loss_mode not in COMPILABLE_LOSS_TERMS:
        raise ValueError(
            f"loss_mode={loss_mode!r} has no compiled path; the compiled losses are {sorted(COMPILABLE_LOSS_TERMS)}"
        )

    def traced(log_p, log_q, advantages, response_mask, **options):
        return traceable_loss_terms(loss_mode, log_p, log_q, advantages, response_mask, **options)

    compiled = torch.compile(traced, fullgraph=True, backend=backend, mode=mode, dynamic=dynamic)

    def terms(
        log_p: torch.Tensor, log_q: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, **options: Any
    ) -> losses.LossTerms:
        loss_mat, weight, clipped, band_scale = compiled(log_p, log_q, advantages, response_mask, **options)
        metrics = {} if band_scale is None else {"actor/tc_band_scale": float(band_scale)}
        return losses.LossTerms(loss_mat, weight, clipped, metrics)

    terms.__name__ = terms.__qualname__ = f"compiled_{COMPILABLE_LOSS_TERMS[loss_mode].__name__}"
    terms.__doc__ = f"torch.compile'd :func:`verl_ext.algos.losses.{COMPILABLE_LOSS_TERMS[loss_mode].__name__}`."
    return terms
