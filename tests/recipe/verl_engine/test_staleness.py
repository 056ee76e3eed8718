"""The exact staleness bound over generating weight versions, on verl's real replay buffer."""

import pytest

from recipe.gepo.verl_engine.batch_rules import (
    group_weight_versions,
    hetero_step_metrics,
    stale_group_uids,
    verl_threshold,
)


def tags_for(groups):
    """{uid: [min_global_steps of each trajectory]} -> verl's trajectory tag dict."""
    return {f"{uid}_s_{i}": {"min_global_steps": v} for uid, vs in groups.items() for i, v in enumerate(vs)}


def test_group_version_is_its_oldest_trajectory_and_bound_is_exact():
    tags = tags_for({"a": [10, 10], "b": [2, 9], "c": [1, 1], "d": [None, None]})
    assert group_weight_versions(tags) == {"a": 10, "b": 2, "c": 1}
    # learner at step 11 holds version 10: staleness a=0, b=8, c=9
    assert stale_group_uids(tags, {"a", "b", "c", "d"}, global_steps=11, max_delay=8) == {"c"}
    assert stale_group_uids(tags, {"a", "b", "c"}, global_steps=11, max_delay=7) == {"b", "c"}
    assert stale_group_uids(tags, {"a"}, global_steps=11, max_delay=0) == set()
    with pytest.raises(ValueError, match="max_delay=-1"):
        stale_group_uids(tags, {"a"}, 11, -1)


def test_verl_threshold_covers_every_admissible_group():
    # a group from version w was submitted at step s >= w + 1; admissible iff (g-1) - w <= D
    for d in (0, 8, 64):
        for g in range(1, 80):
            for w in range(0, g):
                if (g - 1) - w <= d:
                    for s in range(w + 1, g + 1):
                        assert g - s + 1 <= verl_threshold(d)


def test_step_metrics_use_the_embedded_engine_names():
    keys = ["a_0_0", "a_0_1", "b_0_0", "b_0_1", "c_0_0"]
    tags = [
        {"min_global_steps": 9},
        {"min_global_steps": 8},
        {"min_global_steps": 5},
        {"min_global_steps": 6},
        {"min_global_steps": 9, "is_padding": True},
    ]
    m = hetero_step_metrics(keys, tags, global_steps=10, max_delay=8, evicted_stale=3)
    assert m["hetero/consumed"] == 2  # groups a and b (c is padding)
    assert (m["hetero/staleness_min"], m["hetero/staleness_max"]) == (1.0, 4.0)
    assert m["hetero/staleness_mean"] == 2.5 and m["hetero/dropped"] == 3.0
    assert m["hetero/staleness_hist/1"] == 1 and m["hetero/staleness_hist/4"] == 1
    assert sum(v for k, v in m.items() if k.startswith("hetero/staleness_hist/")) == 2
