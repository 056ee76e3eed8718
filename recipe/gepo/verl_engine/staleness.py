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
    oldest: dict[str, int] = {}
    for key, tag in trajectory_tags.items():
        version = tag.get("min_global_steps", None)
        if version is None:
            continue
        uid = key.split("_")[0]
        oldest[uid] = min(int(version), oldest.get(uid, int(version)))
    return oldest


def stale_group_uids(
    trajectory_tags: Mapping[str, Mapping[str, Any]], candidate_uids: set[str], global_steps: int, max_delay: int
) -> set[str]:
    """Uids among ``candidate_uids`` whose weight-version staleness exceeds ``max_delay``.

    The learner in verl step ``global_steps`` holds weights of version ``global_steps - 1``;
    a group generated from version w is ``(global_steps - 1) - w`` versions stale.
    """
    if max_delay < 0:
        raise ValueError(f"hetero.max_delay={max_delay} must be >= 0")
    learner_version = global_steps - 1
    versions = group_weight_versions(trajectory_tags)
    return {uid for uid in candidate_uids if uid in versions and learner_version - versions[uid] > max_delay}


def verl_threshold(max_delay: int) -> int:
    """verl's ``max_off_policy_threshold`` (a span of submission steps, >= 1) implied by the bound:
    a prompt generated from version w was submitted at a step s >= w + 1, so a weight staleness
    <= max_delay implies a span ``global_steps - s + 1 <= max_delay + 1``."""
    if max_delay < 0:
        raise ValueError(f"hetero.max_delay={max_delay} must be >= 0")
    return max_delay + 1


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
    oldest: dict[str, int] = {}
    if len(keys) != len(tags):
        raise ValueError(f"{len(keys)} keys but {len(tags)} tags")
    for key, tag in zip(keys, tags):
        if tag.get("is_padding", False) or tag.get("min_global_steps", None) is None:
            continue
        uid, version = str(key).split("_")[0], int(tag["min_global_steps"])
        oldest[uid] = min(version, oldest.get(uid, version))
    staleness = [global_steps - 1 - v for v in oldest.values()]
    out = {
        "hetero/consumed": float(len(staleness)),
        "hetero/staleness_mean": float(sum(staleness) / len(staleness)) if staleness else 0.0,
        "hetero/staleness_max": float(max(staleness)) if staleness else 0.0,
        "hetero/staleness_min": float(min(staleness)) if staleness else 0.0,
        "hetero/dropped": float(evicted_stale),
        "hetero/dropped/stale": float(evicted_stale),
    }
    for k in range(max_delay + 1):
        out[f"hetero/staleness_hist/{k}"] = float(sum(1 for s in staleness if s == k))
    return out
