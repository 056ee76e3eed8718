"""Delayed parameter sync: the samplers see version v only after its delay, never go back in
time, and older versions are pushed from their CPU snapshots."""

import numpy as np
import pytest

from recipe.gepo.verl_engine.delayed_sync import (
    CURRENT_SLOT,
    DelayedCheckpointManager,
    DelayedSyncSchedule,
    snapshot_slot,
)
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
    assert s.skipped == 0 and s.metrics(11)["hetero/sync_lag"] == 3.0


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
    assert s.skipped == len(skipped) > 0
    for v in served:
        assert served_at[v] - release[v] < 10.0
    for v in skipped:
        first_sync = 10.0 * np.ceil(release[v] / 10.0)
        assert any(u > v and served_at[u] <= first_sync for u in served)


def test_snapshot_budget_skips_the_oldest_and_counts_it():
    s = DelayedSyncSchedule(make_delay_model("constant", value=100.0), "steps", max_pending=2)
    for step in range(5):
        s.publish(step, float(step))
    assert sorted(s.pending) == [3, 4] and s.skipped == 3
    assert s.pop_retired() == [0, 1, 2]
    with pytest.raises(ValueError, match="versions must increase"):
        s.publish(4, 5.0)


def test_bad_settings_are_named():
    model = make_delay_model("none")
    with pytest.raises(ValueError, match="keep_weight_versions=0"):
        DelayedSyncSchedule(model, "steps", max_pending=0)
    with pytest.raises(ValueError, match="unit='hours'"):
        DelayedSyncSchedule(model, "hours", max_pending=1)


class RecordingWorkers:
    """Test double for verl's GPU-only pieces (the checkpoint engine manager and the actor worker
    group's CPU snapshot calls): records the calls and tracks which weights are 'loaded'."""

    def __init__(self):
        self.calls, self.snapshots, self.loaded = [], {}, "w0"

    # actor worker group (DetachActorWorker API)
    def save_model_to_cpu(self, n):
        self.calls.append(("save", n))
        self.snapshots[n] = self.loaded

    def restore_model_from_cpu(self, n):
        self.calls.append(("restore", n))
        self.loaded = self.snapshots[n]

    def clear_cpu_model(self, n):
        self.calls.append(("clear", n))
        self.snapshots.pop(n, None)

    # checkpoint engine manager
    def update_weights(self, global_steps):
        self.calls.append(("push", global_steps, self.loaded))
        return {"sync/bytes": 1.0}

    def sleep_replicas(self):
        self.calls.append(("sleep",))


def test_manager_pushes_old_versions_from_their_snapshots_and_restores_the_learner():
    w = RecordingWorkers()
    schedule = DelayedSyncSchedule(make_delay_model("constant", value=2.0), "steps", max_pending=4)
    mgr = DelayedCheckpointManager(w, w, schedule)
    pushes = []
    for step in range(6):
        w.loaded = f"w{step}"  # the learner's weights after `step` updates
        metrics = mgr.update_weights(step)
        assert w.loaded == f"w{step}"  # the learner always continues with its own weights
        assert "hetero/sync_lag" in metrics
        pushes += [c for c in w.calls if c[0] == "push"]
        w.calls.clear()
    # initial weights at once, then version v (its own weights, not newer) at step v + 2
    assert pushes == [("push", 0, "w0"), ("push", 1, "w1"), ("push", 2, "w2"), ("push", 3, "w3")]
    assert set(w.snapshots) == {snapshot_slot(4), snapshot_slot(5)}  # pending only; others freed
    assert CURRENT_SLOT not in w.snapshots
    mgr.sleep_replicas()  # everything else is verl's manager, unchanged
    assert w.calls == [("sleep",)]


def test_no_delay_pushes_every_version_at_once_without_snapshots():
    w = RecordingWorkers()
    mgr = DelayedCheckpointManager(w, w, DelayedSyncSchedule(make_delay_model("none"), "seconds", 4))
    for step in range(3):
        w.loaded = f"w{step}"
        mgr.update_weights(step)
    assert [c for c in w.calls if c[0] != "push"] == []
    assert [c[1] for c in w.calls] == [0, 1, 2]
    assert np.isfinite(mgr.schedule.metrics(2)["hetero/sync_lag"])
