"""Math reward: math_verify accuracy on the last ``\\boxed{}`` answer plus optional format terms.

Plugs into verl unchanged: ``reward.custom_reward_function.path=pkg://verl_ext.rewards.math_reward``
with ``name=compute_score`` (per-sample managers: naive, dapo) or ``compute_score_batch`` (verl's
``batch`` manager); ``reward_kwargs`` take any :class:`RewardConfig` field. Per response: ``pred``
is the last complete ``\\boxed{...}`` / ``\\fbox{...}`` (none: acc 0, ``"no_boxed"``, no
verification); in a worker process (:mod:`verl_ext.rewards.verify_pool`) under a wall-clock
``timeout_seconds`` (past it: acc 0, ``"timeout"``), math_verify checks ``verify(parse(gold),
parse(pred))``; a gold that parses to nothing is ``"gold_unparsable"`` and scores 0, never a free 1.
``score = accuracy_weight*acc + boxed_weight*format_boxed + think_weight*format_think +
answer_tag_weight*format_answer``: 1.0 or 0.0 with the defaults (the paper's reward). Every result
has the keys :data:`RESULT_KEYS` (verl stacks them per batch): ``score``, ``acc``, ``pred``,
``error`` (``""`` or one of the names above, or ``"pred_unparsable"``), the format terms,
``timeout`` and ``gold_unparsable`` (1.0/0.0).
"""

# No ``from __future__ import annotations`` here: verl loads this file by path without putting it
# in sys.modules, and dataclasses then cannot resolve string annotations.
import dataclasses
import math
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from verl_ext.rewards.extract import last_boxed_content
from verl_ext.rewards.verify_pool import get_pool

__all__ = [
    "RewardConfig",
    "RESULT_KEYS",
    "compute_score",
    "compute_score_batch",
    "score_batch",
    "reward_stats",
    "has_boxed",
    "think_format_ok",
    "answer_tag_ok",
]

RESULT_KEYS = (
    "score",
    "acc",
    "pred",
    "error",
    "format_boxed",
    "format_think",
    "format_answer",
    "timeout",
    "gold_unparsable",
)

# keyword arguments verl's reward loop may pass to every reward function; not ours, ignored.
_VERL_PASSTHROUGH_KWARGS = frozenset({"reward_router_address", "reward_model_tokenizer"})


@dataclass(frozen=True)
class RewardConfig:
    """Weights and limits of the math reward; ``score`` is the weighted sum of the terms."""

    #: weight of math_verify accuracy (1.0 when the last boxed answer equals the gold, else 0.0).
    accuracy_weight: float = 1.0
    #: weight of the "a complete \\boxed{...} answer is present" term (1.0/0.0).
    boxed_weight: float = 0.0
    #: weight of the think-format term: exactly one ``</think>``, at most one ``<think>`` which
    #: comes first (only whitespace before it), and non-blank text after ``</think>`` (1.0/0.0).
    #: The opening tag may be absent because some chat templates put it in the prompt.
    think_weight: float = 0.0
    #: weight of the answer-tag term: exactly one ``<answer>...</answer>`` with non-blank content,
    #: after ``</think>`` when there is one (1.0/0.0).
    answer_tag_weight: float = 0.0
    #: wall-clock seconds allowed for one verification (gold parse + prediction parse + verify);
    #: past it the worker process is killed and the response scores acc 0 with error "timeout".
    timeout_seconds: float = 10.0
    #: decimal places math_verify rounds floating-point numbers to before comparing them.
    float_rounding: int = 6
    #: size of the shared verification process pool; None: env HETERORL_REWARD_WORKERS or
    #: min(2, CPUs). Only the first call's value (or a larger one) takes effect.
    num_workers: int | None = None

    def __post_init__(self) -> None:
        for name in ("accuracy_weight", "boxed_weight", "think_weight", "answer_tag_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"RewardConfig.{name} must be a finite number, got {value!r}")
        t = self.timeout_seconds
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t > 0 and math.isfinite(t)):
            raise ValueError(f"RewardConfig.timeout_seconds must be a finite number > 0, got {t!r}")
        if isinstance(self.float_rounding, bool) or not isinstance(self.float_rounding, int) or self.float_rounding < 0:
            raise ValueError(f"RewardConfig.float_rounding must be an int >= 0, got {self.float_rounding!r}")
        n = self.num_workers
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"RewardConfig.num_workers must be None or an int >= 1, got {n!r}")


_FIELDS = frozenset(f.name for f in dataclasses.fields(RewardConfig))
_DEFAULT = RewardConfig()


def _resolve_config(config: RewardConfig | dict | None, overrides: dict[str, Any]) -> RewardConfig:
    unknown = set(overrides) - _FIELDS - _VERL_PASSTHROUGH_KWARGS
    if unknown:
        raise TypeError(f"unknown reward option(s) {sorted(unknown)}; RewardConfig fields are {sorted(_FIELDS)}")
    mine = {k: v for k, v in overrides.items() if k in _FIELDS}
    if config is None:
        return dataclasses.replace(_DEFAULT, **mine) if mine else _DEFAULT
    if isinstance(config, dict):
        return _resolve_config(None, {**config, **mine})
    if not isinstance(config, RewardConfig):
        raise TypeError(f"config must be a RewardConfig, a dict or None, got {type(config).__name__}")
    return dataclasses.replace(config, **mine) if mine else config


# ---------------------------------------------------------------------------------------------
# format terms (pure string checks)


def has_boxed(text: str) -> bool:
    """True when ``text`` contains a complete, non-empty ``\\boxed{...}`` (or ``\\fbox``)."""
    return last_boxed_content(text) is not None


def think_format_ok(text: str) -> bool:
    """True for ``[<think>] ... </think> <non-blank answer text>`` with one closing tag.

    At most one ``<think>``, which must open the response (only whitespace before it).
    """
    if text.count("</think>") != 1 or text.count("<think>") > 1:
        return False
    close = text.index("</think>")
    if "<think>" in text:
        open_ = text.index("<think>")
        if open_ > close or text[:open_].strip():
            return False
    return bool(text[close + len("</think>") :].strip())


_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def answer_tag_ok(text: str) -> bool:
    """True for exactly one ``<answer>...</answer>`` with non-blank content (after ``</think>``)."""
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return False
    m = _ANSWER_RE.search(text)
    if m is None or not m.group(1).strip():
        return False
    close_think = text.find("</think>")
    return close_think < 0 or m.start() > close_think


# ---------------------------------------------------------------------------------------------
# scoring


def _golds(ground_truth: Any) -> list[str]:
    if isinstance(ground_truth, str):
        return [ground_truth]
    if isinstance(ground_truth, bool):
        raise TypeError(f"ground_truth must be a str, a number or a list of them, got {ground_truth!r}")
    if isinstance(ground_truth, (int, float)):
        return [str(ground_truth)]
    if hasattr(ground_truth, "tolist"):  # numpy arrays / scalars from a parquet row
        return _golds(ground_truth.tolist())
    if isinstance(ground_truth, (list, tuple)) and ground_truth:
        out: list[str] = []
        for g in ground_truth:
            out.extend(_golds(g))
        return out
    raise TypeError(
        f"ground_truth must be a str, a number or a non-empty list of them, got {type(ground_truth).__name__}: "
        f"{ground_truth!r:.200}"
    )


def _check_solution(solution_str: Any) -> str:
    if not isinstance(solution_str, str):
        raise TypeError(f"solution_str must be a str, got {type(solution_str).__name__}: {solution_str!r:.200}")
    return solution_str


def _score_one(solution: str, golds: list[str], cfg: RewardConfig) -> dict:
    pred = last_boxed_content(solution)
    fmt_boxed = 1.0 if pred is not None else 0.0
    fmt_think = 1.0 if think_format_ok(solution) else 0.0
    fmt_answer = 1.0 if answer_tag_ok(solution) else 0.0
    acc = 0.0
    error = ""
    timeout = 0.0
    gold_bad = 0.0
    if pred is None:
        error = "no_boxed"
    else:
        result = get_pool(cfg.num_workers).check(golds, pred, cfg.timeout_seconds, cfg.float_rounding)
        status = result["status"]
        if status == "ok":
            acc = 1.0 if result["correct"] else 0.0
        else:
            error = status
            timeout = 1.0 if status == "timeout" else 0.0
            gold_bad = 1.0 if status == "gold_unparsable" else 0.0
    score = (
        cfg.accuracy_weight * acc
        + cfg.boxed_weight * fmt_boxed
        + cfg.think_weight * fmt_think
        + cfg.answer_tag_weight * fmt_answer
    )
    return {
        "score": float(score),
        "acc": acc,
        "pred": pred or "",
        "error": error,
        "format_boxed": fmt_boxed,
        "format_think": fmt_think,
        "format_answer": fmt_answer,
        "timeout": timeout,
        "gold_unparsable": gold_bad,
    }


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    config: RewardConfig | dict | None = None,
    **overrides: Any,
) -> dict:
    """Score one response; verl's custom-reward signature.

    Args:
        data_source: dataset name (unused by the maths; kept for verl's signature).
        solution_str: the decoded response (no prompt).
        ground_truth: the gold answer as a str (LaTeX or plain) or a number, or a list of
            acceptable golds (any match counts).
        extra_info: verl's per-row extra info (unused).
        config: a :class:`RewardConfig` (or a dict of its fields); default: accuracy only.
        **overrides: RewardConfig fields (verl passes ``reward_kwargs`` this way). Unknown names
            raise TypeError.

    Returns:
        dict with keys :data:`RESULT_KEYS`; ``score`` is the weighted total.
    """
    cfg = _resolve_config(config, overrides)
    return _score_one(_check_solution(solution_str), _golds(ground_truth), cfg)


def score_batch(
    solutions: Sequence[str],
    ground_truths: Sequence[Any],
    *,
    config: RewardConfig | dict | None = None,
    **overrides: Any,
) -> list[dict]:
    """Score ``solutions[i]`` against ``ground_truths[i]`` in parallel on the shared pool.

    Returns a list of result dicts (same order, same keys as :func:`compute_score`). Inputs are
    validated before any work starts; lengths must match.
    """
    cfg = _resolve_config(config, overrides)
    solutions = list(solutions)
    ground_truths = list(ground_truths)
    if len(solutions) != len(ground_truths):
        raise ValueError(
            f"score_batch needs one ground truth per solution, got {len(solutions)} solutions and "
            f"{len(ground_truths)} ground truths"
        )
    items = [(_check_solution(s), _golds(g)) for s, g in zip(solutions, ground_truths)]
    if not items:
        return []
    workers = get_pool(cfg.num_workers).num_workers
    if workers == 1 or len(items) == 1:
        return [_score_one(s, g, cfg) for s, g in items]
    # threads only wait on worker pipes: the pool bounds the real parallelism
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as ex:
        return list(ex.map(lambda item: _score_one(item[0], item[1], cfg), items))


def compute_score_batch(
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None] | None = None,
    **overrides: Any,
) -> list[dict]:
    """verl ``batch`` reward-manager signature; same results as :func:`score_batch`."""
    if len(data_sources) != len(solution_strs):
        raise ValueError(f"compute_score_batch got {len(data_sources)} data_sources for {len(solution_strs)} solutions")
    return score_batch(solution_strs, ground_truths, **overrides)


def reward_stats() -> dict:
    """Counters of this process's verification pool: calls, timeouts, worker_errors, workers_started."""
    return dict(get_pool().stats)
