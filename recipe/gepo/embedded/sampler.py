"""Async mode's sampler process: :class:`SamplerWorker`, a Ray actor launched by
:mod:`.supervisor` (or, on an fsspec exchange, a process anywhere: ``recipe/gepo/remote_sampler.py``).

Its loop, one batch at a time: read the newest weights its ``DelayChannel`` lets it see (version
v becomes visible to sampler i only after the delay the run's delay schedule gives (v, sampler
i), seconds times its speed factor; under ``hetero.weight_sync=delta`` it applies deltas when a
few versions behind), wait while those weights are too stale (``sampler_skip_stale``) or the
learner's queue is full (``max_queued_groups``), take the prompts of batch index b
(:meth:`Task.train_items`, a pure function of seed, sampler and b), announce the groups
(``stale_policy=wait``), generate and score them (:func:`.rollout_groups.generate_groups`), and send each
group over the transport, signed under ``hetero.trust.sign_records``. The learner side that
receives them is :mod:`.learner_actor`.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from .async_shared import pin_worker, weight_store
from .engine_config import EngineConfig
from .model_placement import Placement
from .rollout_groups import RolloutSettings, generate_groups
from .tasks import Task
from verl_ext.trust.signing import SamplerKey
from verl_ext.hetero.delay_channel import DelayChannel
from verl_ext.hetero.exchange import send_group
from verl_ext.hetero.protocol import (
    CONTROL_TOPIC,
    STATUS_KEY,
    WEIGHTS_DELTA_TOPIC,
    WEIGHTS_TOPIC,
    LearnerStatus,
    TransportSpec,
    announce,
    claim_batch,
    read_record,
    stop_requested,
)
from verl_ext.hetero.records import RolloutGroup
from verl_ext.hetero.seeding import sampler_sampling_seed, sampler_stream
from verl_ext.hetero.weights import WeightStore


class SamplerWorker:
    """Generates rollout groups with the newest weights its delay lets it see, until told to stop."""

    WAIT_POLL_S = 0.1
    """Seconds between checks while waiting for newer weights or for room in the learner's queue."""

    WEIGHT_STATS = {
        "full_loads": "weight_full_loads",
        "delta_loads": "weight_delta_loads",
        "bytes_fetched": "weight_bytes_fetched",
        "delta_fallbacks": "weight_delta_fallbacks",
        "delta_larger": "weight_delta_larger",
    }
    """Weight store counter -> sampler stat: which path each load took (hetero.weight_sync)."""

    def __init__(
        self,
        index: int,
        engine: EngineConfig,
        model_path: str,
        spec: TransportSpec,
        speed_factor: float,
        uid_namespace: str,
        key: Optional[SamplerKey] = None,
    ):
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
        self.rollout = RolloutSettings(
            self.settings.group_size, self.settings.temperature, self.settings.max_new_tokens
        )
        # hetero.device / hetero.sampler_precision (weights arrive as CPU tensors, copied there)
        self.model, self.tokenizer = Placement.of(engine.hetero).load_sampler(model_path)
        self.task = Task(engine.task, self.hetero.seed, self.tokenizer)
        self.model.eval()
        self.transport = spec.open()
        channel = DelayChannel(
            self.transport,
            self.hetero.delay.build(),
            seed=self.hetero.seed,
            stream=sampler_stream(index),
            speed_factor=speed_factor,
            topics=[WEIGHTS_TOPIC, WEIGHTS_DELTA_TOPIC],  # delta v: delayed as v
        )
        self.weights = weight_store(self.hetero, channel)
        # what exists, undelayed: only the version numbers are read from it, never the weights
        self.published = WeightStore(self.transport, keep_last=self.hetero.keep_weight_versions)
        self.speed_factor = speed_factor
        self.version = -1
        self.stats = {
            "batches": 0,
            "groups": 0,
            "tokens": 0,
            "gen_s": 0.0,
            "weight_loads": 0,
            "stale_wait_s": 0.0,
            "queue_wait_s": 0.0,
            **{k: 0 for k in self.WEIGHT_STATS.values()},
        }

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
            # claimed before its prompts are drawn: a restart resumes after it (supervisor.py)
            claim_batch(self.transport, self.sampler_id, self.uid_namespace, batch_index)
            items = self.task.train_items(self.settings.prompts_per_step, stream=self.index + 1, index=batch_index)
            uid_prefix = f"{self.uid_namespace}-b{batch_index}"
            if self.hetero.stale_policy == "wait":  # the learner waits for these before they go stale
                for i in range(len(items)):
                    announce(self.transport, f"{uid_prefix}-{i}", self.version, self.sampler_id)
            t0 = time.perf_counter()
            groups = generate_groups(
                self.model,
                self.tokenizer,
                items,
                self.task.score,
                self.rollout,
                self.algorithm_config,
                policy_version=self.version,
                sampler_id=self.sampler_id,
                seed=sampler_sampling_seed(self.hetero.seed, batch_index, self.index),
                uid_prefix=uid_prefix,
                checkable=self.hetero.trust.checkable_sampling,
            )
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
        (research/soak/liars.py) change the group here."""
        send_group(self.transport, group, key=self.key)

    def counters(self) -> dict[str, float]:
        return dict(self.stats)
