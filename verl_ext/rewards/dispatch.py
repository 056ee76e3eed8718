"""The one reward entry point: a small registry of reward functions, picked by ``data_source``.

=================  ==========================================  ===================================
reward name        data_source                                 function
=================  ==========================================  ===================================
``toy_scratch``    starts with ``toy`` and ends with           :func:`scratchpad_reward.compute_score`
                   ``_scratch`` (``toy_add3_scratch``)         (only the sum after ``=`` counts)
``toy``            any other starting with ``toy``             :func:`toy_reward.compute_score`
                   (``toy_add3``)
``math``           everything else (``math500``, ``gsm8k``)    :func:`math_reward.compute_score`
=================  ==========================================  ===================================

Both engines score through it: the embedded engine's ``Task.score`` and verl's reward loop, with

    reward.custom_reward_function.path=pkg://verl_ext.rewards.dispatch
    reward.custom_reward_function.name=compute_score

(the ``cpu_toy`` preset sets this). Every function returns the same keys (``math_reward.RESULT_KEYS``).
"""

# No ``from __future__ import annotations``: verl may load this file by path (see math_reward).
from typing import Any, Callable, Dict

from verl_ext.rewards import math_reward, scratchpad_reward, toy_reward

__all__ = ["REWARDS", "compute_score", "reward_name"]

#: reward name -> verl-signature function ``(data_source, solution_str, ground_truth, extra_info, **kw) -> dict``
REWARDS: Dict[str, Callable[..., dict]] = {
    "toy_scratch": scratchpad_reward.compute_score,
    "toy": toy_reward.compute_score,
    "math": math_reward.compute_score,
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
