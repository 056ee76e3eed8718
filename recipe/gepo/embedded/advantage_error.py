"""The E[A] estimation-error diagnostic (``task.diagnostics_every``, both modes of the embedded
engine): how well the batch's importance-weighted advantages estimate the learner's expected
advantage, against fresh learner samples (:mod:`verl_ext.analysis.run_diagnostics`).
Logged as ``diag/*`` before the update of every k-th step."""

from __future__ import annotations

from typing import Any

import torch

from .engine_config import EngineConfig
from .learner import collate_groups
from .model_placement import Placement, model_device
from .policy import sample_groups
from verl_ext.sampling import sequence_token_log_probs
from .run_log import RunSettings
from .tasks import Task
from verl_ext.algos.importance import sequence_log_prob
from verl_ext.hetero.records import RolloutGroup
from verl_ext.hetero.seeding import diagnostics_seed
from verl_ext.algos.config import loss_option


def step_diagnostics(
    model, tokenizer, groups: list[RolloutGroup], task: Task, engine: EngineConfig, step: int, learner_version: int
) -> dict[str, float]:
    """The ``diag/*`` metrics of learner step ``step`` (0-based) when it is due
    (``step % task.diagnostics_every == 0``), else nothing."""
    every = int(engine.task.diagnostics_every or 0)
    if every <= 0 or step % every != 0 or not groups:
        return {}
    diag = advantage_diagnostics(
        model,
        tokenizer,
        groups,
        task,
        engine.settings,
        engine.actor,
        engine.task.diagnostics_samples,
        seed=diagnostics_seed(engine.hetero.seed, step),
        compute_dtype=Placement.of(engine.hetero).learner_compute_dtype,
    )
    staleness = [learner_version - g.policy_version for g in groups]
    diag["diag/staleness"] = float(sum(staleness) / len(staleness))
    return diag


def advantage_diagnostics(
    model,
    tokenizer,
    groups,
    task: Task,
    settings: RunSettings,
    actor_config: Any,
    samples: int,
    seed: int,
    compute_dtype: Any = None,
) -> dict[str, float]:
    """The E[A] estimation error of the batch ``groups`` for the current ``model`` (the learner
    before its update): see :mod:`verl_ext.analysis.run_diagnostics`. The fresh samples use
    their own seeded RNG (the torch RNG state is restored), so training is the same with and
    without diagnostics. The learner's log p is scored where the model is (with the learner's
    autocast ``compute_dtype``, if any) and compared on the CPU."""
    from verl_ext.analysis.run_diagnostics import estimation_errors, main_weight_kind, weighted_advantage_estimates

    batch = collate_groups(groups, tokenizer.pad_token_id)
    mask = batch["response_mask"].bool()
    reduction = loss_option(actor_config, "seq_reduction")
    device = model_device(model)
    with torch.no_grad():
        log_p = sequence_token_log_probs(
            model,
            *(batch[k].to(device) for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")),
            settings.temperature,
            compute_dtype,
        ).to("cpu")
    log_q = batch["sampler_logprobs"]
    estimates = weighted_advantage_estimates(
        sequence_log_prob(log_p, mask, reduction),
        sequence_log_prob(log_q, mask, reduction),
        sequence_log_prob(log_p, mask, "sum"),
        sequence_log_prob(log_q, mask, "sum"),
        batch["rewards"],
        batch["group_index"],
    )
    items = [
        {"prompt": tokenizer.decode(g.prompt_ids, skip_special_tokens=True), "answer": g.extra.get("answer", "")}
        for g in groups
    ]
    with torch.random.fork_rng(devices=[]):
        fresh = sample_groups(
            model,
            tokenizer,
            [it["prompt"] for it in items],
            samples,
            settings.temperature,
            settings.max_new_tokens,
            seed,
        )
    rewards = torch.tensor([task.score(text, items[i // samples]) for i, text in enumerate(fresh.texts)])
    loss_mode = actor_config.policy_loss.get("loss_mode", "vanilla")
    return estimation_errors(estimates, rewards.view(len(items), samples), main_weight_kind(loss_mode))
