"""One reward entry point for mixed data: toy rows (``data_source`` starting with ``toy``) get the
toy exact-match reward, every other row the math reward. Both return the same keys.

    reward.custom_reward_function.path=pkg://verl_ext.rewards.dispatch
    reward.custom_reward_function.name=compute_score
"""

# No ``from __future__ import annotations``: verl may load this file by path (see math_reward).
from typing import Any

from verl_ext.rewards import math_reward, toy_reward

__all__ = ["compute_score"]


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> dict:
    """Route to :func:`toy_reward.compute_score` or :func:`math_reward.compute_score` by ``data_source``."""
    if not isinstance(data_source, str):
        raise TypeError(f"data_source must be a str, got {type(data_source).__name__}: {data_source!r:.80}")
    if data_source.startswith("toy"):
        return toy_reward.compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
    return math_reward.compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
