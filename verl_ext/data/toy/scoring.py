"""Scoring the toy task: a model's sampled accuracy on a set of problems.

Every score goes through the reward registry (:mod:`verl_ext.rewards.dispatch`), picked by the
problems' ``data_source``, so a scratchpad problem set is scored with the scratchpad reward.
"""

from __future__ import annotations

import math

from verl_ext.data.toy.problems import is_scratchpad

__all__ = ["toy_accuracy", "scratchpad_score"]


def scratchpad_score(response: str, answer: str) -> float:
    """1.0 iff the response has an ``=`` and the leading digits after the first one equal
    ``answer`` exactly; the scratchpad itself is not checked. The long-answer reward
    (:func:`verl_ext.rewards.scratchpad_reward.compute_score`), as a float."""
    from verl_ext.rewards import scratchpad_reward

    return float(scratchpad_reward.compute_score("toy_scratch", response, answer)["acc"])


def toy_accuracy(
    model,
    tokenizer,
    problems: list[dict],
    temperature: float = 1.0,
    *,
    batch_size: int = 256,
    seed: int = 0,
    max_new_tokens: int | None = None,
    return_completions: bool = False,
):
    """Fraction of ``problems`` whose generated sum is exactly right (the reward of each
    problem's ``data_source``, 0..1).

    One completion per problem through ``model.generate`` (left-padded batches, so problems of
    different lengths can share a batch); ``temperature == 0`` is greedy, otherwise plain
    sampling (no top-k / top-p) at that temperature. The torch RNG is seeded with ``seed`` inside
    a forked RNG state, so the caller's RNG is untouched and results repeat.

    Args:
        problems: records from :func:`verl_ext.data.toy.problems.make_problems` (``problem``,
            ``answer``, ``data_source`` used; ``meta.target`` for scratchpad problems).
        max_new_tokens: default: longest correct response + 1 (room for ``</s>``).
        return_completions: also return the decoded completions (list of str, problem order).

    Returns:
        accuracy (float), or ``(accuracy, completions)``.
    """
    import torch

    from verl_ext.rewards.dispatch import compute_score
    from verl_ext.sampling import generate

    if not problems:
        raise ValueError("toy_accuracy needs at least one problem")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if max_new_tokens is None:
        max_new_tokens = max(len(p["meta"]["target"]) if is_scratchpad(p) else len(p["answer"]) for p in problems) + 1
    was_training = model.training
    model.eval()
    completions: list[str] = []
    try:
        # one seeded random stream across the batches (generate(seed=None) draws from it), in a
        # forked RNG state so the caller's stream is untouched
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for start in range(0, len(problems), batch_size):
                chunk = problems[start : start + batch_size]
                enc = tokenizer([p["problem"] for p in chunk], return_tensors="pt", padding=True)
                gen = generate(
                    model,
                    enc["input_ids"],
                    enc["attention_mask"],
                    max_new_tokens=max_new_tokens,
                    eos_token_ids=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    temperature=float(temperature),
                    with_log_q=False,
                )
                completions.extend(tokenizer.batch_decode(gen.tokens, skip_special_tokens=True))
    finally:
        model.train(was_training)
    correct = sum(compute_score(p["data_source"], c, p["answer"])["acc"] for c, p in zip(completions, problems))
    acc = correct / len(problems)
    return (acc, completions) if return_completions else acc
