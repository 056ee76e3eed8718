"""The one reward entry point: a small registry of reward functions, picked by ``data_source``.

A ``data_source`` starting with ``toy`` and ending with ``_scratch`` (``toy_add3_scratch``) is
scored by :func:`scratchpad_reward.compute_score` (``toy_scratch``: only the sum after ``=``
counts); any other starting with ``toy`` by :func:`toy_reward.compute_score` (``toy``); everything
else (``math500``, ``gsm8k``) by :func:`math_reward.compute_score` (``math``). Every function
returns the same keys (``math_reward.RESULT_KEYS``). Both engines score through it: the embedded
engine's ``Task.score`` and verl's reward loop with
``reward.custom_reward_function.path=pkg://verl_ext.rewards.dispatch`` and ``name=compute_score``
(the ``cpu_toy`` preset sets them); the evaluation scores many responses of one data_source at
once with :func:`score_batch`.
"""

# No ``from __future__ import annotations``: verl may load this file by path (see math_reward).
from typing import Any, Callable, Dict, List, Sequence

from verl_ext.rewards import math_reward, scratchpad_reward, toy_reward

__all__ = ["REWARDS", "BATCH_REWARDS", "compute_score", "score_batch", "reward_name"]

#: reward name -> verl-signature function ``(data_source, solution_str, ground_truth, extra_info, **kw) -> dict``
REWARDS: Dict[str, Callable[..., dict]] = {
    "toy_scratch": scratchpad_reward.compute_score,
    "toy": toy_reward.compute_score,
    "math": math_reward.compute_score,
}

#: reward name -> ``(solution_strs, ground_truths, **kw) -> [dict]`` scoring many responses at once
#: (the math reward verifies them in parallel); a reward not listed is scored one response at a time
BATCH_REWARDS: Dict[str, Callable[..., List[dict]]] = {
    "math": math_reward.score_batch,
}


def reward_name(data_source: str) -> str:
    """The :data:`REWARDS` entry that scores rows of ``data_source`` (see the table above)."""
    if not isinstance(data_source, str):
        raise TypeError(f"data_source must be a str, got {type(data_source).__name__}: {data_source!r:.80}")
    if data_source.startswith("toy"):
        return "toy_scratch" if data_source.endswith("_scratch") else "toy"
    return "math"


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> dict:
    """Score one response with the reward :func:`reward_name` picks for ``data_source``."""
    return REWARDS[reward_name(data_source)](data_source, solution_str, ground_truth, extra_info, **kwargs)


def score_batch(
    data_source: str, solution_strs: Sequence[str], ground_truths: Sequence[Any], **kwargs: Any
) -> List[dict]:
    """Score ``solution_strs[i]`` against ``ground_truths[i]``, all rows of ``data_source``, with
    the reward :func:`reward_name` picks (its batch form when :data:`BATCH_REWARDS` has one)."""
    solution_strs, ground_truths = list(solution_strs), list(ground_truths)
    if len(solution_strs) != len(ground_truths):
        raise ValueError(
            f"score_batch needs one ground truth per solution, got {len(solution_strs)} solutions "
            f"and {len(ground_truths)} ground truths"
        )
    name = reward_name(data_source)
    if name in BATCH_REWARDS:
        return BATCH_REWARDS[name](solution_strs, ground_truths, **kwargs)
    reward = REWARDS[name]
    return [reward(data_source, s, g, None, **kwargs) for s, g in zip(solution_strs, ground_truths)]
