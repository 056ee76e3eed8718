"""Sampler side of the embedded engine: prompts -> G responses each -> rewards -> advantages ->
validated :class:`~verl_ext.hetero.records.RolloutGroup` records.

Rewards and group advantages are computed where the rollouts are generated ("localized reward
computation", as in the paper), with verl's own advantage-estimator registry, so ``grpo`` /
``bnpo`` / ... mean exactly what they mean in verl.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .policy import sample_groups
from verl_ext.algos.advantages import sequence_advantages
from verl_ext.trust.assignment import assigned_seed
from verl_ext.trust.gumbel import group_seed
from verl_ext.trust.bounds import precision_of
from verl_ext.hetero.records import RolloutGroup

# score(response_text, item) -> reward; item is one prompt dict (prompt, answer, data_source)
ScoreFn = Callable[[str, dict], float]


@dataclass
class RolloutSettings:
    """How samplers generate (from verl's ``actor_rollout_ref.rollout`` keys)."""

    group_size: int
    """G responses per prompt (``rollout.n``)."""
    temperature: float
    """Sampling temperature; the learner scores with the same one."""
    max_new_tokens: int
    """Longest response (``data.max_response_length``)."""


def generate_groups(
    model,
    tokenizer,
    items: list[dict],
    score: ScoreFn,
    settings: RolloutSettings,
    algorithm_config: Any,
    policy_version: int,
    sampler_id: str,
    seed: int,
    uid_prefix: str,
    checkable: bool = False,
    batch_index: int | None = None,
    gumbel_key: bytes | None = None,
) -> list[RolloutGroup]:
    """Generate one rollout group per prompt item with the model's current weights.

    Args:
        items: prompt dicts with ``prompt`` (text fed to the model) and ``answer``.
        policy_version: the learner version these weights came from (stamped on every group).
        seed: sampling seed (same seed, same weights -> same tokens).
        uid_prefix: group uids are ``f"{uid_prefix}-{i}"``; must be unique across the run.
        checkable: ``hetero.trust.checkable_sampling``: each group drawn by seeded Gumbel-max, its
            seed in its record: the learner's assignment with ``gumbel_key`` (slot i of batch
            ``batch_index``, :func:`~verl_ext.trust.assignment.assigned_seed`), else
            :func:`~verl_ext.trust.gumbel.group_seed` of ``seed`` and i.
        batch_index: the claimed batch ``items`` are (group i: its slot i, in the record); None: unassigned.
    """
    g = settings.group_size
    if gumbel_key is not None and batch_index is None:
        raise ValueError("generate_groups: assigned seeds (gumbel_key) need the batch_index they are assigned in")
    group_seeds = None
    if checkable:
        group_seeds = [
            group_seed(seed, i)
            if gumbel_key is None
            else assigned_seed(gumbel_key, sampler_id, batch_index, i, policy_version)
            for i in range(len(items))
        ]
    batch = sample_groups(
        model,
        tokenizer,
        [it["prompt"] for it in items],
        g,
        settings.temperature,
        settings.max_new_tokens,
        seed,
        gumbel_seeds=group_seeds,
    )
    # host side: the sampled batch is on the CPU (sample_groups brings it back from the model's device)
    rewards = torch.tensor(
        [score(text, items[i // g]) for i, text in enumerate(batch.texts)], dtype=torch.float32, device="cpu"
    )
    uids = [f"{uid_prefix}-{i // g}" for i in range(len(batch.texts))]
    advantages = sequence_advantages(rewards, batch.response_mask, uids, algorithm_config)
    now = time.time()
    precision = precision_of(model)  # declared in the signed record: the learner's tolerance for q depends on it
    groups = []
    for i, item in enumerate(items):
        rows = slice(i * g, (i + 1) * g)
        prompt_keep = batch.prompt_mask[i * g].bool()
        mask = batch.response_mask[rows]
        length = int(mask.sum(dim=-1).max())
        groups.append(
            RolloutGroup(
                group_uid=f"{uid_prefix}-{i}",
                prompt_ids=batch.prompt_ids[i * g][prompt_keep].numpy().astype(np.int64),
                response_ids=batch.response_ids[rows, :length].numpy().astype(np.int64),
                response_mask=mask[:, :length].numpy().astype(np.int8),
                sampler_logprobs=batch.sampler_logprobs[rows, :length].numpy().astype(np.float32),
                rewards=rewards[rows].numpy(),
                advantages=advantages[rows].numpy().astype(np.float32),
                policy_version=int(policy_version),
                sampler_id=sampler_id,
                created_at=now,
                extra={"answer": str(item.get("answer", "")), "texts": batch.texts[rows]},
                sampler_precision=precision,
                sampling_seed=None if group_seeds is None else group_seeds[i],
                batch_index=batch_index,
                batch_slot=None if batch_index is None else i,
            )
        )
    return groups
