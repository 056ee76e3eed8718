"""Sampler side of the embedded engine: prompts -> G responses each -> rewards -> advantages ->
validated :class:`~verl_ext.hetero.records.RolloutGroup` records.

Rewards and group advantages are computed where the rollouts are generated ("localized reward
computation", as in the paper), with verl's own advantage-estimator registry, so ``grpo`` /
``bnpo`` / ... mean exactly what they mean in verl.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch
from verl.trainer.ppo.core_algos import get_adv_estimator_fn

from .policy import sample_groups
from verl_ext.hetero.gumbel import group_seed
from verl_ext.hetero.precision import precision_of
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


@functools.lru_cache(maxsize=None)
def _parameters(fn: Callable) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(fn).parameters  # read once per estimator: the learner calls this for every group


ADVANTAGE_INPUTS = ("token_level_rewards", "response_mask", "index", "norm_adv_by_std_in_grpo", "config")
"""What :func:`sequence_advantages` gives an estimator: rewards, masks and group ids (no critic
values, reward baselines or log-probs)."""


def unfed_advantage_inputs(name: str) -> list[str]:
    """The required arguments of verl's estimator ``name`` that :func:`sequence_advantages` cannot
    give (``gae`` needs ``values``, ``remax`` ``reward_baselines``, ...): empty when it can run."""
    params = _parameters(get_adv_estimator_fn(name))
    return [
        k
        for k, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and k not in ADVANTAGE_INPUTS
    ]


def sequence_advantages(
    rewards: torch.Tensor, response_mask: torch.Tensor, uids: list[str], algorithm_config: Any
) -> torch.Tensor:
    """One advantage per sequence from verl's registered estimator. rewards [B], mask [B, R] -> [B].

    The reward sits on the last response token, as verl's reward managers put it.
    """
    name = algorithm_config.get("adv_estimator", "grpo")
    name = getattr(name, "value", name)
    fn = get_adv_estimator_fn(name)
    lengths = response_mask.sum(dim=-1)
    token_rewards = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    rows = torch.arange(len(rewards), device=response_mask.device)
    token_rewards[rows, (lengths - 1).clamp(min=0)] = rewards.float()
    kwargs: dict[str, Any] = {"token_level_rewards": token_rewards, "response_mask": response_mask.float()}
    params = _parameters(fn)
    if "index" in params:
        kwargs["index"] = np.array(uids, dtype=object)
    if "norm_adv_by_std_in_grpo" in params:
        kwargs["norm_adv_by_std_in_grpo"] = bool(algorithm_config.get("norm_adv_by_std_in_grpo", True))
    if "config" in params:
        kwargs["config"] = algorithm_config
    advantages, _ = fn(**kwargs)
    return (advantages * response_mask).sum(dim=-1) / lengths.clamp(min=1)


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
) -> list[RolloutGroup]:
    """Generate one rollout group per prompt item with the model's current weights.

    Args:
        items: prompt dicts with ``prompt`` (text fed to the model) and ``answer``.
        policy_version: the learner version these weights came from (stamped on every group).
        seed: sampling seed (same seed, same weights -> same tokens).
        uid_prefix: group uids are ``f"{uid_prefix}-{i}"``; must be unique across the run.
        checkable: ``hetero.trust.checkable_sampling``: each group drawn by seeded Gumbel-max, its
            seed (:func:`~verl_ext.hetero.gumbel.group_seed` of ``seed`` and i) in its record.
    """
    g = settings.group_size
    group_seeds = [group_seed(seed, i) for i in range(len(items))] if checkable else None
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
            )
        )
    return groups
