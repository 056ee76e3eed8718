"""Delayed parameter sync from the learners to verl's rollout (sampler) replicas.

verl pushes the learner's weights to its replicas at the end of every step
(``CheckpointEngineManager.update_weights``); the verl engine wraps that manager: version v is
published when the learner finishes step v, a delay d_v is drawn from ``hetero.delay``, and the
samplers receive v at the first sync point (a learner step end) after t_v + d_v, never earlier, in
learner steps (``unit: steps``) or seconds (``unit: seconds``); until then they keep generating. A
version released after a newer one is superseded (samplers never go back in time;
``hetero/sync_superseded``, expected whenever delays vary). Unreleased versions are kept as CPU
snapshots on the actor workers (``DetachActorWorker.save_model_to_cpu``), at most
``hetero.keep_weight_versions``; past that the oldest is dropped before its delay passed
(``hetero/sync_over_capacity``: raise ``keep_weight_versions`` if it moves). :class:`DelayedSyncSchedule`
decides (pure Python); :class:`DelayedCheckpointManager` applies it to verl's manager and reports
each push (``hetero/sync_pushed_version``, ``hetero/sync_drawn_delay``, ``hetero/sync_observed_delay``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from verl_ext.hetero.delay import DelayModel, DelaySchedule, to_steps
from verl_ext.hetero.seeding import sampler_stream

UNITS = ("steps", "seconds")


class DelayedSyncSchedule:
    """Which weight version the samplers may see, and when.

    Args:
        model: delay model (``HeteroConfig.delay.build()``).
        unit: "steps" (delays rounded to whole learner steps; ``now`` is the learner version) or
            "seconds" (``now`` is ``clock()``).
        max_pending: most versions kept waiting for release (CPU snapshots), >= 1.
        seed: root seed of the delays (``hetero.seed``): version v's delay is
            ``DelaySchedule(model, seed).delay(v, sampler_stream(0))``, the same draw replay mode
            and the embedded engine's sampler 0 get for v (the replicas receive each version
            together, as one sampler).
        clock: time source for unit="seconds".
    """

    def __init__(
        self,
        model: DelayModel,
        unit: str,
        max_pending: int,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if unit not in UNITS:
            raise ValueError(f"delay unit={unit!r}; expected one of {UNITS}")
        if max_pending < 1:
            raise ValueError(f"hetero.keep_weight_versions={max_pending} must be >= 1")
        self.model, self.unit, self.max_pending, self.clock = model, unit, max_pending, clock
        self._delays = DelaySchedule(model, seed)
        self.pending: dict[int, float] = {}  # version -> release time (steps or seconds)
        self.served: Optional[int] = None
        self.published: Optional[int] = None
        self.superseded = 0  # released after a newer version was: never pushed (time runs forward)
        self.over_capacity = 0  # dropped unreleased because more than max_pending versions waited
        self.last_delay = 0.0
        self._retired: list[int] = []

    def now(self, version: int) -> float:
        """The current time in the schedule's unit, at learner version ``version``."""
        return float(version) if self.unit == "steps" else float(self.clock())

    def draw(self, version: int) -> float:
        """The delay of ``version`` in the schedule's unit (whole steps for ``unit="steps"``)."""
        delay = self._delays.delay(version, sampler_stream(0))
        return float(to_steps(delay)) if self.unit == "steps" else delay

    def publish(self, version: int, now: float, immediate: bool = False) -> float:
        """The learner finished ``version``; returns its release time. ``immediate`` (the
        initial / resumed weights) releases it at once."""
        if self.published is not None and version <= self.published:
            raise ValueError(f"version {version} published after version {self.published}: versions must increase")
        self.published = version
        self.last_delay = 0.0 if immediate else self.draw(version)
        release = now + self.last_delay
        self.pending[version] = release
        while len(self.pending) > self.max_pending:
            oldest = min(self.pending)
            del self.pending[oldest]
            self._retired.append(oldest)
            self.over_capacity += 1
        return release

    def needs_snapshot(self, version: int, now: float) -> bool:
        """Whether ``version`` must be kept because it is released later than now."""
        return version in self.pending and self.pending[version] > now

    def due(self, now: float) -> Optional[int]:
        """The version to push now (the newest one released by ``now``), or None. Older pending
        versions are superseded: they are retired and counted in ``superseded``."""
        ready = [v for v, t in self.pending.items() if t <= now]
        if not ready:
            return None
        newest = max(ready)
        for v in [v for v in self.pending if v <= newest]:
            del self.pending[v]
            if v != newest:
                self._retired.append(v)
                self.superseded += 1
        self.served = newest
        return newest

    @property
    def skipped(self) -> int:
        """Versions never pushed: superseded plus over capacity."""
        return self.superseded + self.over_capacity

    def pop_retired(self) -> list[int]:
        """Versions whose snapshots can be freed (never pushed ones), since the last call."""
        retired, self._retired = self._retired, []
        return retired

    def metrics(self, learner_version: int) -> dict[str, float]:
        served = -1 if self.served is None else self.served
        return {
            "hetero/sampler_weight_version": float(served),
            "hetero/sync_lag": float(learner_version - served) if self.served is not None else float("nan"),
            "hetero/sync_pending": float(len(self.pending)),
            "hetero/sync_superseded": float(self.superseded),
            "hetero/sync_over_capacity": float(self.over_capacity),
            "hetero/sync_delay": self.last_delay,
        }


def snapshot_slot(version: int) -> str:
    """Key of a version's CPU snapshot on the actor workers (distinct from verl's integer slots)."""
    return f"hetero_v{version}"


CURRENT_SLOT = "hetero_current"


class DelayedCheckpointManager:
    """Wraps verl's ``CheckpointEngineManager`` so ``update_weights(v)`` follows the schedule.

    Args:
        inner: verl's manager (pushes the actor's *current* weights to the replicas, tagged v).
        actor_wg: the actor worker group; must have verl's ``save_model_to_cpu``,
            ``restore_model_from_cpu`` and ``clear_cpu_model`` (``DetachActorWorker``).
        schedule: the :class:`DelayedSyncSchedule`.
    """

    def __init__(self, inner: Any, actor_wg: Any, schedule: DelayedSyncSchedule):
        self.inner, self.actor_wg, self.schedule = inner, actor_wg, schedule
        self._initialised = False
        self._current: Optional[int] = None  # the learner's newest version (its live weights)
        self._saved: set[int] = set()  # versions with a snapshot on the workers
        self.pushed: list[int] = []  # versions pushed to the samplers, in order
        # version -> (publication time, drawn delay), in the schedule's unit, until it is pushed
        self._published: dict[int, tuple[float, float]] = {}
        self.last_push: dict[str, float] = {}  # the newest push, as hetero/sync_* metrics

    def _free(self, version: int) -> None:
        if version in self._saved:
            self._saved.discard(version)
            self.actor_wg.clear_cpu_model(snapshot_slot(version))

    def update_weights(self, global_steps: int) -> dict[str, float]:
        """Publish version ``global_steps`` and push whatever version is due (maybe none)."""
        schedule = self.schedule
        now = schedule.now(global_steps)
        schedule.publish(global_steps, now, immediate=not self._initialised)
        self._published[global_steps] = (now, schedule.last_delay)
        self._initialised = True
        self._current = global_steps
        if schedule.needs_snapshot(global_steps, now):
            self.actor_wg.save_model_to_cpu(snapshot_slot(global_steps))
            self._saved.add(global_steps)
        metrics = self._push_due(now)
        metrics.update(schedule.metrics(global_steps))
        metrics.update(self.last_push)  # this step's push, or the newest one made while waiting
        return metrics

    def release_due(self) -> dict[str, float]:
        """Push a version whose delay has passed although no learner step has ended.

        Called while the learner waits for samples (its weights are idle then). Without it a
        delayed version is released only at a step end, and when every new sample is past the
        staleness bound no step can end: training stalls for good (seen with a 2.5 s delay and a
        bound of 3). Only the ``seconds`` unit can come due between steps."""
        if not self._initialised or self.schedule.unit != "seconds":
            return {}
        return self._push_due(self.schedule.clock())

    def _push_due(self, now: float) -> dict[str, float]:
        schedule = self.schedule
        version = schedule.due(now)
        metrics: dict[str, float] = {}
        if version is not None:
            if version == self._current:
                metrics.update(self.inner.update_weights(version) or {})
            else:
                # push an older version: swap its snapshot in, push, swap the current weights back
                self.actor_wg.save_model_to_cpu(CURRENT_SLOT)
                self.actor_wg.restore_model_from_cpu(snapshot_slot(version))
                metrics.update(self.inner.update_weights(version) or {})
                self.actor_wg.restore_model_from_cpu(CURRENT_SLOT)
                self.actor_wg.clear_cpu_model(CURRENT_SLOT)
            self._free(version)
            self.pushed.append(version)
            published_at, drawn = self._published.pop(version)
            # what the samplers saw: drawn <= observed, late by at most one sync point
            self.last_push = {
                "hetero/sync_pushed_version": float(version),
                "hetero/sync_drawn_delay": drawn,
                "hetero/sync_observed_delay": now - published_at,
            }
        for old in schedule.pop_retired():
            self._free(old)
            self._published.pop(old, None)
        return metrics

    def __getattr__(self, name: str) -> Any:
        # sleep_replicas, abort_replicas, resume_generation_replicas, ...: verl's, unchanged
        return getattr(self.inner, name)
