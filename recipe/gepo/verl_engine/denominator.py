"""GEPO's denominator, computed on the driver over whole prompt groups.

verl's worker-side loss sees micro-batches cut after shuffling and data-parallel splitting, so a
prompt group can be split across them. GEPO's denominator log E_q[q] depends only on the detached
sampler probabilities, so the driver computes it exactly over each whole group (verl's ``uid``)
before the update and ships it as one number per sequence (``group_log_denominator`` [B]); the
loss bridge (:mod:`recipe.gepo.verl_engine.loss`) hands it to the loss.

The maths is :func:`verl_ext.algos.importance.group_expectation_log_denominator`; this module only
turns verl's batch layouts (uid object arrays, nested TransferQueue tensors) into its inputs.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from verl_ext.algos import importance as iw
from verl_ext.group_index import uid_group_index  # noqa: F401 -- also this module's API

GROUP_LOG_DENOMINATOR = "group_log_denominator"
"""Name of the per-sequence field [B] that carries log E_q[q] from the driver to the loss."""


def group_log_denominator(
    old_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    uids: Sequence[Any] | np.ndarray,
    reduction: str = "mean",
) -> torch.Tensor:
    """log E_q[q] for every sequence, over its whole prompt group.

    Args:
        old_log_probs: [B, T] sampler token log-probs (what the loss will use as q).
        response_mask: [B, T] 1/True on response tokens.
        uids: [B] prompt group ids (verl's ``uid``), in any order.
        reduction: sequence log-prob reduction, ``policy_loss.seq_reduction`` ("mean" or "sum").

    Returns:
        [B] float tensor (dtype of ``old_log_probs``), detached.
    """
    if old_log_probs.dim() != 2 or old_log_probs.shape != response_mask.shape:
        raise ValueError(
            f"old_log_probs {tuple(old_log_probs.shape)} and response_mask {tuple(response_mask.shape)} "
            "must both be [B, T]"
        )
    index = uid_group_index(uids)
    if index.shape[0] != old_log_probs.shape[0]:
        raise ValueError(f"{index.shape[0]} uids for a batch of {old_log_probs.shape[0]} sequences")
    with torch.no_grad():
        seq_log_q = iw.sequence_log_prob(old_log_probs.detach(), response_mask, reduction)
        return iw.group_expectation_log_denominator(seq_log_q, index.to(seq_log_q.device))


def add_to_dataproto(data: Any, reduction: str = "mean") -> torch.Tensor:
    """Write ``group_log_denominator`` [B] into a verl ``DataProto`` (from ``old_log_probs``,
    ``response_mask`` and ``non_tensor_batch["uid"]``) and return it."""
    den = group_log_denominator(
        data.batch["old_log_probs"], data.batch["response_mask"], data.non_tensor_batch["uid"], reduction
    )
    data.batch[GROUP_LOG_DENOMINATOR] = den
    return den


def from_tensordict(td: Any, reduction: str = "mean", padding: Sequence[bool] | None = None) -> torch.Tensor:
    """The same from the TensorDict that verl's v1 trainer reads out of TransferQueue
    (``old_log_probs`` / ``response_mask`` nested or padded, ``uid`` a NonTensorStack).

    ``padding`` [B] marks the copies verl adds to balance data-parallel ranks (tag
    ``is_padding``): they share a real uid but must not enter its group's E_q[q], so each
    gets a group of its own."""
    padded = td.select("old_log_probs", "response_mask")
    if any(padded[k].is_nested for k in ("old_log_probs", "response_mask")):
        padded = padded.to_padded_tensor()
    uid = td["uid"]
    uids = [str(u) for u in (uid.tolist() if hasattr(uid, "tolist") else list(uid))]
    if padding is not None:
        if len(padding) != len(uids):
            raise ValueError(f"padding has {len(padding)} entries for {len(uids)} sequences")
        uids = [f"{u}\x00padding{i}" if pad else u for i, (u, pad) in enumerate(zip(uids, padding))]
    return group_log_denominator(padded["old_log_probs"], padded["response_mask"], uids, reduction)
