"""The embedded engine's learner runtime and its one driver loop, for replay and async mode alike.

:func:`run_loop` drives any :class:`Runtime`: the in-process :class:`LearnerRuntime` (replay mode,
batches from :class:`.replay.ReplaySource`) or async mode's proxy of it in a Ray actor
(:mod:`.supervisor`; batches the samplers sent over the transport). A run, top to bottom::

    checkpoint = latest checkpoint of the run dir (trainer.resume_mode=auto) or None
    runtime.start(checkpoint)                      # restore learner + buffer + source, publish v
    log the initial evaluation (fresh runs)
    for each learner step:                         # LearnerRuntime.step
        batch   = source.next_batch(...)           # whole groups within the staleness bound
        metrics = learner.train_step(batch)        # (the E[A] diagnostic first, when asked for)
        source.publish(weights, version)
        log; evaluate / checkpoint on trainer.test_freq / trainer.save_freq
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch
from tqdm import tqdm

from .advantage_error import step_diagnostics
from .engine_config import EngineConfig, RolloutSource
from .learner import Learner
from .model_placement import Placement
from .run_log import MetricLogger
from .tasks import Task
from verl_ext.algos.advantages import sequence_advantages
from verl_ext.hetero.buffer import RolloutBuffer
from verl_ext.hetero.records import RecordSpec, RolloutGroup
from verl_ext.algos.objective import rollout_correction_settings
from verl_ext.rundir import append_event, describe_event, load_latest_checkpoint, save_checkpoint, truncate_metrics


# ---------------------------------------------------------------------------- learner


def build_learner(model, pad_token_id: int, engine: EngineConfig) -> Learner:
    """The learner of both modes, with verl's decoupled rollout correction (truncated IS) when
    ``algorithm.rollout_correction.rollout_is`` is set. Built from the initial weights (a
    checkpoint is loaded afterwards), so a KL-to-reference term has the initial model as reference."""
    return Learner(
        model,
        engine.actor,
        engine.settings.temperature,
        pad_token_id,
        max_nonfinite_steps=engine.hetero.max_nonfinite_steps,
        rollout_correction=rollout_correction_settings(engine.algorithm),
        compute_dtype=Placement.of(engine.hetero).learner_compute_dtype,  # hetero.learner_precision
    )


def build_buffer(engine: EngineConfig, task: Task, model_config: Any = None) -> RolloutBuffer:
    """The learner's buffer. ``model_config`` (the policy's HF config): records whose token ids lie
    outside its vocabulary, or whose prompt and response would not fit its positions, are refused
    on arrival (a sampler may send any bytes; nothing out of range reaches a model)."""
    hetero, max_new = engine.hetero, engine.settings.max_new_tokens
    vocab = getattr(model_config, "vocab_size", None)
    positions = getattr(model_config, "max_position_embeddings", None)
    return RolloutBuffer(
        max_delay=hetero.max_delay,
        stale_policy=hetero.stale_policy,
        order=hetero.order,
        spec=RecordSpec(
            group_size=engine.settings.group_size,
            reward_range=task.reward_range,
            vocab_size=vocab,
            max_response_length=max_new,
            max_prompt_length=max(1, positions - max_new) if positions else None,
        ),
        wait_timeout_s=hetero.wait_timeout_s,
        sampler_capacity=sampler_quota(engine),
    )


def sampler_quota(engine: EngineConfig) -> int:
    """``hetero.max_buffered_per_sampler``, or its default: the groups a learner can take before a
    group goes stale, (max_delay + 1) x train_batch_size (never binds in replay mode, which adds
    one batch and takes it)."""
    hetero = engine.hetero
    if hetero.max_buffered_per_sampler is not None:
        return hetero.max_buffered_per_sampler
    return (hetero.max_delay + 1) * engine.settings.prompts_per_step


def with_learner_advantages(groups: list[RolloutGroup], algorithm_config: Any) -> list[RolloutGroup]:
    """The batch's groups with the advantages the loss reads derived here, from their rewards, by
    verl's estimator over the batch (group-local ones such as grpo: per group), one per sequence:
    the sampler's own advantages are at most cross-checked (the trust gate), never trained on."""
    width = max(g.response_ids.shape[1] for g in groups)
    rewards = torch.cat([torch.as_tensor(g.rewards, dtype=torch.float32) for g in groups])
    mask = torch.zeros((len(rewards), width), dtype=torch.long)
    uids: list[str] = []
    row = 0
    for g in groups:
        mask[row : row + g.group_size, : g.response_ids.shape[1]] = torch.as_tensor(g.response_mask).long()
        uids += [g.group_uid] * g.group_size
        row += g.group_size
    advantages = sequence_advantages(rewards, mask, uids, algorithm_config).numpy()
    out, row = [], 0
    for g in groups:
        out.append(dataclasses.replace(g, advantages=advantages[row : row + g.group_size].copy()))
        row += g.group_size
    return out


# ---------------------------------------------------------------------------- one step


class LearnerRuntime:
    """The learner process of either mode: model, learner, buffer and a rollout source.

    Args:
        engine: the validated configs.
        model_path: the HF folder the policy starts from.
        make_source: builds the mode's :class:`RolloutSource` from this runtime (after the
            learner's model and the buffer exist).
    """

    def __init__(self, engine: EngineConfig, model_path: str, make_source: Callable[["LearnerRuntime"], RolloutSource]):
        self.engine, self.model_path = engine, model_path
        # hetero.device: the learner's fp32 master weights go there
        self.model, self.tokenizer = Placement.of(engine.hetero).load_learner(model_path)
        self.task = Task(engine.task, engine.hetero.seed, self.tokenizer)
        self.learner = build_learner(self.model, self.tokenizer.pad_token_id, engine)
        self.buffer = build_buffer(engine, self.task, self.model.config)
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
        groups = with_learner_advantages(batch.groups, engine.algorithm)
        diag = step_diagnostics(self.model, self.tokenizer, groups, self.task, engine, step, self.learner.version)
        t_train, cpu_train = time.perf_counter(), time.thread_time()
        metrics = self.learner.train_step(groups)
        train_cpu_s = time.thread_time() - cpu_train
        self.source.trained(batch.groups, self.learner.group_divergence)
        if engine.settings.save_freq <= 0:
            # No checkpoint before the end, so a crash starts the run afresh (which clears the
            # exchange): the rollouts the ledger has settled need not wait in the transport for a
            # checkpoint's acknowledge, where they would pile up for the whole run.
            self.source.acknowledge({"ledger": {"status": self.buffer.ledger.status}})
        metrics.update(diag)
        t_publish = time.perf_counter()
        self._publish()
        metrics.update(self.buffer.metrics())
        step_s = time.perf_counter() - t0
        # where the step went: waiting for groups, the update itself, publishing the weights
        metrics.update(
            {
                "perf/step_s": step_s,
                "perf/learner_idle_frac": batch.wait_s / max(step_s, 1e-9),
                "perf/train_s": t_publish - t_train,
                "perf/publish_s": step_s - (t_publish - t0),
                "perf/train_cpu_s": train_cpu_s,
            }
        )
        metrics.update(batch.metrics)
        return metrics

    def evaluate(self, seed: int) -> dict[str, float]:
        return self.task.evaluate(self.model, self.tokenizer, self.engine.settings.max_new_tokens, seed=seed)

    def drain_events(self) -> list[dict]:
        return self.source.drain_events()

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


@runtime_checkable
class Runtime(Protocol):
    """What :func:`run_loop` calls: :class:`LearnerRuntime` (in this process) and
    :class:`.supervisor.RemoteRuntime` (the learner in a Ray actor, plus the samplers' supervision)."""

    def start(self, checkpoint: Optional[dict]) -> int:
        """Restore ``checkpoint`` (None: fresh), publish the weights; returns the learner version."""
        ...

    def step(self, step: int) -> dict[str, float]:
        """Learner step ``step`` (0-based): take a batch, update, publish; the step's metrics."""
        ...

    def evaluate(self, seed: int) -> dict[str, float]: ...

    def drain_events(self) -> list[dict]:
        """Events since the last call (e.g. a sampler quarantined), for ``events.jsonl``."""
        ...

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything a resume needs: ``learner``, ``buffer`` and the source's own state."""
        ...

    def acknowledge(self, buffer_state: dict) -> int:
        """After a checkpoint is durable: drop the rollouts it accounts for; returns how many."""
        ...

    def ledger_counts(self) -> dict[str, int]: ...


def run_loop(runtime: Runtime, engine: EngineConfig, logger: MetricLogger, desc: str) -> dict[str, float]:
    """Train for ``trainer.total_training_steps`` learner steps with ``runtime``.
    Returns the last step's metrics plus the ledger totals (``hetero/ledger_*``)."""
    settings, hetero = engine.settings, engine.hetero
    checkpoint = load_latest_checkpoint(settings.run_dir) if settings.resume_mode == "auto" else None
    start = 0 if checkpoint is None else int(checkpoint["step"])
    if checkpoint is not None:
        truncate_metrics(logger.path, start)
    # one line per start-up phase: each takes seconds to a minute before the progress bar appears
    tqdm.write(f"[heterorl] starting the learner ({'from step ' + str(start) if checkpoint else 'fresh'})")
    runtime.start(checkpoint)
    if checkpoint is None:
        tqdm.write(f"[heterorl] initial evaluation ({engine.task.eval_size} held-out problems)")
        logger.log(runtime.evaluate(hetero.seed), step=0)

    metrics: dict[str, float] = {}
    bar = tqdm(range(start, settings.total_steps), desc=desc, initial=start, total=settings.total_steps)
    last = time.perf_counter()
    for step in bar:
        metrics = runtime.step(step)
        for event in runtime.drain_events():  # e.g. a sampler quarantined (hetero.trust)
            append_event(settings.run_dir, {"step": step + 1, **event})
            bar.write(f"[heterorl] step {step + 1}: {describe_event(event)}")
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
