"""Delayed parameter sync, the schedule: the samplers see version v only after its delay and never
go back in time."""

import numpy as np
import pytest

from recipe.gepo.verl_engine.delayed_sync import DelayedSyncSchedule
from verl_ext.hetero.delay import make_delay_model


def test_constant_delay_in_steps_releases_each_version_exactly_after_its_delay():
    s = DelayedSyncSchedule(make_delay_model("constant", value=3.0), "steps", max_pending=8)
    seen = {}
    for step in range(0, 12):
        s.publish(step, s.now(step), immediate=(step == 0))
        v = s.due(s.now(step))
        if v is not None:
            seen[step] = v
    # version 0 at once, then version v at step v + 3
    assert seen == {0: 0, **{v + 3: v for v in range(1, 9)}}
    m = s.metrics(11)
    assert m["hetero/sync_lag"] == 3.0
    assert m["hetero/sync_superseded"] == m["hetero/sync_over_capacity"] == 0.0 and s.skipped == 0


def test_lognormal_seconds_never_early_monotone_and_skips_superseded_versions():
    clock = {"t": 0.0}
    model = make_delay_model("lognormal", low=5.0, high=80.0, confidence=0.995, offset=0.0)
    s = DelayedSyncSchedule(model, "seconds", max_pending=64, seed=7, clock=lambda: clock["t"])
    release, served, served_at = {}, [], {}
    for step in range(200):
        clock["t"] = 10.0 * step  # one learner step every 10 s
        release[step] = s.publish(step, s.now(step), immediate=(step == 0))
        assert step == 0 or 5.0 <= s.last_delay <= 80.0
        v = s.due(s.now(step))
        if v is not None:
            assert release[v] <= clock["t"]  # never before its delay has passed
            served.append(v)
            served_at[v] = clock["t"]
    assert served == sorted(served) and len(set(served)) == len(served)  # never back in time
    # every version is served at the first sync point after its release, unless a newer version
    # had already been served by then (the samplers do not go back in time): then it is skipped
    skipped = sorted(set(range(served[-1])) - set(served))
    # all of them superseded (the delay model at work), none for want of snapshots (64 kept)
    assert s.superseded == len(skipped) > 0 and s.over_capacity == 0
    assert s.metrics(199)["hetero/sync_superseded"] == float(len(skipped))
    assert s.metrics(199)["hetero/sync_over_capacity"] == 0.0
    for v in served:
        assert served_at[v] - release[v] < 10.0
    for v in skipped:
        first_sync = 10.0 * np.ceil(release[v] / 10.0)
        assert any(u > v and served_at[u] <= first_sync for u in served)


def test_snapshot_budget_drops_the_oldest_and_counts_it_apart_from_supersession():
    s = DelayedSyncSchedule(make_delay_model("constant", value=100.0), "steps", max_pending=2)
    for step in range(5):
        s.publish(step, float(step))
    assert sorted(s.pending) == [3, 4] and (s.over_capacity, s.superseded) == (3, 0)
    assert s.pop_retired() == [0, 1, 2]
    # versions 3 and 4 are both released by 104: 4 is pushed, 3 superseded -- the other counter
    assert s.due(104.0) == 4 and (s.over_capacity, s.superseded) == (3, 1) and s.skipped == 4
    assert s.pop_retired() == [3]
    m = s.metrics(4)
    assert (m["hetero/sync_over_capacity"], m["hetero/sync_superseded"]) == (3.0, 1.0)
    assert "hetero/sync_skipped" not in m
    with pytest.raises(ValueError, match="versions must increase"):
        s.publish(4, 5.0)


def test_bad_settings_are_named():
    model = make_delay_model("none")
    with pytest.raises(ValueError, match="keep_weight_versions=0"):
        DelayedSyncSchedule(model, "steps", max_pending=0)
    with pytest.raises(ValueError, match="unit='hours'"):
        DelayedSyncSchedule(model, "hours", max_pending=1)


# DelayedCheckpointManager runs against verl's real CheckpointEngineManager, hf_cpu replica and
# actor workers in tests/cpu/test_verl_actor.py (slow).
