"""Async mode: one learner actor and N sampler actors on Ray, exchanging through a transport.

Weights: the learner publishes every new version to a ``WeightStore``; each sampler reads it
through its own ``DelayChannel``, so version v becomes visible to sampler i only after a delay
drawn for (i, v) (seconds, times the sampler's speed factor); the sampler always takes the newest
version it can see. Rollouts: samplers send finished groups (rewards and advantages computed
locally) over the same transport; a thread in the learner moves them into the staleness-bounded
``RolloutBuffer``; the learner takes whole groups within ``max_delay`` versions.

The transport is Ray's object store (``hetero.transport=ray``) or an fsspec URL
(``hetero.transport=fs``); on an fsspec URL any process that builds a :class:`SamplerWorker` on
the same URL joins, which is how a sampler in another data centre takes part.

The driver (this process) owns logging, evaluation, checkpoints and the progress bar; it
notices a dead sampler, reports it and restarts it (it rejoins with the newest weights it can see).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import asdict
from typing import Any, Optional

import ray
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from recipe.gepo.hetero_config import HeteroConfig
from recipe.gepo.local.learner import Learner
from recipe.gepo.local.policy import load_policy
from recipe.gepo.local.rollout import RolloutSettings, generate_groups
from recipe.gepo.local.run_utils import MetricLogger, RunSettings, load_latest_checkpoint, save_checkpoint, truncate_metrics
from recipe.gepo.local.tasks import Task, TaskConfig
from verl_ext.hetero.buffer import RolloutBuffer
from verl_ext.hetero.delay_channel import DelayChannel
from verl_ext.hetero.exchange import ROLLOUT_TOPIC, RolloutInbox, send_group
from verl_ext.hetero.records import RecordSpec
from verl_ext.hetero.transport import CorruptMessage, make_transport
from verl_ext.hetero.weights import WeightStore, version_key
from verl_ext.torch_threads import set_torch_threads

CONTROL_TOPIC = "control"
STOP_KEY = "stop"
STATUS_KEY = "learner-status"  # {"version": v, "queue_depth": n}, for back-pressure


def transport_spec(hetero: HeteroConfig, settings: RunSettings) -> dict[str, Any]:
    """How every process reaches the shared transport (picklable)."""
    if hetero.transport == "fs":
        url = hetero.transport_url or str((settings.run_dir / "exchange").resolve())
        return {"kind": "fsspec", "url": url}
    return {"kind": "ray", "name": f"heterorl-mailbox-{settings.experiment_name}-{hetero.seed}"}


def open_transport(spec: dict[str, Any]):
    kwargs = {k: v for k, v in spec.items() if k != "kind"}
    return make_transport(spec["kind"], **kwargs)


def _actor_and_algo_configs(cfg_container: dict) -> tuple[Any, Any]:
    from verl.utils.config import omega_conf_to_dataclass

    cfg = OmegaConf.create(cfg_container)
    return omega_conf_to_dataclass(cfg.actor_rollout_ref.actor), omega_conf_to_dataclass(cfg.algorithm)


class SamplerWorker:
    """Generates rollout groups with the newest weights its delay lets it see, until told to stop."""

    def __init__(
        self, index: int, cfg_container: dict, model_path: str, transport: dict, speed_factor: float, uid_namespace: str
    ):
        set_torch_threads(1)  # OMP_NUM_THREADS wins when set
        cfg = OmegaConf.create(cfg_container)
        self.index, self.sampler_id = index, f"sampler-{index}"
        self.uid_namespace = uid_namespace  # unique per launch: a restarted sampler never reuses a uid
        self.hetero = HeteroConfig.from_omegaconf(cfg.hetero)
        self.settings = RunSettings.from_config(cfg)
        self.task = Task(TaskConfig.from_omegaconf(cfg.task), self.hetero.seed)
        _, self.algorithm_config = _actor_and_algo_configs(cfg_container)
        self.rollout = RolloutSettings(self.settings.group_size, self.settings.temperature, self.settings.max_new_tokens)
        self.model, self.tokenizer = load_policy(model_path)
        self.model.eval()
        self.transport = open_transport(transport)
        channel = DelayChannel(
            self.transport, self.hetero.delay.build(), seed=self.hetero.seed, stream=index,
            speed_factor=speed_factor, topics=["weights"],
        )  # fmt: skip
        self.weights = WeightStore(channel, keep_last=self.hetero.keep_weight_versions)
        # what exists, undelayed: only the version numbers are read from it, never the weights
        self.published = WeightStore(self.transport, keep_last=self.hetero.keep_weight_versions)
        self.speed_factor = speed_factor
        self.version = -1
        self.stats = {"batches": 0, "groups": 0, "tokens": 0, "gen_s": 0.0, "weight_loads": 0,
                      "stale_wait_s": 0.0, "queue_wait_s": 0.0}

    def _refresh_weights(self) -> None:
        newest = self.weights.latest(newer_than=self.version if self.version >= 0 else None)
        if newest is not None:
            self.version, state = newest
            self.model.load_state_dict(state)
            self.stats["weight_loads"] += 1

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
        try:
            status = json.loads(self.transport.get(CONTROL_TOPIC, STATUS_KEY))
        except (KeyError, CorruptMessage, ValueError):
            return False  # not published yet, or being rewritten: do not stall on it
        return int(status.get("queue_depth", 0)) >= self.hetero.max_queued_groups

    def stopped(self) -> bool:
        return STOP_KEY in self.transport.keys(CONTROL_TOPIC)

    def run(self, start_batch: int = 0, max_batches: Optional[int] = None) -> dict[str, float]:
        """Generate until the stop marker appears (or ``max_batches``); returns counters."""
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
                t0 = time.perf_counter()
                time.sleep(0.05)
                self.stats[wait] += time.perf_counter() - t0
                continue
            items = self.task.train_items(self.settings.prompts_per_step, stream=self.index + 1, index=batch_index)
            t0 = time.perf_counter()
            groups = generate_groups(
                self.model, self.tokenizer, items, self.task.score, self.rollout, self.algorithm_config,
                policy_version=self.version, sampler_id=self.sampler_id,
                seed=(self.hetero.seed * 1_000_003 + batch_index) * 64 + self.index,
                uid_prefix=f"{self.uid_namespace}-b{batch_index}",
            )  # fmt: skip
            gen_s = time.perf_counter() - t0
            if self.speed_factor > 1:
                time.sleep(gen_s * (self.speed_factor - 1))  # slower hardware: same work takes longer
            for group in groups:
                send_group(self.transport, group)
            self.stats["batches"] += 1
            self.stats["groups"] += len(groups)
            self.stats["tokens"] += sum(int(g.response_mask.sum()) for g in groups)
            self.stats["gen_s"] += gen_s
            batch_index += 1
        return dict(self.stats, next_batch=batch_index)

    def counters(self) -> dict[str, float]:
        return dict(self.stats)


class LearnerWorker:
    """The learner: consumes whole groups within the staleness bound, updates, publishes weights."""

    def __init__(self, cfg_container: dict, model_path: str, transport: dict):
        set_torch_threads(1)  # OMP_NUM_THREADS wins when set
        cfg = OmegaConf.create(cfg_container)
        self.hetero = HeteroConfig.from_omegaconf(cfg.hetero)
        self.settings = RunSettings.from_config(cfg)
        self.task = Task(TaskConfig.from_omegaconf(cfg.task), self.hetero.seed)
        actor_config, _ = _actor_and_algo_configs(cfg_container)
        self.model, self.tokenizer = load_policy(model_path)
        self.learner = Learner(
            self.model, actor_config, self.settings.temperature, self.tokenizer.pad_token_id,
            max_nonfinite_steps=self.hetero.max_nonfinite_steps,
        )  # fmt: skip
        self.transport = open_transport(transport)
        self.buffer = RolloutBuffer(
            max_delay=self.hetero.max_delay, stale_policy=self.hetero.stale_policy, order=self.hetero.order,
            spec=RecordSpec(group_size=self.settings.group_size, reward_range=self.task.reward_range),
            wait_timeout_s=self.hetero.wait_timeout_s,
        )  # fmt: skip
        inbox_transport = self.transport
        if self.hetero.delay_rollouts:
            inbox_transport = DelayChannel(
                self.transport, self.hetero.delay.build(), seed=self.hetero.seed + 1, stream=0, topics=["rollouts"]
            )
        self.inbox = RolloutInbox(inbox_transport, self.buffer)
        self.weights = WeightStore(
            self.transport, keep_last=self.hetero.keep_weight_versions,
            wire_dtype="bf16" if self.hetero.weights_bf16 else None,
        )  # fmt: skip
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_loop, daemon=True)

    def start(self, checkpoint: Optional[dict] = None) -> int:
        """Restore a checkpoint if given, publish the current weights, start receiving rollouts."""
        if checkpoint is not None:
            self.learner.load_state_dict(checkpoint["learner"])
            self.buffer.load_state_dict(checkpoint["buffer"])
        else:
            # a fresh run on a used exchange: the previous run's rollouts are not ours
            for key in self.transport.keys(ROLLOUT_TOPIC):
                self.transport.delete(ROLLOUT_TOPIC, key)
        # versions newer than ours (published after the checkpoint we resume from, or by a
        # previous run) would look like the future to samplers and to the buffer
        for version in self.weights.versions():
            if version > self.learner.version:
                self.transport.delete(self.weights.topic, version_key(version))
        self.buffer.set_learner_version(self.learner.version)
        self.weights.publish(self.learner.version, self.model.state_dict())
        self._publish_status()
        self._poller.start()
        return self.learner.version

    def _publish_status(self) -> None:
        if self.hetero.max_queued_groups > 0:
            status = {"version": self.learner.version, "queue_depth": len(self.buffer)}
            self.transport.put(CONTROL_TOPIC, STATUS_KEY, json.dumps(status).encode())

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            self.inbox.poll()
            time.sleep(0.02)

    def step(self) -> dict[str, float]:
        """Take one batch of groups (blocking within the bound), update, publish."""
        t0 = time.perf_counter()
        groups = self.buffer.take(self.settings.prompts_per_step, learner_version=self.learner.version)
        waited = time.perf_counter() - t0
        metrics = self.learner.train_step(groups)
        # the buffer must accept groups made with version v before any sampler can load v
        self.buffer.set_learner_version(self.learner.version)
        self.weights.publish(self.learner.version, self.model.state_dict())
        self._publish_status()
        step_s = time.perf_counter() - t0
        metrics.update(self.buffer.metrics())
        metrics.update({"perf/step_s": step_s, "perf/learner_idle_frac": waited / max(step_s, 1e-9)})
        metrics.update({f"hetero/inbox_{k}": float(v) for k, v in self.inbox.stats.items()})
        return metrics

    def evaluate(self, seed: int) -> dict[str, float]:
        return self.task.evaluate(self.model, self.tokenizer, self.settings.max_new_tokens, seed=seed)

    def checkpoint_state(self) -> dict[str, Any]:
        return {"learner": self.learner.state_dict(), "buffer": self.buffer.state_dict()}

    def acknowledge(self, buffer_state: dict) -> int:
        """After a checkpoint is durable: delete the rollouts it accounts for from the transport."""
        return self.inbox.acknowledge(buffer_state)

    def ledger_counts(self) -> dict[str, int]:
        return self.buffer.ledger.counts()

    def shutdown(self) -> None:
        self._stop.set()
        self.transport.put(CONTROL_TOPIC, STOP_KEY, b"stop")
        if self._poller.is_alive():
            self._poller.join(timeout=5)


class _SamplerCounters:
    """Sums over all samplers: response tokens per wall-clock second since the last update, and
    the seconds samplers have waited for weights within the bound (``sampler_skip_stale``) and
    for room in the learner's queue (``max_queued_groups``)."""

    def __init__(self):
        self._counters: dict[Any, dict] = {}
        self._last = time.perf_counter()

    def update(self, samplers: dict[int, Any]) -> dict[str, float]:
        total_new = 0.0
        for actor in samplers.values():
            try:
                counters = ray.get(actor.counters.remote(), timeout=5.0)
            except Exception:  # noqa: BLE001 - a dead or busy sampler contributes nothing this step
                continue
            total_new += float(counters["tokens"]) - float(self._counters.get(actor, {}).get("tokens", 0.0))
            self._counters[actor] = counters
        now = time.perf_counter()
        rate = total_new / max(now - self._last, 1e-9)
        self._last = now
        totals = {k: sum(float(c.get(k, 0.0)) for c in self._counters.values()) for k in ("stale_wait_s", "queue_wait_s")}
        return {"perf/sampler_tokens_per_s": rate, "perf/sampler_stale_wait_s_total": totals["stale_wait_s"],
                "perf/sampler_queue_wait_s_total": totals["queue_wait_s"]}  # fmt: skip


def run_async(
    cfg: DictConfig,
    hetero: HeteroConfig,
    settings: RunSettings,
    task_config: TaskConfig,
    model_path: str,
    logger: MetricLogger,
) -> dict[str, float]:
    """Train for ``settings.total_steps`` learner steps with real learner and sampler actors."""
    container = OmegaConf.to_container(cfg, resolve=True)
    spec = transport_spec(hetero, settings)
    started_ray = False
    if not ray.is_initialized():
        ray.init(num_cpus=max(2, hetero.num_samplers + 1), include_dashboard=False, log_to_driver=False)
        started_ray = True
    transport = open_transport(spec)
    if STOP_KEY in transport.keys(CONTROL_TOPIC):
        transport.delete(CONTROL_TOPIC, STOP_KEY)  # a previous run of this exchange stopped it

    checkpoint = load_latest_checkpoint(settings.run_dir) if settings.resume_mode == "auto" else None
    start = 0 if checkpoint is None else int(checkpoint["step"])
    if checkpoint is not None:
        truncate_metrics(logger.path, start)
    # actors hold no CPU reservation: on a 2-core laptop the learner and samplers share the cores
    learner = ray.remote(num_cpus=0)(LearnerWorker).options(name="heterorl-learner").remote(container, model_path, spec)
    ray.get(learner.start.remote(checkpoint))
    if checkpoint is None:
        logger.log(ray.get(learner.evaluate.remote(hetero.seed)), step=0)

    # two threads: run() generates while counters() answers the driver
    sampler_cls = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=2)(SamplerWorker)
    speeds = hetero.speed_factors()
    samplers: dict[int, Any] = {}
    runs: dict[Any, int] = {}
    next_batch = {i: start * 1000 for i in range(hetero.num_samplers)}  # fresh prompts after a resume
    failures = 0
    restarts = {i: 0 for i in range(hetero.num_samplers)}

    def launch(i: int) -> None:
        # named, so an operator (or a fault-injection test) can find and kill a sampler
        samplers[i] = sampler_cls.options(name=f"heterorl-sampler-{i}-{restarts[i]}").remote(
            i, container, model_path, spec, speeds[i], f"s{i}-{uuid.uuid4().hex[:8]}"
        )
        restarts[i] += 1
        runs[samplers[i].run.remote(next_batch[i])] = i

    for i in range(hetero.num_samplers):
        launch(i)

    sampler_counters = _SamplerCounters()
    status_every = min(30.0, hetero.wait_timeout_s / 3)  # how often a blocked learner is reported
    metrics: dict[str, float] = {}
    bar = tqdm(range(start, settings.total_steps), desc="async", initial=start, total=settings.total_steps)
    try:
        for step in bar:
            pending = learner.step.remote()
            waiting_since, next_status = time.monotonic(), status_every
            while True:
                ready, _ = ray.wait([pending], timeout=0.5)
                waited = time.monotonic() - waiting_since
                if not ready and waited >= next_status:
                    bar.write(
                        f"[heterorl] step {step + 1}: waiting for rollouts for {waited:.0f}s "
                        f"({len(runs)} sampler(s) running; the learner fails after "
                        f"hetero.wait_timeout_s={hetero.wait_timeout_s:g})"
                    )
                    next_status += status_every
                # a sampler whose run() returned before the stop marker died (or was killed)
                finished, _ = ray.wait(list(runs), timeout=0, num_returns=len(runs)) if runs else ([], [])
                for ref in finished:
                    i = runs.pop(ref)
                    try:
                        ray.get(ref)
                    except Exception as err:  # noqa: BLE001 - any actor failure is reported the same way
                        failures += 1
                        bar.write(f"[heterorl] sampler-{i} failed ({type(err).__name__}); restarting it")
                        next_batch[i] += 1000  # a restarted sampler draws fresh prompts
                        launch(i)
                if ready:
                    break
            metrics = ray.get(pending)
            done = step + 1
            metrics["hetero/sampler_failures"] = float(failures)
            metrics.update(sampler_counters.update(samplers))
            if (settings.test_freq > 0 and done % settings.test_freq == 0) or done == settings.total_steps:
                metrics.update(ray.get(learner.evaluate.remote(hetero.seed)))
            logger.log(metrics, step=done)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", stale=f"{metrics['hetero/staleness_mean']:.1f}")
            if (settings.save_freq > 0 and done % settings.save_freq == 0) or done == settings.total_steps:
                state = ray.get(learner.checkpoint_state.remote())
                save_checkpoint(settings.run_dir, done, {"step": done, **state})
                ray.get(learner.acknowledge.remote(state["buffer"]))
        metrics.update({f"hetero/ledger_{k}": float(v) for k, v in ray.get(learner.ledger_counts.remote()).items()})
    finally:
        # samplers stop on the marker even if the learner actor is gone (the driver writes it too)
        transport.put(CONTROL_TOPIC, STOP_KEY, b"stop")
        try:
            ray.get(learner.shutdown.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - a dead learner must not keep the samplers running
            pass
        for actor in samplers.values():
            ray.kill(actor)
        if started_ray:
            ray.shutdown()
    return metrics
