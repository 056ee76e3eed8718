"""Toy addition problems: prompts, answers, the long (scratchpad) responses and the task's name.

``"047+385="`` -> ``"0432"``: both operands have exactly ``digits`` digits (zero-padded), the sum
``digits + 1``; zero padding fixes every sequence's length and the carry positions, so a tiny model
learns it quickly on the CPU. Long answers (``answer_format="scratchpad"``) first write every
column, least significant first, as five digits ``a_i b_i c_i s_i`` (the operand digits, the carry
in, the two-digit column sum), then ``=`` and the sum: ``"047+385="`` -> ``"75012" "48113" "03104"
"=0432"``. Only the final sum is rewarded (:func:`verl_ext.rewards.scratchpad_reward.compute_score`),
as in math RL; the scratchpad gives the policy 20-60 tokens a response, the regime where
length-normalised and token-level importance weights differ. :func:`toy_data_source` is the one
place that names the task (``toy_add3``, ``toy_add3_scratch``): the problems' ``data_source`` (which
picks the reward), the embedded engine's task and the warm start's cache folders take it from there.
"""

from __future__ import annotations

import random
import re
from typing import Any

__all__ = [
    "ANSWER_FORMATS",
    "check_answer_format",
    "check_digits",
    "toy_data_source",
    "make_problem",
    "make_problems",
    "scratchpad_response",
    "correct_response",
    "response_length",
    "is_scratchpad",
]

#: answer formats: "short" (the sum only) and "scratchpad" (column sums and carries, then the sum)
ANSWER_FORMATS = ("short", "scratchpad")


def check_digits(digits: Any) -> int:
    """``digits`` if it is an int in 1..9, else ``ValueError``."""
    if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= 9:
        raise ValueError(f"digits must be an int in 1..9, got {digits!r}")
    return digits


def check_answer_format(answer_format: Any) -> str:
    """``answer_format`` if it is one of :data:`ANSWER_FORMATS`, else ``ValueError``."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    return answer_format


def toy_data_source(digits: int, answer_format: str = "short") -> str:
    """The task's name: ``toy_add<digits>`` (short) or ``toy_add<digits>_scratch`` (scratchpad).

    It is the ``data_source`` of the problems (the reward registry routes ``*_scratch`` to the
    scratchpad reward), the embedded engine's ``Task.data_source`` and the prefix of the warm
    start's cache folders."""
    check_digits(digits)
    suffix = "" if check_answer_format(answer_format) == "short" else "_scratch"
    return f"toy_add{digits}{suffix}"


def make_problem(a: int, b: int, digits: int) -> tuple[str, str]:
    """``(prompt, answer)`` for ``a + b``: ``make_problem(47, 385, 3) == ("047+385=", "0432")``."""
    check_digits(digits)
    hi = 10**digits
    for name, v in (("a", a), ("b", b)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < hi:
            raise ValueError(f"{name} must be an int in [0, {hi}) for {digits} digits, got {v!r}")
    return f"{a:0{digits}d}+{b:0{digits}d}=", f"{a + b:0{digits + 1}d}"


def parse_problem(prompt: str, digits: int) -> tuple[int, int] | None:
    """``(a, b)`` of a prompt :func:`make_problem` writes, or None when ``prompt`` is not one:
    ``parse_problem("047+385=", 3) == (47, 385)``."""
    check_digits(digits)
    match = re.fullmatch(rf"(\d{{{digits}}})\+(\d{{{digits}}})=", prompt)
    return (int(match[1]), int(match[2])) if match else None


def scratchpad_response(a: int, b: int, digits: int) -> str:
    """The scratchpad target for ``a + b`` (without ``</s>``): per column from the least
    significant, ``a_i b_i c_i`` and the two-digit sum ``a_i + b_i + c_i``, then ``=`` and the
    zero-padded sum. ``scratchpad_response(47, 385, 3) == "750124811303104=0432"``."""
    _, answer = make_problem(a, b, digits)  # validates
    sa, sb = f"{a:0{digits}d}", f"{b:0{digits}d}"
    carry, cols = 0, []
    for i in range(digits - 1, -1, -1):
        da, db = int(sa[i]), int(sb[i])
        total = da + db + carry
        cols.append(f"{da}{db}{carry}{total:02d}")
        carry = total // 10
    return "".join(cols) + "=" + answer


def correct_response(a: int, b: int, digits: int, answer_format: str = "short") -> str:
    """The correct response to ``a + b`` (without ``</s>``): the sum, or the scratchpad then the sum."""
    if check_answer_format(answer_format) == "scratchpad":
        return scratchpad_response(a, b, digits)
    return make_problem(a, b, digits)[1]


def response_length(digits: int, answer_format: str = "short") -> int:
    """Tokens of a correct response including ``</s>``: digits + 2 (short), 6 digits + 3 (scratchpad)."""
    check_digits(digits)
    return digits + 2 if check_answer_format(answer_format) == "short" else 5 * digits + 1 + digits + 1 + 1


def make_problems(n: int, digits: int = 3, seed: int = 0, answer_format: str = "short") -> list[dict]:
    """``n`` random problems (operands uniform in [0, 10^digits), drawn with ``random.Random(seed)``).

    Returns benchmark records (the format of :func:`verl_ext.data.datasets.load_benchmark`):
    ``{"id": "toy_add3/<seed>/<i>", "problem": "047+385=", "answer": "0432", "data_source":
    "toy_add3", "meta": {"a": 47, "b": 385, "digits": 3}}``. With ``answer_format="scratchpad"``
    the operands are the same, ``meta`` also has ``"answer_format": "scratchpad"`` and
    ``"target"`` (the full scratchpad response), and ``data_source`` (and the id's prefix) is
    ``toy_add<digits>_scratch`` (:func:`toy_data_source`); ``answer`` stays the sum.
    """
    check_answer_format(answer_format)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    source = toy_data_source(digits, answer_format)
    rng = random.Random(seed)
    hi = 10**digits
    out = []
    for i in range(n):
        a, b = rng.randrange(hi), rng.randrange(hi)
        prompt, answer = make_problem(a, b, digits)
        rec = {
            "id": f"{source}/{seed}/{i}",
            "problem": prompt,
            "answer": answer,
            "data_source": source,
            "meta": {"a": a, "b": b, "digits": digits},
        }
        if answer_format == "scratchpad":
            rec["meta"].update(answer_format="scratchpad", target=scratchpad_response(a, b, digits))
        out.append(rec)
    return out


def is_scratchpad(problem: dict) -> bool:
    """Whether a :func:`make_problems` record asks for the scratchpad answer."""
    return (problem.get("meta") or {}).get("answer_format") == "scratchpad"
