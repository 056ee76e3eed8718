"""Reward of the toy task's long answers (``answer_format=scratchpad``, see :mod:`verl_ext.data.toy.problems`):
the response writes every column's sum and carry, then ``=`` and the zero-padded sum; only the sum
is rewarded: the toy reward's rule applied to the part after the first ``=``.

The pad (the text before the first ``=``) is not read, by design: the task rewards the final
answer only, as math RL does (``docs/study.md``), so an empty, short, long or wrong pad with the
right sum (``"=0432"``, ``"810108=09"`` for 8 + 1) scores as the target does. A well-formed pad
(five digits per column, :func:`verl_ext.data.toy.problems.scratchpad_response`) is what the
warm start learns to write, a property of the model, not a condition of the reward; checking it
here would change the task the study's runs were rewarded on.
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

    Accepts (1.0) exactly: the stripped response has an ``=``, and the text after its first ``=``,
    stripped, starts with a run of digits equal to ``ground_truth`` (stripped); the run ends
    at the first non-digit or the end. So ``"81009=09"``, ``"81009=09</s>"``, ``"81009= 09"`` and
    ``"810108=09"`` score 1 for ``"09"``; ``"81009=091"``, ``"81009=9"``, ``"81009=08=09"`` (only
    the first ``=`` counts) and ``"09"`` (no ``=``) score 0. Whatever precedes the first ``=``
    is ignored (module docstring).

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
