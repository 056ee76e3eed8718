"""Async mode: one learner actor and N sampler actors on Ray, exchanging through a transport.

The loop and the learner runtime live in :mod:`recipe.gepo.embedded.driver`; this module is async
mode's rollout source (:class:`TransportSource`), the actors, and the supervision of the samplers.
The messages they exchange are defined in :mod:`verl_ext.hetero.protocol`.

Weights: the learner publishes every new version to a ``WeightStore``; each sampler reads it
through its own ``DelayChannel``, so version v becomes visible to sampler i only after the delay
the run's delay schedule gives (v, sampler i) (seconds, times the sampler's speed factor); the
sampler always takes the newest version it can see. Under ``hetero.weight_sync=delta`` the
learner also publishes each version as a delta from the one before (delayed exactly like the
version) and a sampler a few versions behind applies deltas instead of fetching it whole.
Rollouts: samplers send finished groups (rewards and advantages computed locally) over the same
transport; a thread in the learner moves them into the staleness-bounded ``RolloutBuffer``; the
learner takes whole groups within ``max_delay`` versions. Under ``hetero.stale_policy=wait``
samplers also announce each group before generating it, and the learner does not step past the
version that would make an announced group stale until it arrives (or ``hetero.wait_timeout_s``
passes).

The transport is Ray's object store (``hetero.transport=ray``) or an fsspec URL
(``hetero.transport=fs``); on an fsspec URL any process that builds a :class:`SamplerWorker` on
the same URL joins, which is how a sampler in another data centre takes part.

The driver (this process) runs the one loop against the learner actor and owns logging,
evaluation cadence, checkpoints and the progress bar; it notices a dead sampler, reports it,
withdraws its announcements and restarts it (it rejoins with the newest weights it can see).

Trust (``hetero.trust``): each sampler makes its signing key where it runs; the driver records
the public half in the run directory's ``enrolment.json`` and has the learner enrol it before the
sampler may send (a resumed learner enrols the file's keys before it reads anything). Every
arriving group passes the learner's :class:`~recipe.gepo.embedded.verify.TrustGate`.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from typing import Any, Iterator, Optional

import ray
from tqdm import tqdm

from ..sections import HeteroConfig
from .driver import LearnerRuntime, run_loop
from .engine import Batch, EngineConfig
from .policy import load_policy
from .rollout import RolloutSettings, generate_groups
from .run_utils import MetricLogger, RunSettings
from .tasks import Task
from .verify import TrustGate
from verl_ext.hetero.affinity import Pinned, machine_cpus, pin_process
from verl_ext.hetero.auth import Enrolment, SamplerKey
from verl_ext.hetero.delay_channel import DelayChannel
from verl_ext.hetero.exchange import RolloutInbox, send_group
from verl_ext.hetero.records import RolloutGroup
from verl_ext.hetero.protocol import (
    CONTROL_TOPIC,
    EXPECTED_TOPIC,
    LEARNER_ACTOR,
    ROLLOUT_TOPIC,
    STATUS_KEY,
    WEIGHTS_DELTA_TOPIC,
    WEIGHTS_TOPIC,
    LearnerStatus,
    TransportSpec,
    announce,
    clear_stop,
    clear_topic,
    publish_status,
    read_record,
    request_stop,
    sampler_actor_name,
    stop_requested,
)
from verl_ext.hetero.seeding import LEARNER_STREAM, sampler_sampling_seed, sampler_stream
from verl_ext.hetero.weights import WeightStore
from verl_ext.rundir import ENROLMENT_FILE
from verl_ext.torch_threads import set_torch_threads


def transport_spec(hetero: HeteroConfig, settings: RunSettings) -> TransportSpec:
    """How every process reaches the shared transport."""
    if hetero.transport == "fs":
        return TransportSpec("fsspec", url=hetero.transport_url or str((settings.run_dir / "exchange").resolve()))
    # the mailbox holds every message: on the learner's node (custom resources), as the learner
    return TransportSpec("ray", name=f"heterorl-mailbox-{settings.experiment_name}-{hetero.seed}",
                         resources=tuple(sorted(hetero.learner_ray_resources.items())))  # fmt: skip


def weight_store(hetero: HeteroConfig, transport, pipelined: bool = False) -> WeightStore:
    """The weight store of the learner (publishes, ``pipelined``: without waiting for the mailbox
    to confirm each version) and of every sampler (fetches, through its delay channel):
    ``hetero.keep_weight_versions``, ``weights_bf16``, ``weight_sync``, ``max_delta_chain``."""
    return WeightStore(transport, keep_last=hetero.keep_weight_versions,
                       wire_dtype="bf16" if hetero.weights_bf16 else None,
                       delta=hetero.weight_sync == "delta", max_delta_chain=hetero.max_delta_chain,
                       pipelined=pipelined)  # fmt: skip


def pin_worker(cpus: list[int], key: str) -> None:
    """Thread rule of every actor: pinned to ``cpus`` with that many torch threads
    (``hetero.learner_cpus`` / ``hetero.sampler_cpus``), else one torch thread (OMP_NUM_THREADS
    wins when set): more threads than the process's share of cores only makes them wait."""
    if cpus:
        pin_process(cpus, key)
    else:
        set_torch_threads(1)


class SamplerWorker:
    """Generates rollout groups with the newest weights its delay lets it see, until told to stop."""

    WAIT_POLL_S = 0.1
    """Seconds between checks while waiting for newer weights or for room in the learner's queue."""

    WEIGHT_STATS = {"full_loads": "weight_full_loads", "delta_loads": "weight_delta_loads",
                    "bytes_fetched": "weight_bytes_fetched", "delta_fallbacks": "weight_delta_fallbacks",
                    "delta_larger": "weight_delta_larger"}  # fmt: skip
    """Weight store counter -> sampler stat: which path each load took (hetero.weight_sync)."""

    def __init__(self, index: int, engine: EngineConfig, model_path: str, spec: TransportSpec,
                 speed_factor: float, uid_namespace: str, key: Optional[SamplerKey] = None):
        pin_worker(engine.hetero.sampler_cpus, "hetero.sampler_cpus")
        self.index, self.sampler_id = index, f"sampler-{index}"
        # hetero.trust.sign_records: signed with a key made here (or the remote sampler's key
        # file); the learner enrols its public half (RemoteRuntime._launch, or enrolment_file)
        if key is not None and key.sampler_id != self.sampler_id:
            raise ValueError(f"the key is {key.sampler_id!r}'s, this sampler is {self.sampler_id!r}")
        if key is None and engine.hetero.trust.sign_records:
            key = SamplerKey.generate(self.sampler_id)
        self.key = key if engine.hetero.trust.sign_records else None
        self.uid_namespace = uid_namespace  # unique per launch: a restarted sampler never reuses a uid
        self.hetero, self.settings, self.algorithm_config = engine.hetero, engine.settings, engine.algorithm
        self.task = Task(engine.task, self.hetero.seed)
        self.rollout = RolloutSettings(self.settings.group_size, self.settings.temperature, self.settings.max_new_tokens)
        self.model, self.tokenizer = load_policy(model_path)
        self.model.eval()
        self.transport = spec.open()
        channel = DelayChannel(
            self.transport, self.hetero.delay.build(), seed=self.hetero.seed, stream=sampler_stream(index),
            speed_factor=speed_factor, topics=[WEIGHTS_TOPIC, WEIGHTS_DELTA_TOPIC],  # delta v: delayed as v
        )  # fmt: skip
        self.weights = weight_store(self.hetero, channel)
        # what exists, undelayed: only the version numbers are read from it, never the weights
        self.published = WeightStore(self.transport, keep_last=self.hetero.keep_weight_versions)
        self.speed_factor = speed_factor
        self.version = -1
        self.stats = {"batches": 0, "groups": 0, "tokens": 0, "gen_s": 0.0, "weight_loads": 0,
                      "stale_wait_s": 0.0, "queue_wait_s": 0.0, **{k: 0 for k in self.WEIGHT_STATS.values()}}

    def _refresh_weights(self) -> None:
        newest = self.weights.latest(newer_than=self.version if self.version >= 0 else None)
        if newest is not None:
            self.version, state = newest
            self.model.load_state_dict(state)
            self.stats["weight_loads"] += 1
        for counter, stat in self.WEIGHT_STATS.items():
            self.stats[stat] = self.weights.stats[counter]

    def weights_too_stale(self) -> bool:
        """Groups made now would be past the bound on arrival (the learner only moves forward)."""
        if not self.hetero.sampler_skip_stale:
            return False
        newest = self.published.latest_version()
        return newest is not None and newest - self.version > self.hetero.max_delay

    def learner_queue_full(self) -> bool:
        """Back-pressure: the learner's last published queue depth is at ``max_queued_groups``."""
        if self.hetero.max_queued_groups <= 0:
            return False
        status = read_record(self.transport, LearnerStatus, CONTROL_TOPIC, STATUS_KEY)
        return status is not None and status.queue_depth >= self.hetero.max_queued_groups

    def stopped(self) -> bool:
        return stop_requested(self.transport)

    def public_key(self) -> Optional[str]:
        """The public half of this sampler's signing key (hex), or None when it does not sign."""
        return None if self.key is None else self.key.public_hex()

    def run(self, start_batch: int = 0, max_batches: Optional[int] = None, enrolled: Any = None) -> dict[str, float]:
        """Generate until the stop marker appears (or ``max_batches``); returns counters.
        ``enrolled``: the learner's enrolment of this sampler's key (a Ray object ref the run
        waits for, so no record is sent before the learner accepts its signature)."""
        batch_index = start_batch
        while not self.stopped() and (max_batches is None or batch_index - start_batch < max_batches):
            self._refresh_weights()
            if self.version < 0:
                time.sleep(0.05)  # the learner has not published version 0 yet
                continue
            # wait for newer weights rather than generate groups to drop; for room in the queue
            wait = "stale_wait_s" if self.weights_too_stale() else None
            if wait is None and self.learner_queue_full():
                wait = "queue_wait_s"
            if wait is not None:
                # each check is a few round trips to the mailbox (on the learner's node): a
                # waiting sampler asks 10 times a second, not 20
                t0 = time.perf_counter()
                time.sleep(self.WAIT_POLL_S)
                self.stats[wait] += time.perf_counter() - t0
                continue
            items = self.task.train_items(self.settings.prompts_per_step, stream=self.index + 1, index=batch_index)
            uid_prefix = f"{self.uid_namespace}-b{batch_index}"
            if self.hetero.stale_policy == "wait":  # the learner waits for these before they go stale
                for i in range(len(items)):
                    announce(self.transport, f"{uid_prefix}-{i}", self.version, self.sampler_id)
            t0 = time.perf_counter()
            groups = generate_groups(
                self.model, self.tokenizer, items, self.task.score, self.rollout, self.algorithm_config,
                policy_version=self.version, sampler_id=self.sampler_id,
                seed=sampler_sampling_seed(self.hetero.seed, batch_index, self.index), uid_prefix=uid_prefix,
            )  # fmt: skip
            gen_s = time.perf_counter() - t0
            if self.speed_factor > 1:
                time.sleep(gen_s * (self.speed_factor - 1))  # slower hardware: same work takes longer
            for group in groups:
                self.send(group)
            self.stats["batches"] += 1
            self.stats["groups"] += len(groups)
            self.stats["tokens"] += sum(int(g.response_mask.sum()) for g in groups)
            self.stats["gen_s"] += gen_s
            batch_index += 1
        return dict(self.stats, next_batch=batch_index)

    def send(self, group: RolloutGroup) -> None:
        """Publish one group (signed when the sampler has a key). The soak's lying samplers
        (scripts/soak_harness/liars.py) change the group here."""
        send_group(self.transport, group, key=self.key)

    def counters(self) -> dict[str, float]:
        return dict(self.stats)


def rollout_inbox_transport(hetero: HeteroConfig, transport):
    """What the learner reads rollouts through: the transport, or with ``hetero.delay_rollouts`` a
    :class:`DelayChannel` on it that shows each group only after the delay model's draw for it
    (the learner's own stream, seconds)."""
    if not hetero.delay_rollouts:
        return transport
    return DelayChannel(transport, hetero.delay.build(), seed=hetero.seed, stream=LEARNER_STREAM, topics=[ROLLOUT_TOPIC])


class TransportSource:
    """Async mode's :class:`~recipe.gepo.embedded.engine.RolloutSource`: groups arrive from sampler
    actors over the transport (a background thread polls them into the buffer); weights go out
    through a ``WeightStore``; the learner's status is published after every step.

    Groups pass the :class:`~recipe.gepo.embedded.verify.TrustGate` on their way into the buffer
    (``hetero.trust``: signatures, checks, trust, quarantine, the divergence bound)."""

    def __init__(self, runtime: LearnerRuntime, spec: TransportSpec):
        hetero = runtime.engine.hetero
        self.hetero, self.buffer = hetero, runtime.buffer
        self.transport = spec.open()
        self.gate = TrustGate(runtime.engine, runtime.model_path, runtime.task, runtime.buffer)
        announcements = self.transport if hetero.stale_policy == "wait" else None
        self.inbox = RolloutInbox(rollout_inbox_transport(hetero, self.transport), self.buffer, announcements=announcements,
                                  enrolment=self.gate.enrolment, gate=self.gate)  # fmt: skip
        self.weights = weight_store(hetero, self.transport, pipelined=True)
        self._stop = threading.Event()
        self._hungry = threading.Event()  # set while the learner is blocked in take()
        self._poller = threading.Thread(target=self._poll_loop, daemon=True)

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
    POLL_HUNGRY_S = 0.02
    POLL_IDLE_MAX_S = 0.2

    def _poll_loop(self) -> None:
        interval = self.POLL_HUNGRY_S
        while not self._stop.is_set():
            self.gate.reload_enrolment()
            accepted = self.inbox.poll()
            self.inbox.poll_announcements()
            if accepted or self._hungry.is_set():
                interval = self.POLL_HUNGRY_S
            else:
                interval = min(2 * interval, self.POLL_IDLE_MAX_S)
            # next_batch sets _hungry: a learner starting to wait wakes the poller at once
            if not self._hungry.wait(timeout=interval):
                continue
            self._stop.wait(self.POLL_HUNGRY_S)

    def next_batch(self, step: int, n: int, learner_version: int) -> Batch:
        t0 = time.perf_counter()
        self._hungry.set()
        try:
            groups = self.buffer.take(n, learner_version=learner_version)
        finally:
            self._hungry.clear()
        metrics = self.inbox.metrics()
        metrics.update(self.gate.metrics())
        return Batch(groups, wait_s=time.perf_counter() - t0, metrics=metrics)

    def publish(self, weights, version: int) -> None:
        self.gate.remember(version, self.weights.publish(version, weights))
        if self.hetero.max_queued_groups > 0:
            publish_status(self.transport, LearnerStatus(version=int(version), queue_depth=len(self.buffer)), wait=False)

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


class LearnerWorker(LearnerRuntime):
    """The learner actor: the driver's :class:`LearnerRuntime` with a :class:`TransportSource`."""

    def __init__(self, engine: EngineConfig, model_path: str, spec: TransportSpec):
        pin_worker(engine.hetero.learner_cpus, "hetero.learner_cpus")
        super().__init__(engine, model_path, lambda runtime: TransportSource(runtime, spec))

    def start(self, checkpoint: Optional[dict] = None, enrolment: str = "") -> int:
        """:meth:`LearnerRuntime.start`, after enrolling ``enrolment`` (an
        :class:`~verl_ext.hetero.auth.Enrolment` as JSON: the samplers launched before a resume,
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


class _SamplerCounters:
    """Sums over all samplers: response tokens per wall-clock second since the last update, the
    seconds samplers have waited for weights within the bound (``sampler_skip_stale``) and for
    room in the learner's queue (``max_queued_groups``), and their weight loads by path (full
    version or deltas, ``weight_sync``) with the payload bytes they fetched.

    Never blocks the step: each update collects the answers that have arrived and asks again
    (one request in flight per sampler), so the numbers lag by up to one step."""

    def __init__(self):
        self._counters: dict[Any, dict] = {}
        self._pending: dict[Any, Any] = {}  # ObjectRef -> actor
        self._last = time.perf_counter()

    def update(self, samplers: dict[int, Any]) -> dict[str, float]:
        total_new = 0.0
        if self._pending:
            ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
            for ref in ready:
                actor = self._pending.pop(ref)
                try:
                    counters = ray.get(ref)
                except Exception:  # noqa: BLE001 - a dead sampler contributes nothing
                    continue
                total_new += float(counters["tokens"]) - float(self._counters.get(actor, {}).get("tokens", 0.0))
                self._counters[actor] = counters
        asked = set(self._pending.values())
        for actor in samplers.values():
            if actor not in asked:
                self._pending[actor.counters.remote()] = actor
        live = set(samplers.values())  # a replaced sampler's requests are dropped
        self._pending = {ref: a for ref, a in self._pending.items() if a in live}
        now = time.perf_counter()
        rate = total_new / max(now - self._last, 1e-9)
        self._last = now
        summed = ("stale_wait_s", "queue_wait_s", *SamplerWorker.WEIGHT_STATS.values())
        totals = {k: sum(float(c.get(k, 0.0)) for c in self._counters.values()) for k in summed}
        return {"perf/sampler_tokens_per_s": rate, **{f"perf/sampler_{k}_total": v for k, v in totals.items()}}


def _placement(resources: dict[str, float]) -> dict[str, Any]:
    """Ray actor options placing an actor on the node(s) holding ``resources`` (none: anywhere)."""
    return {"resources": dict(resources)} if resources else {}


class RemoteRuntime:
    """The driver's view of the learner actor: :class:`LearnerRuntime`'s methods for
    :func:`~recipe.gepo.embedded.driver.run_loop`, plus the samplers' supervision while a step waits."""

    def __init__(self, engine: EngineConfig, model_path: str, spec: TransportSpec):
        self.engine, self.model_path, self.spec = engine, model_path, spec
        self.transport = spec.open()
        clear_stop(self.transport)  # a previous run of this exchange stopped it
        hetero = engine.hetero
        # actors hold no CPU reservation: on a 2-core laptop the learner and samplers share the
        # cores (hetero.*_cpus pins them); custom resources place them on a cluster's nodes
        self.learner = ray.remote(num_cpus=0, concurrency_groups={"control": 1})(LearnerWorker).options(
            name=LEARNER_ACTOR, **_placement(hetero.learner_ray_resources)
        ).remote(engine, model_path, spec)
        # two threads: run() generates while counters() answers the driver
        self._sampler_cls = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)(SamplerWorker)
        self.samplers: dict[int, Any] = {}
        self.namespaces: dict[int, str] = {}
        self.runs: dict[Any, int] = {}
        self.keys_pending: dict[int, Any] = {}  # sampler -> its public key's ObjectRef, until it runs
        # the launched samplers' public keys (hetero.trust.sign_records), kept in the run directory
        self.enrolment_path = engine.settings.run_dir / ENROLMENT_FILE
        self.enrolment = Enrolment()
        self.restarts = {i: 0 for i in range(engine.hetero.num_samplers)}
        self.next_batch: dict[int, int] = {}
        self.failures = 0
        self.counters = _SamplerCounters()

    def _launch(self, i: int) -> None:
        # named, so an operator (or a fault-injection test) can find and kill a sampler
        self.namespaces[i] = f"s{i}-{uuid.uuid4().hex[:8]}"
        self.samplers[i] = self._sampler_cls.options(
            name=sampler_actor_name(i, self.restarts[i]), **_placement(self.engine.hetero.sampler_ray_resources)
        ).remote(
            i, self.engine, self.model_path, self.spec, self.engine.hetero.speed_factors()[i], self.namespaces[i]
        )
        self.restarts[i] += 1
        # its key is made where it runs; it generates once _start_ready has recorded the public half
        self.keys_pending[i] = self.samplers[i].public_key.remote()

    def _start_ready(self, bar_write) -> None:
        """Launched samplers whose public key has arrived: the key goes into the run directory's
        enrolment (so a learner resumed after a crash still accepts the groups they leave in
        flight) and to the learner, and only then does the sampler run (it waits for the
        learner's enrolment before it sends anything)."""
        if not self.keys_pending:
            return
        ready, _ = ray.wait(list(self.keys_pending.values()), timeout=0, num_returns=len(self.keys_pending))
        for i in [i for i, ref in self.keys_pending.items() if ref in ready]:
            ref = self.keys_pending.pop(i)
            try:
                public_hex = ray.get(ref)
            except Exception as err:  # noqa: BLE001 - died while starting: restarted like any failure
                self._restart(i, err, bar_write)
                continue
            enrolled = None
            if public_hex is not None:  # hetero.trust.sign_records
                self.enrolment.enrol(f"sampler-{i}", public_hex)
                self.enrolment.save(self.enrolment_path)
                enrolled = self.learner.enrol.remote(f"sampler-{i}", public_hex)
            self.runs[self.samplers[i].run.remote(self.next_batch[i], enrolled=enrolled)] = i

    def start(self, checkpoint: Optional[dict]) -> int:
        # the samplers this run launched before a crash (fresh run: none; the file is rewritten)
        self.enrolment = Enrolment.load(self.enrolment_path) if checkpoint is not None else Enrolment()
        self.enrolment_path.parent.mkdir(parents=True, exist_ok=True)
        version = ray.get(self.learner.start.remote(checkpoint, self.enrolment.to_json()))
        start = 0 if checkpoint is None else int(checkpoint["step"])
        self.next_batch = {i: start * 1000 for i in range(self.engine.hetero.num_samplers)}  # fresh prompts after a resume
        return version

    def _launch_all(self) -> None:
        # at the first step, after the initial evaluation: samplers started during it only slow
        # it down on shared cores, and the soak (scripts/soak.py) showed that samplers killed
        # while still starting, plus version 0 re-sent with a skewed clock, stall the learner at
        # version 0 for good (it needs a first batch to publish a version the samplers can see)
        for i in range(self.engine.hetero.num_samplers):
            self._launch(i)

    def _check_samplers(self, bar_write) -> None:
        """A sampler whose run() returned before the stop marker died (or was killed)."""
        finished, _ = ray.wait(list(self.runs), timeout=0, num_returns=len(self.runs)) if self.runs else ([], [])
        for ref in finished:
            i = self.runs.pop(ref)
            try:
                ray.get(ref)
            except Exception as err:  # noqa: BLE001 - any actor failure is reported the same way
                self._restart(i, err, bar_write)

    def _restart(self, i: int, err: Exception, bar_write) -> None:
        self.failures += 1
        bar_write(f"[heterorl] sampler-{i} failed ({type(err).__name__}); restarting it")
        # unreachable is not dead (ActorUnavailableError across a cut link): end it for
        # good, so it does not keep generating beside its replacement when the link heals
        try:
            ray.kill(self.samplers[i], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        # its announced groups will never come: the learner must not wait for them
        clear_topic(self.transport, EXPECTED_TOPIC, prefix=f"{self.namespaces[i]}-")
        self.next_batch[i] += 1000  # a restarted sampler draws fresh prompts
        self._launch(i)

    def step(self, step: int) -> dict[str, float]:
        hetero = self.engine.hetero
        status_every = min(30.0, hetero.wait_timeout_s / 3)  # how often a blocked learner is reported
        if not self.samplers:
            self._launch_all()
        pending = self.learner.step.remote(step)
        waiting_since, next_status = time.monotonic(), status_every
        while True:
            ready, _ = ray.wait([pending], timeout=0.5)
            waited = time.monotonic() - waiting_since
            if not ready and waited >= next_status:
                tqdm.write(
                    f"[heterorl] step {step + 1}: waiting for rollouts for {waited:.0f}s "
                    f"({len(self.runs)} sampler(s) running; the learner fails after "
                    f"hetero.wait_timeout_s={hetero.wait_timeout_s:g})"
                )
                next_status += status_every
            self._start_ready(tqdm.write)
            self._check_samplers(tqdm.write)
            if ready:
                break
        metrics = ray.get(pending)
        metrics["hetero/sampler_failures"] = float(self.failures)
        metrics.update(self.counters.update(self.samplers))
        return metrics

    def evaluate(self, seed: int) -> dict[str, float]:
        return ray.get(self.learner.evaluate.remote(seed))

    def drain_events(self) -> list[dict]:
        return ray.get(self.learner.drain_events.remote())

    def checkpoint_state(self) -> dict[str, Any]:
        return ray.get(self.learner.checkpoint_state.remote())

    def acknowledge(self, buffer_state: dict) -> int:
        return ray.get(self.learner.acknowledge.remote(buffer_state))

    def ledger_counts(self) -> dict[str, int]:
        return ray.get(self.learner.ledger_counts.remote())

    def shutdown(self) -> None:
        # samplers stop on the marker even if the learner actor is gone (the driver writes it too)
        request_stop(self.transport)
        try:
            ray.get(self.learner.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - a dead learner must not keep the samplers running
            pass
        for actor in self.samplers.values():
            ray.kill(actor)


def _worker_env() -> dict[str, str]:
    import os
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[3])
    path = os.environ.get("PYTHONPATH", "")
    env = {"PYTHONPATH": repo + (os.pathsep + path if path else "")}
    if os.environ.get("OMP_NUM_THREADS"):
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    return env


def run_async(engine: EngineConfig, model_path: str, logger: MetricLogger) -> dict[str, float]:
    """Train for ``trainer.total_training_steps`` learner steps with real learner and sampler actors."""
    hetero = engine.hetero
    # the driver on the system cores before ray.init, so the GCS, raylet and mailbox it starts
    # inherit them and stay off the learner's cores (the actors re-pin themselves)
    with Pinned(system_cores(hetero), "hetero.system_cpus"):
        return _run_async(engine, model_path, logger)


def system_cores(hetero: HeteroConfig) -> list[int]:
    """``hetero.system_cpus``, or by default the machine's cores not in ``learner_cpus`` (none of
    them pinned when ``learner_cpus`` is empty)."""
    if hetero.system_cpus or not hetero.learner_cpus:
        return list(hetero.system_cpus)
    rest = [c for c in machine_cpus() if c not in hetero.learner_cpus]
    return rest or list(hetero.learner_cpus)  # a one-core machine: nowhere else to go


@contextlib.contextmanager
def ray_session(hetero: HeteroConfig) -> Iterator[None]:
    """Ray for an async run, started the one way every caller shares (the run itself, the soak,
    the WAN scripts): nothing if Ray is already up in this process; else join the cluster at
    ``hetero.ray_address`` (the actors import this repo, so its root goes on their path), or start
    a local instance. Shut down on exit only if started here."""
    if ray.is_initialized():
        yield
        return
    if hetero.ray_address:
        ray.init(address=hetero.ray_address, log_to_driver=False, logging_level="ERROR",
                 runtime_env={"env_vars": _worker_env()})  # fmt: skip
    else:
        ray.init(num_cpus=max(2, hetero.num_samplers + 1), include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _run_async(engine: EngineConfig, model_path: str, logger: MetricLogger) -> dict[str, float]:
    runtime = None
    with ray_session(engine.hetero):
        try:
            runtime = RemoteRuntime(engine, model_path, transport_spec(engine.hetero, engine.settings))
            return run_loop(runtime, engine, logger, desc="async")
        finally:
            if runtime is not None:
                runtime.shutdown()
