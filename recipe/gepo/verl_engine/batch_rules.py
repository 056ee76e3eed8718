"""The two per-batch rules the verl engine's driver applies to verl's batches, over whole prompt groups.

1. **The exact staleness bound over weight versions.** verl's replay buffer bounds the learner step
   at which a prompt was *submitted* (``max_off_policy_threshold``); with delayed weight sync a
   sampler may start it on much older weights, so the learner at version v (``global_steps - 1``)
   also trains only on groups all of whose trajectories came from versions >= v - ``hetero.max_delay``
   (verl's ``min_global_steps``). Groups past it are evicted (verl's eviction metrics) under both
   ``stale_policy`` values; ``wait`` also holds sampling until in-flight prompts near the bound
   finish, never relaxing it. The rule is :mod:`verl_ext.hetero.staleness`'s.
2. **GEPO's denominator.** verl's worker-side loss sees micro-batches cut after shuffling and
   data-parallel splitting, so a group can be split; log E_q[q] depends only on the detached sampler
   probabilities, so the driver computes it over each whole group (``uid``) and ships it per sequence
   (``group_log_denominator`` [B]) for :mod:`verl_ext.algos.worker_loss`. The maths is
   :func:`verl_ext.algos.importance.group_expectation_log_denominator`; this turns verl's layouts into its inputs.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from verl_ext.algos import importance as iw
from verl_ext.group_index import uid_group_index
from verl_ext.hetero.staleness import check_max_delay, is_stale, oldest_versions, staleness_metrics

# ---------------------------------------------------------------------------- the staleness bound


def group_weight_versions(trajectory_tags: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """Oldest generating weight version per prompt group.

    Args:
        trajectory_tags: verl's ``{"<uid>_<i>": tag}`` trajectory metadata, each tag with
            ``min_global_steps`` (the weight version the trajectory started on; may be None
            for a trajectory not generated yet).

    Returns:
        ``{uid: min over the group's trajectories of min_global_steps}`` (groups whose
        trajectories carry no version are left out).
    """
    return oldest_versions(
        (key.split("_")[0], tag["min_global_steps"])
        for key, tag in trajectory_tags.items()
        if tag.get("min_global_steps", None) is not None
    )


def stale_group_uids(
    trajectory_tags: Mapping[str, Mapping[str, Any]], candidate_uids: set[str], global_steps: int, max_delay: int
) -> set[str]:
    """Uids among ``candidate_uids`` whose weight-version staleness exceeds ``max_delay``.

    The learner in verl step ``global_steps`` holds weights of version ``global_steps - 1``;
    a group generated from version w is ``(global_steps - 1) - w`` versions stale.
    """
    check_max_delay(max_delay)
    learner_version = global_steps - 1
    versions = group_weight_versions(trajectory_tags)
    return {uid for uid in candidate_uids if uid in versions and is_stale(learner_version, versions[uid], max_delay)}


def verl_threshold(max_delay: int) -> int:
    """verl's ``max_off_policy_threshold`` (a span of submission steps, >= 1) implied by the bound:
    a prompt generated from version w was submitted at a step s >= w + 1, so a weight staleness
    <= max_delay implies a span ``global_steps - s + 1 <= max_delay + 1``."""
    return check_max_delay(max_delay) + 1


def hetero_step_metrics(
    keys: list[str], tags: list[Mapping[str, Any]], global_steps: int, max_delay: int, evicted_stale: float = 0.0
) -> dict[str, float]:
    """The embedded engine's ``hetero/*`` staleness metrics for one verl training batch.

    Args:
        keys: verl's trajectory keys of the batch, ``"<uid>_<session>_<i>"``.
        tags: the matching tags (``min_global_steps``, optionally ``is_padding``).
        global_steps: verl's step (the learner holds version ``global_steps - 1``).
        max_delay: the bound, for the histogram range.
        evicted_stale: groups evicted as stale this step (verl's
            ``training/off_policy/evicted_samples``).

    Returns:
        ``hetero/consumed`` (groups), ``hetero/staleness_mean|max|min`` and
        ``hetero/staleness_hist/<k>`` over groups (a group's staleness is that of its oldest
        trajectory), ``hetero/dropped`` and ``hetero/dropped/stale``.
    """
    if len(keys) != len(tags):
        raise ValueError(f"{len(keys)} keys but {len(tags)} tags")
    oldest = group_weight_versions({str(key): tag for key, tag in zip(keys, tags) if not tag.get("is_padding", False)})
    out = staleness_metrics([global_steps - 1 - v for v in oldest.values()], max_delay)
    out.update({"hetero/dropped": float(evicted_stale), "hetero/dropped/stale": float(evicted_stale)})
    return out


# ---------------------------------------------------------------------------- GEPO's denominator


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
