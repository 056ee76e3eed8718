"""The embedded engine's shared types: its validated config, a learner step's batch, and the
protocol every rollout source (replay's, async's) implements.

:meth:`EngineConfig.from_omegaconf` is the one validated constructor from the composed hydra
config: every check that can fail does so here, before any work, naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch
from omegaconf import DictConfig

from .model_placement import check_device
from .run_log import RunSettings
from ..options import (
    ConfigError,
    check_dependencies,
    check_known_keys,
    check_section,
    check_verl_keys,
    default_config,
    runner_of,
)
from ..sections import HeteroConfig, TaskConfig, VerlEngineConfig
from verl_ext.hetero.records import RolloutGroup


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
    notes: list[str] = field(default_factory=list)
    """Options without effect that are reported, not refused (:func:`recipe.gepo.options.check_dependencies`)."""

    @property
    def runner(self) -> str:
        """``replay`` or ``async`` (:mod:`recipe.gepo.options`)."""
        return runner_of(self.hetero.engine, self.hetero.mode)

    @classmethod
    def from_omegaconf(cls, cfg: DictConfig, defaults: Optional[DictConfig] = None) -> "EngineConfig":
        """Build and validate from the composed config (``defaults``: ``gepo_trainer.yaml``
        composed without overrides, what verl keys are compared with; composed if not given).

        Raises :class:`~recipe.gepo.options.ConfigError` (a ValueError) naming the key: an unknown
        key, a bad value, a loss or estimator verl does not know, an option the chosen mode would
        not honour or that another key leaves without effect (:mod:`recipe.gepo.options`), a CUDA
        device this machine does not have, a data file that cannot be read."""
        defaults = defaults if defaults is not None else default_config()
        check_known_keys(cfg, defaults)  # before verl's dataclasses meet an unknown field
        try:
            return cls._validated(cfg, defaults)
        except ConfigError:
            raise
        except ValueError as err:  # the sections' and verl's validators: a one-line config error too
            raise ConfigError(str(err)) from err

    @classmethod
    def _validated(cls, cfg: DictConfig, defaults: DictConfig) -> "EngineConfig":
        from verl.utils.config import omega_conf_to_dataclass

        from verl_ext.algos.objective import rollout_correction_settings

        engine = cls(
            hetero=HeteroConfig.from_omegaconf(cfg.hetero),
            settings=RunSettings.from_config(cfg),
            task=TaskConfig.from_omegaconf(cfg.task),
            actor=omega_conf_to_dataclass(cfg.actor_rollout_ref.actor),
            algorithm=omega_conf_to_dataclass(cfg.algorithm),
        )
        if engine.hetero.engine != "embedded":
            raise ValueError(f"hetero.engine={engine.hetero.engine!r}: the embedded engine runs hetero.engine=embedded")
        check_registered(engine.actor.policy_loss.loss_mode, engine.algorithm.adv_estimator)
        estimator = getattr(engine.algorithm.adv_estimator, "value", engine.algorithm.adv_estimator)
        if estimator in ("grpo", "bnpo") and engine.settings.group_size < 2:
            raise ValueError(
                f"actor_rollout_ref.rollout.n={engine.settings.group_size}: the group-normalised estimator "
                f"{estimator!r} needs at least 2 responses per prompt"
            )
        check_section(engine.hetero, "hetero", engine.runner)
        check_device(engine.hetero.device)  # hetero.device=cuda where there is no CUDA
        check_section(engine.task, "task", engine.runner)
        check_section(VerlEngineConfig.from_config(cfg), "verl_engine", engine.runner)
        check_verl_keys(cfg, defaults, engine.runner)
        engine.notes = check_dependencies(cfg, defaults, engine.runner)
        rollout_correction_settings(engine.algorithm)  # names a value the learner cannot do
        engine.task.check_files()
        engine.hetero.trust.check_calibration(
            model_identity(engine),
            engine.hetero.sampler_precision,
            engine.settings.temperature,
            rescores=engine.hetero.mode == "async",
        )
        return engine


def model_identity(engine: EngineConfig) -> str:
    """The model a calibration is measured on, as the config names it: the model folder, the
    task's built-in model, or the toy task's warm start (``hetero.trust.bounds_file``)."""
    return engine.settings.model_path or engine.task.model or f"warm start of task.name={engine.task.name}"


def check_registered(loss_mode: str, adv_estimator: Any) -> None:
    """Fail before any work when the loss or estimator is not in verl's registries."""
    from verl.trainer.ppo import core_algos

    name = getattr(adv_estimator, "value", adv_estimator)
    if loss_mode not in core_algos.POLICY_LOSS_REGISTRY:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r} is not registered; "
            f"known: {sorted(core_algos.POLICY_LOSS_REGISTRY)}"
        )
    if name not in core_algos.ADV_ESTIMATOR_REGISTRY:
        raise ValueError(
            f"algorithm.adv_estimator={name!r} is not registered; known: {sorted(core_algos.ADV_ESTIMATOR_REGISTRY)}"
        )
    from verl_ext.algos.advantages import unfed_advantage_inputs

    unfed = unfed_advantage_inputs(name)
    if unfed:
        usable = sorted(n for n in core_algos.ADV_ESTIMATOR_REGISTRY if not unfed_advantage_inputs(n))
        raise ValueError(
            f"algorithm.adv_estimator={name!r} needs {unfed}, which the embedded engine does not "
            f"compute (no critic, reward baselines or recomputed log-probs); it runs {usable}, "
            "and the verl engine runs verl's own (hetero.engine=verl)"
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

    Groups pass through the runtime's :class:`~verl_ext.hetero.buffer.RolloutBuffer` (given to
    the source at construction), so the staleness bound, the drop/wait policy and the ledger are
    the same in both modes."""

    def start(self, checkpoint: Optional[dict], learner_version: int) -> None:
        """Restore from ``checkpoint`` (the dict ``LearnerRuntime.checkpoint_state`` saved) or
        start fresh; called before the first :meth:`publish`."""

    def next_batch(self, step: int, n: int, learner_version: int) -> Batch:
        """``n`` groups for learner step ``step`` (0-based) at ``learner_version``."""

    def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """The learner's weights of ``version`` (after the buffer accepts that version)."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume this source exactly (merged into the checkpoint)."""

    def acknowledge(self, buffer_state: dict) -> int:
        """After a checkpoint holding ``buffer_state`` is durable."""

    def trained(self, groups: list[RolloutGroup], divergence: list[float]) -> None:
        """After a step on ``groups``: each group's measured divergence under the weights the step
        started from (:func:`recipe.gepo.embedded.learner.group_divergence`: the group's
        ``is/kl_sampler_learner``, the k3 estimate of KL(sampler || learner))."""

    def drain_events(self) -> list[dict]:
        """Events for the run's records since the last call (e.g. a sampler quarantined)."""

    def close(self) -> None: ...


def render_plan(engine: EngineConfig) -> str:
    """The embedded engine's dry-run plan: the same headings as the verl engine's
    (:func:`recipe.gepo.verl_engine.launch_plan.render`) where the two engines share a concept."""
    from ..export import plan_line

    hetero, settings, task, actor = engine.hetero, engine.settings, engine.task, engine.actor
    if task.name == "math":
        data = f"math: train {task.dataset_path or task.dataset}, evaluation {task.eval_dataset} ({task.eval_size} problems)"
    else:
        data = f"{task.name}: {task.digits}-digit problems, {task.answer_format} answers, evaluation {task.eval_size} problems"
    samplers = (
        "one process" if hetero.mode == "replay" else f"{hetero.num_samplers} sampler actor(s), one learner actor"
    )
    unit = "seconds" if hetero.mode == "async" else "steps"
    the_tasks_own = "the task's own (its warm start)"
    return "\n".join(
        [
            "HeteroRL embedded engine plan (dry run: nothing started)",
            f"  model:           {settings.model_path or the_tasks_own}",
            f"  data:            {data}",
            f"  mode:            {hetero.mode}, {samplers}, device {hetero.device}",
            f"  batch:           {settings.prompts_per_step} prompts x G={settings.group_size} = "
            f"{settings.prompts_per_step * settings.group_size} responses/step, lr {actor.optim.lr}, "
            f"T={settings.temperature}, response <= {settings.max_new_tokens} tokens",
            f"  loss:            loss_mode={actor.policy_loss.loss_mode}, agg={actor.loss_agg_mode}, "
            f"adv={engine.algorithm.adv_estimator}",
            f"  delay (weights): {hetero.delay.describe(unit, hetero.seed)}",
            f"  staleness bound: {hetero.max_delay} versions, stale_policy={hetero.stale_policy}",
            f"  steps:           {settings.total_steps}, checkpoint every {settings.save_freq}, evaluation every "
            f"{settings.test_freq} (<= 0: at the end only)",
            f"  run directory:   {settings.run_dir}; at the end {plan_line(hetero.export_hf)}",
        ]
    )
