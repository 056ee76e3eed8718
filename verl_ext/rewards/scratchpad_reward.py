"""Reward of the toy task's long answers (``answer_format=scratchpad``, see :mod:`verl_ext.data.toy.problems`):
the response writes every column's sum and carry, then ``=`` and the zero-padded sum; only the sum
is rewarded: the toy reward's rule applied to the part after the first ``=`` (the scratchpad itself
is not checked).
Same signature and result keys as :func:`verl_ext.rewards.math_reward.compute_score`.
"""

# No ``from __future__ import annotations``: verl may load this file by path (see math_reward).
from typing import Any

from verl_ext.rewards.toy_reward import compute_score as toy_compute_score

__all__ = ["compute_score"]


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    **kwargs: Any,
) -> dict:
    """``score == acc`` is 1.0 iff the digits right after the first ``=`` equal ``ground_truth``.

    Args:
        data_source: dataset name (unused), e.g. ``toy_add3_scratch``.
        solution_str: decoded generation after the prompt, e.g. ``"750124811303104=0432"``.
        ground_truth: the zero-padded sum as a str of digits.
        extra_info, **kwargs: accepted and ignored (verl's reward-loop arguments).

    Returns:
        the toy reward's dict for the part after ``=`` (``pred`` its digits); ``error`` is
        "no_equals" when the response has no ``=``.
    """
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be a str, got {type(solution_str).__name__}: {solution_str!r:.200}")
    _, sep, answer = solution_str.strip().partition("=")
    result = toy_compute_score(data_source, answer, ground_truth)  # validates ground_truth too
    if not sep:
        result.update(score=0.0, acc=0.0, pred="", error="no_equals")
    return result
