"""Async mode's sampler process: :class:`SamplerWorker`, a Ray actor launched by
:mod:`.supervisor` (or, on an fsspec exchange, a process anywhere: ``recipe/gepo/remote_sampler.py``).

It runs :class:`~verl_ext.hetero.sampler_loop.SamplerLoop` (the loop the verl engine's pools run
too: weights through its ``DelayChannel``, the skip-stale and back-pressure waits, claim, sign,
send) with HF ``generate`` on the learner's task: batch b's prompts are :meth:`Task.train_items`
(a pure function of seed, sampler and b), announced first under ``stale_policy=wait``, generated
and scored by :func:`.rollout_groups.generate_groups`. The learner side is :mod:`.learner_actor`.
"""

from __future__ import annotations

from typing import Any, Optional

from .async_shared import pin_worker, weight_store
from .engine_config import EngineConfig
from .model_placement import Placement
from .rollout_groups import RolloutSettings, generate_groups
from .tasks import Task
from verl_ext.trust.signing import SamplerKey
from verl_ext.hetero.delay_channel import DelayChannel
from verl_ext.hetero.protocol import WEIGHTS_DELTA_TOPIC, WEIGHTS_TOPIC, TransportSpec, announce
from verl_ext.hetero.records import RolloutGroup
from verl_ext.hetero.sampler_loop import SamplerLoop
from verl_ext.hetero.seeding import sampler_sampling_seed, sampler_stream
from verl_ext.trust.assignment import prompt_stream


class SamplerWorker(SamplerLoop):
    """The embedded engine's sampler: HF ``generate`` on the learner's task, in :class:`SamplerLoop`."""

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
        self.index, sampler_id = index, f"sampler-{index}"
        # hetero.trust.sign_records: signed with a key made here (or the remote sampler's key
        # file); the learner enrols its public half (RemoteRuntime._launch, or enrolment_file)
        if key is not None and key.sampler_id != sampler_id:
            raise ValueError(f"the key is {key.sampler_id!r}'s, this sampler is {sampler_id!r}")
        if key is None and engine.hetero.trust.sign_records:
            key = SamplerKey.generate(sampler_id)
        self.uid_namespace = uid_namespace  # unique per launch: a restart never reuses a uid
        self.hetero, self.settings, self.algorithm_config = engine.hetero, engine.settings, engine.algorithm
        self.rollout = RolloutSettings(
            self.settings.group_size, self.settings.temperature, self.settings.max_new_tokens
        )
        # hetero.device / hetero.sampler_precision (weights arrive as CPU tensors, copied there)
        self.model, self.tokenizer = Placement.of(engine.hetero).load_sampler(model_path)
        self.task = Task(engine.task, self.hetero.seed, self.tokenizer)
        self.model.eval()
        transport = spec.open()
        channel = DelayChannel(
            transport,
            self.hetero.delay.build(),
            seed=self.hetero.seed,
            stream=sampler_stream(index),
            speed_factor=speed_factor,
            topics=[WEIGHTS_TOPIC, WEIGHTS_DELTA_TOPIC],  # delta v: delayed as v
        )
        self.init_loop(
            transport,
            weight_store(self.hetero, channel),
            sampler_id,
            uid_namespace,
            speed_factor=speed_factor,
            key=key if engine.hetero.trust.sign_records else None,
            **self.hetero.sampler_loop_options(),
        )

    def load_weights(self, version: int, state: dict) -> None:
        self.model.load_state_dict(state)

    def generate_batch(self, batch_index: int) -> list[RolloutGroup]:
        """Batch b's groups (:meth:`assigned_groups`), announced first under ``stale_policy=wait``."""
        uid_prefix = f"{self.uid_namespace}-b{batch_index}"
        if self.hetero.stale_policy == "wait":  # the learner waits for these before they go stale
            for i in range(self.settings.prompts_per_step):
                announce(self.transport, f"{uid_prefix}-{i}", self.version, self.sampler_id)
        return self.assigned_groups(self.sampler_id, batch_index, uid_prefix, batch_index)

    def assigned_groups(self, sampler_id: str, batch: int, uid_prefix: str, seed_batch: int) -> list[RolloutGroup]:
        """``sampler_id``'s batch ``batch`` as the learner assigns it: its prompts (:meth:`Task.train_items`,
        a pure function of seed, sampler and batch) and, under checkable sampling, its Gumbel seeds;
        generated with the loaded version and scored. ``seed_batch``: the batch index of this
        sampler's own sampling seed (not checkable)."""
        items = self.task.train_items(self.settings.prompts_per_step, stream=prompt_stream(sampler_id), index=batch)
        return generate_groups(
            self.model,
            self.tokenizer,
            items,
            self.task.score,
            self.rollout,
            self.algorithm_config,
            policy_version=self.version,
            sampler_id=sampler_id,
            seed=sampler_sampling_seed(self.hetero.seed, seed_batch, self.index),
            uid_prefix=uid_prefix,
            checkable=self.hetero.trust.checkable_sampling,
            batch_index=batch,
            gumbel_key=self.gumbel_key,
        )

    def run(self, start_batch: int = 0, max_batches: Optional[int] = None, enrolled: Any = None) -> dict[str, float]:
        """Generate until the stop marker appears (or ``max_batches``); returns counters.
        ``enrolled``: the learner's enrolment of this sampler's key (a Ray object ref the run
        waits for, so no record is sent before the learner accepts its signature)."""
        return super().run(start_batch, max_batches)
