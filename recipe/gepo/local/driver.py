"""The embedded engine's one driver loop, for replay and async mode alike.

Read top to bottom, a run is::

    checkpoint = latest checkpoint of the run dir (trainer.resume_mode=auto) or None
    runtime.start(checkpoint)                      # restore learner + buffer + source, publish v
    log the initial evaluation (fresh runs)
    for each learner step:
        batch   = source.next_batch(...)           # whole groups within the staleness bound
        metrics = learner.train_step(batch)        # (diagnostics first, when asked for)
        source.publish(weights, version)
        log; evaluate / checkpoint on trainer.test_freq / trainer.save_freq

The two modes differ only in their :class:`RolloutSource`: replay mode's
(:class:`recipe.gepo.local.replay.ReplaySource`) generates each batch in-process from a policy
snapshot ``tau`` versions old; async mode's (:class:`recipe.gepo.local.async_mode.TransportSource`)
receives groups from sampler actors over a transport. Everything else -- learner and buffer
construction, rollout correction, diagnostics, the wait policy, resume, the eval/save cadence --
is here, once, so every feature works in both modes or is refused at start by
:func:`check_supported` naming the key.

In async mode the :class:`LearnerRuntime` lives in a Ray actor (``LearnerWorker``) and the loop
drives it through a proxy with the same methods, which also supervises the samplers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch
from tqdm import tqdm

from recipe.gepo.hetero_config import HeteroConfig
from recipe.gepo.local.learner import Learner, collate_groups
from recipe.gepo.local.policy import load_policy, sample_groups, sequence_token_log_probs
from recipe.gepo.local.run_utils import MetricLogger, RunSettings
from recipe.gepo.local.tasks import Task, TaskConfig
from verl_ext.algos.importance import sequence_log_prob
from verl_ext.hetero.affinity import Pinned
from verl_ext.hetero.buffer import RolloutBuffer
from verl_ext.hetero.records import RecordSpec, RolloutGroup
from verl_ext.hetero.seeding import diagnostics_seed
from verl_ext.loss_bridge import rollout_correction_settings
from verl_ext.rundir import load_latest_checkpoint, save_checkpoint, truncate_metrics
from verl_ext.verl_plugin import loss_option


@dataclass
class EngineConfig:
    """Everything a learner or sampler process needs, typed: sent as is to Ray actors."""

    hetero: HeteroConfig
    """The ``hetero:`` section."""
    settings: RunSettings
    """verl's run keys (batch size, steps, group size, run dir, cadences)."""
    task: TaskConfig
    """The ``task:`` section."""
    actor: Any
    """verl ``ActorConfig`` (``actor_rollout_ref.actor``): loss, optimiser, clip."""
    algorithm: Any
    """verl ``AlgoConfig`` (``algorithm``): advantage estimator, rollout correction."""

    @classmethod
    def from_omegaconf(cls, cfg) -> "EngineConfig":
        from verl.utils.config import omega_conf_to_dataclass

        return cls(
            hetero=HeteroConfig.from_omegaconf(cfg.hetero),
            settings=RunSettings.from_config(cfg),
            task=TaskConfig.from_omegaconf(cfg.task),
            actor=omega_conf_to_dataclass(cfg.actor_rollout_ref.actor),
            algorithm=omega_conf_to_dataclass(cfg.algorithm),
        )


@dataclass
class Batch:
    """One learner step's groups and what it cost to get them."""

    groups: list[RolloutGroup]
    """Whole groups, each within the staleness bound of the learner's version."""
    wait_s: float
    """Seconds the learner was idle for them (replay: generation; async: blocked in take)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Source-specific scalars logged with the step (throughput, transport counters)."""


class RolloutSource(Protocol):
    """Where a learner step's groups come from and where its weights go.

    Groups pass through the runtime's :class:`RolloutBuffer` (given to the source at
    construction), so the staleness bound, the drop/wait policy and the ledger are the same in
    both modes."""

    def start(self, checkpoint: Optional[dict], learner_version: int) -> None:
        """Restore from ``checkpoint`` (the dict :meth:`LearnerRuntime.checkpoint_state` saved) or
        start fresh; called before the first :meth:`publish`."""

    def next_batch(self, step: int, n: int, learner_version: int) -> Batch:
        """``n`` groups for learner step ``step`` (0-based) at ``learner_version``."""

    def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """The learner's weights of ``version`` (after the buffer accepts that version)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume this source exactly (merged into the checkpoint)."""

    def acknowledge(self, buffer_state: dict) -> int:
        """After a checkpoint holding ``buffer_state`` is durable."""

    def close(self) -> None: ...


class GenerateOn:
    """Replay mode with ``hetero.sampler_cpus``: the process moves to the sampler cores while it
    generates a batch and back after, so the synchronous learner waits while "the sampler node"
    works (the same pinning as async mode's actors). Everything else is the wrapped source's."""

    def __init__(self, source: RolloutSource, cpus: list[int]):
        self.source, self.cpus = source, list(cpus)

    def next_batch(self, step: int, n: int, learner_version: int) -> Batch:
        with Pinned(self.cpus, "hetero.sampler_cpus"):
            return self.source.next_batch(step, n, learner_version)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)


# hetero keys only async mode acts on: a value other than the default would be silently ignored
# in replay mode -> refused, with what replay does instead
ASYNC_ONLY_KEYS = {
    "weight_sync": "replay mode hands weights over in memory, no transport",
    "max_delta_chain": "replay mode hands weights over in memory, no transport",
    "weights_bf16": "replay mode hands weights over in memory (the sampler uses the learner's own dtype)",
    "system_cpus": "replay mode is one process, on hetero.learner_cpus while it trains and hetero.sampler_cpus while it generates",
}


def check_supported(engine: EngineConfig) -> None:
    """Refuse, before any work and naming the key, what the embedded engine cannot do. Both
    modes support the same options (rollout correction, diagnostics, resume, both stale
    policies), so the checks are the same for both, except the keys of :data:`ASYNC_ONLY_KEYS`
    (the weight transport's, the Ray processes' cores), which replay mode refuses."""
    rollout_correction_settings(engine.algorithm)  # names a bad algorithm.rollout_correction value
    check_optimizer_supported(engine.actor)
    if engine.hetero.mode == "replay":
        default = HeteroConfig()
        for key, instead in ASYNC_ONLY_KEYS.items():
            value = getattr(engine.hetero, key)
            if value != getattr(default, key):
                raise ValueError(f"hetero.{key}={value!r} is an async-mode option; {instead} (hetero.mode=replay): "
                                 f"leave it at {getattr(default, key)!r} or use hetero.mode=async")


# actor.optim keys the learner's AdamW honours: lr, betas, weight_decay (and actor.grad_clip). The
# schedule keys below must stay at verl's defaults (constant lr, no warm-up): refused otherwise.
_OPTIM_DEFAULTS = {
    "optimizer": "AdamW", "lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.0, "lr_scheduler_type": "constant",
    "warmup_style": None, "override_optimizer_config": None,
}  # fmt: skip


def check_optimizer_supported(actor: Any) -> None:
    """The embedded learner runs AdamW at a constant learning rate; a verl schedule or another
    optimizer would be silently ignored, so it is refused naming the key."""
    optim = actor.optim
    for key, default in _OPTIM_DEFAULTS.items():
        value = optim.get(key, default) if hasattr(optim, "get") else getattr(optim, key, default)
        if key == "lr_warmup_steps" and value is not None and int(value) <= 0:
            continue  # -1 / 0: no warm-up
        if key == "warmup_style" and value in (None, "constant"):
            continue
        if value != default:
            raise ValueError(
                f"actor_rollout_ref.actor.optim.{key}={value!r}: the embedded engine's learner runs "
                f"{_OPTIM_DEFAULTS['optimizer']} at a constant lr (no warm-up or schedule); use hetero.engine=verl, "
                f"or leave it at {default!r}"
            )


# ---------------------------------------------------------------------------- learner


def build_learner(model, pad_token_id: int, engine: EngineConfig) -> Learner:
    """The learner of both modes, with verl's decoupled rollout correction (truncated IS) when
    ``algorithm.rollout_correction.rollout_is`` is set. Built from the initial weights (a
    checkpoint is loaded afterwards), so a KL-to-reference term has the initial model as reference."""
    return Learner(
        model, engine.actor, engine.settings.temperature, pad_token_id,
        max_nonfinite_steps=engine.hetero.max_nonfinite_steps,
        rollout_correction=rollout_correction_settings(engine.algorithm),
    )  # fmt: skip


def build_buffer(engine: EngineConfig, task: Task) -> RolloutBuffer:
    hetero = engine.hetero
    return RolloutBuffer(
        max_delay=hetero.max_delay, stale_policy=hetero.stale_policy, order=hetero.order,
        spec=RecordSpec(group_size=engine.settings.group_size, reward_range=task.reward_range),
        wait_timeout_s=hetero.wait_timeout_s,
    )  # fmt: skip


def advantage_diagnostics(
    model, tokenizer, groups, task: Task, settings: RunSettings, actor_config: Any, samples: int, seed: int
) -> dict[str, float]:
    """The E[A] estimation error of the batch ``groups`` for the current ``model`` (the learner
    before its update): see :mod:`verl_ext.analysis.run_diagnostics`. The fresh samples use
    their own seeded RNG (the torch RNG state is restored), so training is the same with and
    without diagnostics."""
    from verl_ext.analysis.run_diagnostics import estimation_errors, main_weight_kind, weighted_advantage_estimates

    batch = collate_groups(groups, tokenizer.pad_token_id)
    mask = batch["response_mask"].bool()
    reduction = loss_option(actor_config, "seq_reduction")
    with torch.no_grad():
        log_p = sequence_token_log_probs(
            model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"],
            settings.temperature,
        )  # fmt: skip
    log_q = batch["sampler_logprobs"]
    estimates = weighted_advantage_estimates(
        sequence_log_prob(log_p, mask, reduction), sequence_log_prob(log_q, mask, reduction),
        sequence_log_prob(log_p, mask, "sum"), sequence_log_prob(log_q, mask, "sum"),
        batch["rewards"], batch["group_index"],
    )  # fmt: skip
    items = [
        {"prompt": tokenizer.decode(g.prompt_ids, skip_special_tokens=True), "answer": g.extra.get("answer", "")}
        for g in groups
    ]
    with torch.random.fork_rng(devices=[]):
        fresh = sample_groups(model, tokenizer, [it["prompt"] for it in items], samples, settings.temperature,
                              settings.max_new_tokens, seed)  # fmt: skip
    rewards = torch.tensor([task.score(text, items[i // samples]) for i, text in enumerate(fresh.texts)])
    loss_mode = actor_config.policy_loss.get("loss_mode", "vanilla")
    return estimation_errors(estimates, rewards.view(len(items), samples), main_weight_kind(loss_mode))


# ---------------------------------------------------------------------------- one step


class LearnerRuntime:
    """The learner process of either mode: model, learner, buffer and a rollout source.

    Args:
        engine: the typed configs.
        model_path: the HF folder the policy starts from.
        make_source: builds the mode's :class:`RolloutSource` from this runtime (after the
            learner's model and the buffer exist).
        task: the task, if the caller has one already.
    """

    def __init__(self, engine: EngineConfig, model_path: str,
                 make_source: Callable[["LearnerRuntime"], RolloutSource], task: Optional[Task] = None):
        self.engine, self.model_path = engine, model_path
        self.task = task if task is not None else Task(engine.task, engine.hetero.seed)
        self.model, self.tokenizer = load_policy(model_path)
        self.learner = build_learner(self.model, self.tokenizer.pad_token_id, engine)
        self.buffer = build_buffer(engine, self.task)
        self.source = make_source(self)

    def start(self, checkpoint: Optional[dict] = None) -> int:
        """Restore a checkpoint if given, then publish the current weights; returns the version."""
        if checkpoint is not None:
            self.learner.load_state_dict(checkpoint["learner"])
            self.buffer.load_state_dict(checkpoint["buffer"])
        self.source.start(checkpoint, self.learner.version)
        self._publish()
        return self.learner.version

    def _publish(self) -> None:
        # the buffer must accept groups made with version v before any sampler can load v
        self.buffer.set_learner_version(self.learner.version)
        self.source.publish(self.model.state_dict(), self.learner.version)

    def step(self, step: Optional[int] = None) -> dict[str, float]:
        """One learner step (``step``: 0-based index; default the learner's version): take a
        batch, [diagnostics], update, publish. Returns the step's metrics."""
        engine = self.engine
        step = self.learner.version if step is None else int(step)
        t0 = time.perf_counter()
        batch = self.source.next_batch(step, engine.settings.prompts_per_step, self.learner.version)
        diag: dict[str, float] = {}
        every = int(engine.task.diagnostics_every or 0)
        if every > 0 and step % every == 0 and batch.groups:
            diag = advantage_diagnostics(
                self.model, self.tokenizer, batch.groups, self.task, engine.settings, engine.actor,
                engine.task.diagnostics_samples, seed=diagnostics_seed(engine.hetero.seed, step),
            )  # fmt: skip
            staleness = [self.learner.version - g.policy_version for g in batch.groups]
            diag["diag/staleness"] = float(sum(staleness) / len(staleness))
        t_train = time.perf_counter()
        metrics = self.learner.train_step(batch.groups)
        metrics.update(diag)
        t_publish = time.perf_counter()
        self._publish()
        metrics.update(self.buffer.metrics())
        step_s = time.perf_counter() - t0
        # where the step went: waiting for groups, the update itself, publishing the weights
        metrics.update({"perf/step_s": step_s, "perf/learner_idle_frac": batch.wait_s / max(step_s, 1e-9),
                        "perf/train_s": t_publish - t_train, "perf/publish_s": step_s - (t_publish - t0)})
        metrics.update(batch.metrics)
        return metrics

    def evaluate(self, seed: int) -> dict[str, float]:
        return self.task.evaluate(self.model, self.tokenizer, self.engine.settings.max_new_tokens, seed=seed)

    def checkpoint_state(self) -> dict[str, Any]:
        return {"learner": self.learner.state_dict(), "buffer": self.buffer.state_dict(), **self.source.state_dict()}

    def acknowledge(self, buffer_state: dict) -> int:
        """After a checkpoint is durable (async: delete the rollouts it accounts for)."""
        return self.source.acknowledge(buffer_state)

    def ledger_counts(self) -> dict[str, int]:
        return self.buffer.ledger.counts()

    def shutdown(self) -> None:
        self.source.close()


# ---------------------------------------------------------------------------- the loop


def run_loop(runtime: Any, engine: EngineConfig, logger: MetricLogger, desc: str) -> dict[str, float]:
    """Train for ``trainer.total_training_steps`` learner steps. ``runtime`` is a
    :class:`LearnerRuntime` or a proxy with the same methods (async mode's learner actor).
    Returns the last step's metrics plus the ledger totals (``hetero/ledger_*``)."""
    settings, hetero = engine.settings, engine.hetero
    checkpoint = load_latest_checkpoint(settings.run_dir) if settings.resume_mode == "auto" else None
    start = 0 if checkpoint is None else int(checkpoint["step"])
    if checkpoint is not None:
        truncate_metrics(logger.path, start)
    runtime.start(checkpoint)
    if checkpoint is None:
        logger.log(runtime.evaluate(hetero.seed), step=0)

    metrics: dict[str, float] = {}
    bar = tqdm(range(start, settings.total_steps), desc=desc, initial=start, total=settings.total_steps)
    last = time.perf_counter()
    for step in bar:
        metrics = runtime.step(step)
        # the loop's wall clock per step: the step plus the previous step's logging, evaluation
        # and checkpoint, and (async) the round trip to the learner actor
        now = time.perf_counter()
        metrics["perf/wall_s"], last = now - last, now
        done = step + 1
        if (settings.test_freq > 0 and done % settings.test_freq == 0) or done == settings.total_steps:
            metrics.update(runtime.evaluate(hetero.seed))
        logger.log(metrics, step=done)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", stale=f"{metrics['hetero/staleness_mean']:.1f}")
        if (settings.save_freq > 0 and done % settings.save_freq == 0) or done == settings.total_steps:
            state = runtime.checkpoint_state()
            save_checkpoint(settings.run_dir, done, {"step": done, **state})
            runtime.acknowledge(state["buffer"])
    metrics.update({f"hetero/ledger_{k}": float(v) for k, v in runtime.ledger_counts().items()})
    return metrics


def run_engine(engine: EngineConfig, model_path: str, logger: MetricLogger, task: Optional[Task] = None) -> dict[str, float]:
    """The embedded engine: check what the mode supports, then run the one loop in that mode."""
    check_supported(engine)
    if engine.hetero.mode == "replay":
        from recipe.gepo.local.replay import ReplaySource

        hetero = engine.hetero

        def source(runtime: LearnerRuntime) -> RolloutSource:
            replay = ReplaySource(runtime)
            return GenerateOn(replay, hetero.sampler_cpus) if hetero.sampler_cpus else replay

        # the learner node's cores for the whole run (the process's own affinity comes back after)
        with Pinned(hetero.learner_cpus, "hetero.learner_cpus", threads=True):
            runtime = LearnerRuntime(engine, model_path, source, task=task)
            try:
                return run_loop(runtime, engine, logger, desc="replay")
            finally:
                runtime.shutdown()
    if engine.hetero.mode == "async":
        from recipe.gepo.local.async_mode import run_async

        return run_async(engine, model_path, logger)
    raise ValueError(f"hetero.mode={engine.hetero.mode!r}; expected 'replay' or 'async'")
