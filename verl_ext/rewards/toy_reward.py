"""Reward of the toy addition task (see :mod:`verl_ext.data.toy.problems`): exact match of the sum.

The response is what the model generated after the prompt ``"047+385="``; the gold is the
zero-padded sum ``"0432"`` (n+1 digits for n-digit operands). ``pred`` is the leading run of
digits of the stripped response, so ``"0432"`` and ``"0432</s>"`` both give ``"0432"``; anything
else (``"432"``, ``"04321"``, ``"0433"``) scores 0. Same signature and result keys as
:func:`verl_ext.rewards.math_reward.compute_score`, so the two can share a reward manager.
"""

# No ``from __future__ import annotations``: verl may load this file by path (see math_reward).
import re
from typing import Any

from verl_ext.rewards.math_reward import RESULT_KEYS

__all__ = ["compute_score", "extract_sum"]

_LEADING_DIGITS = re.compile(r"\d*")
_GOLD = re.compile(r"\d+")


def extract_sum(solution_str: str) -> str:
    """The leading run of ASCII digits of ``solution_str`` after stripping whitespace ("" if none)."""
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be a str, got {type(solution_str).__name__}: {solution_str!r:.200}")
    return _LEADING_DIGITS.match(solution_str.strip()).group(0)


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    **kwargs: Any,
) -> dict:
    """Score one toy response: ``score == acc`` is 1.0 iff the digits equal ``ground_truth``.

    Args:
        data_source: dataset name (unused).
        solution_str: decoded generation after the prompt, e.g. ``"0432"``.
        ground_truth: the zero-padded sum as a str of digits (an int is zero-padded to nothing,
            so pass the string).
        extra_info: unused.
        **kwargs: accepted and ignored (verl may pass reward-loop arguments).

    Returns:
        dict with keys ``RESULT_KEYS`` of the math reward; ``error`` is "no_answer" when the
        response starts with no digit.
    """
    if isinstance(ground_truth, int) and not isinstance(ground_truth, bool):
        ground_truth = str(ground_truth)
    if not isinstance(ground_truth, str) or not _GOLD.fullmatch(ground_truth.strip()):
        raise ValueError(f"toy ground_truth must be a string of digits such as '0432', got {ground_truth!r}")
    pred = extract_sum(solution_str)
    acc = 1.0 if pred == ground_truth.strip() else 0.0
    result = dict.fromkeys(RESULT_KEYS, 0.0)
    result.update(score=acc, acc=acc, pred=pred, error="" if pred else "no_answer")
    return result
