"""A sampler pool for the verl engine, on its own machines and its own Ray cluster.

    python -m recipe.gepo.pool --index 32 --key pool-32.key [--max-batches N] <the learner's overrides>

It composes the learner's config (give it the learner's overrides: preset, task, delay, seed,
``hetero.engine=verl hetero.transport=fs hetero.transport_url=URL``), starts verl's rollout servers,
reward loop and agent loop with no trainer, and loops: load the newest weight version its delay
stream lets it see (``hetero.delay``, seconds, stream of ``--index``), claim batch b, draw its
prompts (a pure function of seed, index and b), generate G responses each with rewards computed
here, sign each group and send it to the exchange. A restart resumes after the last claimed batch.
The learner side is :mod:`.verl_engine.pool_ingress`. Weights reach the servers through verl's
checkpoint engine (ran with ``hf_cpu``; vLLM and SGLang pools have never run).
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from typing import Any, Callable, Optional, Sequence

import numpy as np
from omegaconf import DictConfig, OmegaConf, open_dict

from .remote_sampler import compose_config
from verl_ext.hetero.sampler_loop import SamplerLoop
from verl_ext.hetero.seeding import MAX_SAMPLERS

POOL_BACKENDS = ("hf_cpu", "vllm", "sglang")
"""Rollout back ends a pool serves; their servers take the exchange's weights through verl's own
checkpoint engine (:func:`weight_source_class`). Only ``hf_cpu`` has run (CPU); vLLM and SGLang never."""
NEVER_RAN = ("vllm", "sglang")
POOL_WEIGHT_BACKEND = "ray_mailbox"
"""The checkpoint engine between a pool's weight source and its servers: node-local, any device."""


def weight_source_class():
    """A verl ``Worker`` that stands where verl's actor worker group would in
    ``CheckpointEngineManager.update_weights``: it sends the version the pool fetched from the
    exchange (``set_state``) through the checkpoint engine, so each server loads it by its own
    weight-update path (hf_cpu's ``update_weights``; vLLM's ``update_weights_from_ipc``)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register

    class ExchangeWeightSource(Worker):
        def __init__(self, backend: str, bucket_bytes: int):
            super().__init__()
            self.engine = CheckpointEngineRegistry.new(backend, bucket_size=bucket_bytes, is_master=self.rank == 0)
            self.state: dict = {}

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def set_state(self, state: dict) -> None:
            self.state = state

        @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
        def execute_checkpoint_engine(self, method: str, *args, **kwargs):
            return getattr(self.engine, method)(*args, **kwargs)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
        async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
            return await self.engine.send_weights(iter(self.state.items()), global_steps=global_steps)

    return ExchangeWeightSource


def pool_id(index: int) -> str:
    return f"pool-{index}"


def check_pool_config(cfg: DictConfig, index: int, key_file: Optional[str]) -> None:
    """The settings a pool needs; ValueError naming the key (or flag) otherwise."""
    hetero = cfg.hetero
    if hetero.engine != "verl" or hetero.transport != "fs":
        raise ValueError(
            f"hetero.engine={hetero.engine!r}, hetero.transport={hetero.transport!r}: a pool feeds a verl-engine "
            "learner through an exchange (hetero.engine=verl hetero.transport=fs)"
        )
    if not hetero.transport_url:
        raise ValueError("hetero.transport_url is empty: give the exchange URL the learner uses")
    if not 1 <= index < MAX_SAMPLERS:
        raise ValueError(f"--index {index}: must be in [1, {MAX_SAMPLERS}) (the seed layout's sampler slots)")
    name = cfg.actor_rollout_ref.rollout.name
    if name not in POOL_BACKENDS:
        raise ValueError(f"actor_rollout_ref.rollout.name={name!r}: a pool serves {POOL_BACKENDS}")
    if hetero.trust.sign_records and not key_file:
        raise ValueError(
            f"hetero.trust.sign_records=true: give --key <file> (python -m verl_ext.trust.signing keygen <file> "
            f"{pool_id(index)}, then enrol its public key in the learner's hetero.trust.enrolment_file)"
        )


class Pool(SamplerLoop):
    """One pool: verl's rollout side without a trainer, in :class:`SamplerLoop`."""

    WAIT_POLL_S = 0.2

    def __init__(self, settings: DictConfig, index: int, key: Any, speed_factor: float = 1.0):
        from verl.experimental.agent_loop import AgentLoopManager
        from verl.experimental.reward_loop import RewardLoopManager
        from verl.utils import hf_tokenizer
        from verl.utils.dataset.rl_dataset import RLHFDataset
        from verl.workers.rollout.llm_server import LLMServerManager

        from .sections import HeteroConfig
        from verl_ext.hetero.delay_channel import DelayChannel
        from verl_ext.hetero.protocol import WEIGHTS_DELTA_TOPIC, WEIGHTS_TOPIC, TransportSpec, sampler_progress
        from verl_ext.hetero.seeding import sampler_stream
        from verl_ext.hetero.weights import WeightStore

        self.cfg, self.index = settings, index
        self.hetero = hetero = HeteroConfig.from_omegaconf(settings.hetero)
        self.url = hetero.exchange_url(settings.trainer.default_local_dir)
        transport = TransportSpec("fsspec", url=self.url).open()
        channel = DelayChannel(
            transport,
            hetero.delay.build(),
            seed=hetero.seed,
            stream=sampler_stream(index),
            speed_factor=speed_factor,
            topics=[WEIGHTS_TOPIC, WEIGHTS_DELTA_TOPIC],
        )
        self.init_loop(
            transport,
            WeightStore(channel, **hetero.weight_store_options()),
            pool_id(index),
            f"r{index}-{uuid.uuid4().hex[:8]}",  # a restart never reuses a group uid
            speed_factor=speed_factor,
            key=key,
            **hetero.sampler_loop_options(),
        )
        progress = sampler_progress(transport, self.sampler_id)
        self.next_batch = progress.next_batch if progress is not None else 0  # resume after the last claim
        self.tokenizer = hf_tokenizer(settings.actor_rollout_ref.model.path)
        self.dataset = RLHFDataset(str(settings.data.train_files), self.tokenizer, settings.data)
        self._dataset_index: Optional[dict[tuple[int, ...], int]] = None  # prompt ids -> row (made on first need)
        self._taken_back: list[str] = []  # re-issue records whose prompts are in the batch being made
        self.llm = LLMServerManager.create(config=settings)
        self.weight_sync = self._weight_sync(settings)
        self.rewards = RewardLoopManager(config=settings)
        self.agent = AgentLoopManager.create(
            config=settings,
            llm_client=self.llm.get_client(),
            reward_loop_worker_handles=self.rewards.reward_loop_worker_handles,
        )

    def _weight_sync(self, settings: DictConfig) -> Any:
        """verl's ``CheckpointEngineManager`` from a one-rank :func:`weight_source_class` group to
        this pool's replicas."""
        import ray
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl.utils.config import omega_conf_to_dataclass

        ce_cfg = omega_conf_to_dataclass(settings.actor_rollout_ref.rollout.checkpoint_engine)
        source_cls = RayClassWithInitArgs(
            cls=ray.remote(weight_source_class()),
            backend=ce_cfg.backend,
            bucket_bytes=int(ce_cfg.update_weights_bucket_megabytes) << 20,
        )
        resources = RayResourcePool(process_on_nodes=[1], use_gpu=False, name_prefix="pool_weights")
        self.weight_source = RayWorkerGroup(
            resource_pool=resources, ray_cls_with_init=source_cls, device_name="cpu", name_prefix="pool_weights"
        )
        return CheckpointEngineManager(config=ce_cfg, actor_wg=self.weight_source, replicas=self.llm.get_replicas())

    def load_weights(self, version: int, state: dict) -> None:
        """Into every server of every replica through verl's own weight-update path (abort,
        release the cache, send, receive, resume); the version tags the outputs."""
        self.weight_source.set_state(state)
        self.weight_sync.update_weights(global_steps=version)
        self.weight_source.set_state({})

    def prompts(self, batch_index: int) -> Any:
        """The prompts of batch ``batch_index``: those the learner gave back first, the rest a pure
        function of (seed, index, batch)."""
        from verl import DataProto
        from verl.utils.dataset.rl_dataset import collate_fn

        n = int(self.cfg.data.train_batch_size)
        rng = np.random.default_rng([self.hetero.seed, self.index + 1, batch_index])
        picks = rng.choice(len(self.dataset), size=n, replace=len(self.dataset) < n)
        given_back = self._prompts_given_back(n)  # first: they went stale once already
        picks = [row for _, row in given_back] + [int(i) for i in picks[: n - len(given_back)]]
        self._taken_back = [key for key, _ in given_back]
        return DataProto.from_single_dict(collate_fn([self.dataset[int(i)] for i in picks]))

    def _prompts_given_back(self, n: int) -> list[tuple[str, int]]:
        """Up to ``n`` prompts the learner gave back to this pool (``hetero.reissue_stale_prompts``),
        as (record key, dataset row). A prompt not in this pool's ``data.train_files`` is dropped
        with one line naming it."""
        from .verl_engine.pool_groups import chat_prompt_ids
        from verl_ext.hetero.protocol import REISSUE_TOPIC, reissues_for

        out = []
        for key, record in reissues_for(self.transport, self.sampler_id)[:n]:
            if self._dataset_index is None:
                self._dataset_index = {
                    tuple(chat_prompt_ids(self.tokenizer, self.dataset[i]["raw_prompt"])): i
                    for i in range(len(self.dataset))
                }  # fmt: skip
            row = self._dataset_index.get(tuple(record.prompt_ids))
            if row is None:
                print(
                    f"[pool {self.index}] {REISSUE_TOPIC}/{key}: a prompt not in data.train_files, dropped", flush=True
                )
                self.transport.delete(REISSUE_TOPIC, key)
                continue
            out.append((key, row))
        return out

    def generate_batch(self, batch_index: int) -> list:
        from .verl_engine.pool_groups import PRECISION_OF_DTYPE, groups_from_agent_output

        g = int(self.cfg.actor_rollout_ref.rollout.n)
        batch = self.prompts(batch_index)
        uids = [f"{self.launch}-b{batch_index}-{i}" for i in range(len(batch))]
        batch.non_tensor_batch["uid"] = np.array(uids, dtype=object)
        out = self.agent.generate_sequences(batch.repeat(repeat_times=g, interleave=True))
        precision = PRECISION_OF_DTYPE.get(str(self.cfg.actor_rollout_ref.rollout.dtype))
        return groups_from_agent_output(out, g, uids, self.sampler_id, precision)

    def on_weights_loaded(self, version: int) -> None:
        age = self.version_age_s()
        print(f"[pool {self.index}] version {version} loaded" + ("" if age is None else f", {age:.1f} s after it was published"),
              flush=True)  # fmt: skip

    def on_batch_sent(self, batch_index: int, groups: list) -> None:
        from verl_ext.hetero.protocol import REISSUE_TOPIC

        if self._taken_back:  # their prompts went out again: done (a crash before this redoes them)
            self.transport.delete_many(REISSUE_TOPIC, self._taken_back)
        rewards = np.mean([group.rewards.mean() for group in groups])
        age = self.version_age_s()
        print(f"[pool {self.index}] batch {batch_index}: {len(groups)} groups, version {self.version}"
              + ("" if age is None else f" (published {age:.1f} s before)")
              + (f", {len(self._taken_back)} of them given back" if self._taken_back else "")
              + f", mean reward {rewards:.3f}", flush=True)  # fmt: skip
        self._taken_back = []

    def run(self, max_batches: int | None = None) -> dict[str, Any]:
        start = self.next_batch
        counters = super().run(start, max_batches)
        return dict(counters, version=self.version, launch=self.launch, first_batch=start)


def run_pool(
    cfg: DictConfig,
    index: int,
    key_file: Optional[str],
    max_batches: Optional[int],
    speed_factor: float = 1.0,
    make_pool: Optional[Callable[..., "Pool"]] = None,
) -> dict[str, float]:
    """Validate, start this pool's own Ray cluster and generate (see the module docstring).
    ``make_pool(settings, index, key, speed_factor)``: :class:`Pool` (default) or a subclass's
    builder (the soak's lying pools, research/soak/pool_liars.py)."""
    import copy

    import ray
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    from .verl_engine.launch_plan import engine_settings
    from .verl_engine.runner import resolve_task_files
    from verl_ext.trust.signing import SamplerKey

    check_pool_config(cfg, index, key_file)
    key = None
    if key_file and cfg.hetero.trust.sign_records:
        try:
            key = SamplerKey.load(key_file)
        except (OSError, ValueError) as err:
            raise ValueError(f"--key {key_file}: {err}") from None
        if key.sampler_id != pool_id(index):
            raise ValueError(f"--key {key_file} is {key.sampler_id!r}'s key; this is {pool_id(index)}")
    settings = engine_settings(resolve_task_files(cfg))
    OmegaConf.resolve(settings)
    with open_dict(settings):  # between this pool's weight source and its servers: node-local
        settings.actor_rollout_ref.rollout.checkpoint_engine.backend = POOL_WEIGHT_BACKEND
    name = settings.actor_rollout_ref.rollout.name
    if name in NEVER_RAN:
        print(f"[pool {index}] note: rollout.name={name} has never run in a pool (only hf_cpu has)", flush=True)
    if cfg.hetero.dry_run:
        print(
            f"[pool {index}] config ok (dry run): exchange {cfg.hetero.transport_url}, "
            f"max_delay={cfg.hetero.max_delay}, {cfg.data.train_batch_size} prompts a batch",
            flush=True,
        )
        return {}
    runtime_env = copy.deepcopy(get_ppo_ray_runtime_env(settings))
    ray_init = dict(settings.get("ray_kwargs", {}).get("ray_init", {}) or {})
    ray.init(
        num_cpus=ray_init.get("num_cpus"),
        num_gpus=ray_init.get("num_gpus"),
        runtime_env=runtime_env,
        include_dashboard=False,
    )
    try:
        pool = (make_pool or Pool)(settings, index, key, speed_factor)
        print(f"[pool {index}] up: exchange {pool.url}, launch {pool.launch}, starting at batch {pool.next_batch}",
              flush=True)  # fmt: skip
        return pool.run(max_batches)
    finally:
        ray.shutdown()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--index", type=int, required=True, help=f"this pool's index, in [1, {MAX_SAMPLERS})")
    parser.add_argument("--key", default=None, help="this pool's signing key (python -m verl_ext.trust.signing keygen)")
    parser.add_argument("--max-batches", type=int, default=None, help="stop after this many batches")
    parser.add_argument("--speed-factor", type=float, default=1.0, help="emulate slower hardware (>= 1)")
    parser.add_argument("overrides", nargs="*", help="hydra overrides: the learner's")
    args = parser.parse_args(argv)
    overrides = ["hetero.engine=verl", "hetero.transport=fs", *args.overrides]
    try:
        cfg = compose_config(overrides)
        counters = run_pool(cfg, args.index, args.key, args.max_batches, args.speed_factor)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"pool": args.index, **counters}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
