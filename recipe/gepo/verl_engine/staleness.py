"""The exact staleness bound over weight versions, for verl's v1 replay buffer.

verl's replay buffer measures off-policy-ness by the learner step at which a prompt was
*submitted* (``max_off_policy_threshold``). With delayed weight sync a sampler may start a prompt
on weights many versions older than that step, so the verl engine also bounds the version of the
weights that actually generated each trajectory (verl records it per trajectory as
``min_global_steps``): the learner at version v (``global_steps - 1``) trains only on prompt
groups all of whose trajectories were generated from versions >= v - ``hetero.max_delay``.
Groups past the bound are evicted (counted by verl's eviction metrics) under both
``stale_policy=drop`` and ``wait``: ``wait`` additionally makes verl's buffer hold sampling until
in-flight prompts near the bound have finished, but never relaxes the bound.
"""

from __future__ import annotations

from typing import Any, Mapping

from verl_ext.hetero.staleness import check_max_delay, is_stale, oldest_versions, staleness_metrics


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
    oldest = group_weight_versions(
        {str(key): tag for key, tag in zip(keys, tags) if not tag.get("is_padding", False)}
    )
    out = staleness_metrics([global_steps - 1 - v for v in oldest.values()], max_delay)
    out.update({"hetero/dropped": float(evicted_stale), "hetero/dropped/stale": float(evicted_stale)})
    return out
