"""Async mode's learner process: :class:`LearnerWorker`, a Ray actor launched by
:mod:`.supervisor`, is the in-process :class:`~.loop.LearnerRuntime` with a
:class:`TransportSource` as its rollout source.

One step (``LearnerWorker.step`` = :meth:`~.loop.LearnerRuntime.step`):
:meth:`TransportSource.next_batch` takes whole groups within the staleness bound from the
``RolloutBuffer`` (a poller thread moves arriving groups into it from the transport, through
the :class:`~verl_ext.trust.gate.TrustGate`, whose checks run in a checker process on the system cores,
:mod:`.checker`, or with ``hetero.trust.check_process=false`` in the poll thread), :meth:`~.learner.Learner.train_step` updates the model
(``verl_ext.algos.objective.compute_actor_loss``, then AdamW), and :meth:`TransportSource.publish`
writes the new version to the ``WeightStore`` the samplers (:mod:`.sampler`) read. Under
``hetero.stale_policy=wait`` the buffer does not step past the version that would make an
announced group stale until it arrives (or ``hetero.wait_timeout_s`` passes).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import ray

from ..sections import HeteroConfig
from .async_shared import pin_worker, weight_store
from .checker import OffloadedChecks, VerdictBlockClock, launch_checker
from .loop import LearnerRuntime
from .engine_config import Batch, EngineConfig
from .trust_wiring import embedded_gate, embedded_verifier
from verl_ext.trust.signing import Enrolment
from verl_ext.hetero.delay_channel import DelayChannel
from verl_ext.hetero.exchange import RolloutInbox
from verl_ext.hetero.protocol import (
    EXPECTED_TOPIC,
    ROLLOUT_TOPIC,
    LearnerStatus,
    TransportSpec,
    clear_topic,
    publish_gumbel_key,
    publish_status,
    request_stop,
)
from verl_ext.hetero.records import RolloutGroup
from verl_ext.hetero.seeding import LEARNER_STREAM
from verl_ext.trust.assignment import gumbel_key
from verl_ext.trust.gate import TrustGate
from verl_ext.trust.verifier import GroupVerifier


def rollout_inbox_transport(hetero: HeteroConfig, transport):
    """What the learner reads rollouts through: the transport, or with ``hetero.delay_rollouts`` a
    :class:`DelayChannel` on it that shows each group only after the delay model's draw for it
    (the learner's own stream, seconds)."""
    if not hetero.delay_rollouts:
        return transport
    return DelayChannel(
        transport, hetero.delay.build(), seed=hetero.seed, stream=LEARNER_STREAM, topics=[ROLLOUT_TOPIC]
    )


def rewards_verifier(runtime: LearnerRuntime, gate: TrustGate) -> GroupVerifier:
    """The learner's rewards-only checker (no model: its own tokenizer and task), for groups that
    arrive while it waits for them (:class:`~.checker.OffloadedChecks`' ``rewards_here``)."""
    # the gate's bounds, read once at start (a rewards check does not use them)
    return embedded_verifier(
        runtime.engine, None, runtime.task, keep_versions=0, tokenizer=runtime.tokenizer, bounds=gate.bounds
    )


class TransportSource:
    """Async mode's :class:`~recipe.gepo.embedded.engine_config.RolloutSource`: groups arrive from sampler
    actors over the transport (a background thread polls them into the buffer); weights go out
    through a ``WeightStore``; the learner's status is published after every step.

    Groups pass the :class:`~verl_ext.trust.gate.TrustGate` on their way into the buffer
    (``hetero.trust``: signatures, checks, trust, quarantine, the divergence bound); with
    ``hetero.trust.check_process`` its checks run in a :class:`~.checker.TrustChecker` process
    (:class:`~.checker.OffloadedChecks`), else in the poll thread."""

    def __init__(self, runtime: LearnerRuntime, spec: TransportSpec):
        hetero = runtime.engine.hetero
        self.hetero, self.buffer = hetero, runtime.buffer
        self.transport = spec.open()
        self.weights = weight_store(hetero, self.transport, pipelined=True)
        offload = hetero.trust.check_process
        self.gate = embedded_gate(
            runtime.engine, runtime.model_path, runtime.task, runtime.buffer, local_checks=not offload
        )
        self.checks: Optional[OffloadedChecks] = None
        self._hungry = threading.Event()  # set while the learner is blocked in take()
        if offload and self.gate.checking:
            engine, model_path = runtime.engine, runtime.model_path
            self.checks = OffloadedChecks(
                self.gate,
                lambda: launch_checker(engine, model_path, spec),
                keep_versions=hetero.max_delay + 1,
                published_sha256=self.weights.published_sha256,
                learner_cores=hetero.learner_cpus,
                rewards_here=rewards_verifier(runtime, self.gate) if hetero.trust.check_rewards else None,
                learner_waits=self._hungry.is_set,
            )
        # while the learner is blocked on verdicts, its cores are idle: the checker may use them
        self.verdict_block = VerdictBlockClock(self.checks.lend_cores if self.checks else lambda blocked: None)
        announcements = self.transport if hetero.stale_policy == "wait" else None
        self.inbox = RolloutInbox(
            rollout_inbox_transport(hetero, self.transport),
            self.buffer,
            announcements=announcements,
            enrolment=self.gate.enrolment,
            gate=self.checks or self.gate,
        )
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, daemon=True)
        self.poll_cpu_s = 0.0  # the poll thread's CPU seconds so far (its own clock, read by itself)
        self._gumbel_key_published = False

    def start(self, checkpoint: Optional[dict], learner_version: int) -> None:
        if checkpoint is None:
            # a fresh run on a used exchange: the previous run's rollouts are not ours
            clear_topic(self.transport, ROLLOUT_TOPIC)
        # announcements of samplers that are gone (every sampler of this run announces anew)
        clear_topic(self.transport, EXPECTED_TOPIC)
        # versions newer than ours (published after the checkpoint we resume from, or by a
        # previous run) would look like the future to samplers and to the buffer
        # Every number after ours is lost, not only those the store still holds: it keeps
        # keep_weight_versions, and samplers may hold older ones of the crashed branch too (the
        # liars soak had groups of pruned lost versions admitted unchecked).
        lost = range(learner_version + 1, max(self.weights.versions(), default=learner_version) + 1)
        self.weights.delete_newer_than(learner_version)
        if checkpoint is not None and "trust" in checkpoint:
            self.gate.load_state_dict(checkpoint["trust"])  # a quarantined sampler stays so
        self.gate.lose_versions(lost)  # samplers may still hold their weights: not held against them
        self.gate.reload_enrolment()
        self._poller.start()

    # Poll intervals (s). The transport has no notification, so the inbox lists it: every
    # POLL_HUNGRY_S while the learner waits for groups; otherwise the interval doubles after
    # every empty listing up to POLL_IDLE_MAX_S. A listing costs a round trip to the mailbox
    # actor and CPU in two processes; at a fixed 20 ms it took a third of the learner's CPU.
    # The cap is what a group may sit unread while the learner trains: its checks (in the checker
    # process, or here) can only start once it is read, and at 0.2 s they were still running when
    # the learner asked for the group (toy, checker process: learner idle 0.54-0.67 s in 35 steps
    # against 0.09-0.16 s at 0.05 s, for +0.0-0.05 s of this thread's CPU).
    POLL_HUNGRY_S = 0.02
    POLL_IDLE_MAX_S = 0.05

    def _poll_loop(self) -> None:
        interval, next_listing = self.POLL_HUNGRY_S, 0.0
        while not self._stop.is_set():
            self.poll_cpu_s = time.thread_time()
            if self.checks is not None:
                self.inbox.settle()  # verdicts that came back: they need no listing
                self.verdict_block.update(self._queue_depth())
            if self._hungry.is_set() or time.monotonic() >= next_listing:
                self.gate.reload_enrolment()
                received = self.inbox.stats["received"]
                self.inbox.poll(settle=False)
                self.inbox.poll_announcements()
                if self.checks is not None:
                    self.verdict_block.update(self._queue_depth())
                # groups read (admitted, refused or awaiting a verdict): more may follow soon
                if self.inbox.stats["received"] > received or self._hungry.is_set():
                    interval = self.POLL_HUNGRY_S
                else:
                    interval = min(2 * interval, self.POLL_IDLE_MAX_S)
                next_listing = time.monotonic() + interval
            timeout = max(0.0, next_listing - time.monotonic())
            if self.checks is not None and self.checks.outstanding():
                # checks are out: a verdict wakes the poller, settled above without a listing
                # (listing at each verdict kept the mailbox busy at 50 listings a second)
                self.checks.wait(min(timeout, self.POLL_HUNGRY_S) if self._hungry.is_set() else timeout)
                continue
            # next_batch sets _hungry: a learner starting to wait wakes the poller at once
            if not self._hungry.wait(timeout=timeout):
                continue
            self._stop.wait(self.POLL_HUNGRY_S)

    def next_batch(self, step: int, n: int, learner_version: int) -> Batch:
        t0 = time.perf_counter()
        self._hungry.set()
        if self.checks is not None:
            self.verdict_block.waits(n, self._queue_depth())
            self.checks.interrupt()  # the poll thread may be asleep on verdicts: it lists now
        try:
            groups = self.buffer.take(n, learner_version=learner_version)
        finally:
            self._hungry.clear()
            self.verdict_block.fed()
        metrics = self.inbox.metrics()
        # CPU seconds of the learner's process so far, every thread (training, the poll thread,
        # Ray's): what the trust checks, wherever they run, add to it shows here
        metrics["perf/learner_process_cpu_s_total"] = time.process_time()
        # of which the poll thread's (reading, signatures, the gate's books, handing out checks)
        metrics["perf/learner_poll_cpu_s_total"] = self.poll_cpu_s
        metrics.update(self.gate.metrics())
        if self.checks is not None:
            metrics.update(self.checks.metrics())
            # the checker's cost to the learner's critical path (with its poll thread's CPU above)
            metrics["perf/learner_verdict_block_s_total"] = self.verdict_block.total_s
        return Batch(groups, wait_s=time.perf_counter() - t0, metrics=metrics)

    def publish(self, weights, version: int) -> None:
        if not self._gumbel_key_published and self.hetero.trust.checkable_sampling:
            # before the first version (samplers wait for both); from the restored secret on a resume
            publish_gumbel_key(self.transport, gumbel_key(self.gate.ledger.secret))
            self._gumbel_key_published = True
        (self.checks or self.gate).remember(version, self.weights.publish(version, weights))
        if self.hetero.max_queued_groups > 0:
            publish_status(
                self.transport, LearnerStatus(version=int(version), queue_depth=self._queue_depth()), wait=False
            )

    def _queue_depth(self) -> int:
        """Groups the learner holds for training: buffered and takeable, and awaiting a trust
        verdict (samplers pause on it, ``hetero.max_queued_groups``; the verdict clock counts on
        it). Not the withheld ones: only a later group's check releases them, so samplers that
        paused on them would wait for ever."""
        return self.buffer.takeable() + (self.checks.outstanding() if self.checks is not None else 0)

    def state_dict(self) -> dict[str, Any]:
        return {"trust": self.gate.state_dict()}

    def acknowledge(self, buffer_state: dict) -> int:
        return self.inbox.acknowledge(buffer_state)

    def enrol(self, sampler_id: str, public_hex: Optional[str]) -> None:
        self.gate.enrol(sampler_id, public_hex)

    def trained(self, groups: list[RolloutGroup], divergence: list[float]) -> None:
        self.gate.trained(groups, divergence)

    def drain_events(self) -> list[dict]:
        return self.gate.drain_events()

    def close(self) -> None:
        self._stop.set()
        self.transport.flush()  # the last versions reach the mailbox (or their error is raised)
        request_stop(self.transport)
        if self._poller.is_alive():
            self._poller.join(timeout=5)
        if self.checks is not None:
            self.checks.close()


class LearnerWorker(LearnerRuntime):
    """The learner actor: the driver's :class:`LearnerRuntime` with a :class:`TransportSource`."""

    def __init__(self, engine: EngineConfig, model_path: str, spec: TransportSpec):
        pin_worker(engine.hetero.learner_cpus, "hetero.learner_cpus")
        super().__init__(engine, model_path, lambda runtime: TransportSource(runtime, spec))

    def start(self, checkpoint: Optional[dict] = None, enrolment: str = "") -> int:
        """:meth:`LearnerRuntime.start`, after enrolling ``enrolment`` (an
        :class:`~verl_ext.trust.signing.Enrolment` as JSON: the samplers launched before a resume,
        whose groups may still be in flight) -- before the inbox reads anything."""
        if enrolment:
            for sampler_id, keys in Enrolment.from_json(enrolment).keys.items():
                for public_hex in keys.values():
                    self.source.enrol(sampler_id, public_hex)
        return super().start(checkpoint)

    @ray.method(concurrency_group="control")
    def enrol(self, sampler_id: str, public_hex: Optional[str]) -> None:
        """Enrol a launched sampler's key while a step runs (its own thread: the step may be
        waiting for that sampler's groups)."""
        self.source.enrol(sampler_id, public_hex)
