"""How far an honest sampler's log-probs may be from the learner's re-scoring, per precision the
sampler declares, and the per-sampler sequential test that lets small systematic lies add up.

A sampler reports log q of the tokens it drew; the learner re-scores the same tokens under the
claimed version's weights. An honest sampler's q differs from the learner's by its arithmetic: a
few 1e-6 in fp32, a few 1e-2 per token in bf16 (vLLM's default), up to ~0.6 on single tokens. A
tolerance that separates honest from lying samplers must therefore know the sampler's precision:
the sampler declares it in its signed record (``RolloutGroup.sampler_precision``: ``"fp32"`` or
``"bf16"``, stamped by :func:`precision_of` from its model's dtype); a record without one, or with
another, is refused by name (``undeclared_precision`` / ``unknown_precision``).

Per checked group three statistics over its response tokens (:func:`group_mismatch`): the largest
|log q reported - log q re-scored|, the mean |Δ| per token, and the mismatch KL per token (k3,
exp(Δ) - 1 - Δ with Δ = log p - log q, the estimator of prime-rl's and of ``is/kl_sampler_learner``).
A group fails at once when one of them is over its precision's bound (:class:`Tolerance`); below
them, the mean |Δ| per token minus the precision's ``reference`` is summed per sampler over its
checked groups (a one-sided CUSUM, floored at 0: :class:`MismatchCusum`), and a group that takes the
sum over ``cusum_limit`` fails too. Honest noise sits below the reference and keeps the sum at 0;
a lie a little over it, on every group, adds up.

Every number of :data:`TOLERANCES` comes from a measurement named beside it: the GPU runs in
``/work/shared/reference/GPU_FIRST_RUN.md`` (sections 3 and 4: the toy model and SmolLM2-135M-Instruct
on an H200) and ``scripts/bench/bench_precision.py`` on this project's CPU (the toy model sampling in
bf16, re-scored in fp32; its table is in docs/reliability.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

UNDECLARED, UNKNOWN = "undeclared_precision", "unknown_precision"


@dataclass(frozen=True)
class Tolerance:
    """One precision's bounds on a checked group (see the module docstring).

    token_max: the largest |Δ log q| of any one token.
    group_mean_abs: the largest mean |Δ log q| per token of a group.
    group_kl: the largest mismatch KL (k3) per token of a group.
    reference: the mean |Δ| per token the CUSUM subtracts (above every honest group's typical value).
    cusum_limit: the sum of (mean |Δ| - reference) over a sampler's checked groups that fails it.
    bias_reference: the |mean signed Δ| per token the bias CUSUMs subtract.
    bias_limit: the sum of (±mean signed Δ - bias_reference) that fails a sampler.
    """

    token_max: float
    group_mean_abs: float
    group_kl: float
    reference: float
    cusum_limit: float
    bias_reference: float
    bias_limit: float


TOLERANCES: dict[str, Tolerance] = {
    # fp32. Honest, max |Δ| a token: 7.6e-6 (toy, CPU vs CPU), 3.9e-5 (toy, CUDA vs CPU), 6.7e-5 (SmolLM2,
    # CUDA vs CUDA); mean |Δ| a token at most 9.6e-6 (SmolLM2, CUDA vs CPU) -- GPU_FIRST_RUN.md 3, 4.
    # bench_precision.py (toy, CPU, 128 groups): max 1.0e-5, largest group mean 1.9e-6, largest
    # |mean signed Δ| 5e-7. token_max is hetero.trust.logprob_tolerance's default (1e-3: 15x the largest
    # honest token); reference 1e-4 is 10x the largest honest mean (SmolLM2's), bias_reference 3e-5 3x it
    # (|mean signed Δ| <= mean |Δ|): q off by 3e-4 a token, 3x under the per-token bound, fails at the 4th
    # checked group (the same test's measurement).
    "fp32": Tolerance(
        token_max=1e-3,
        group_mean_abs=1e-3,
        group_kl=1e-5,
        reference=1e-4,
        cusum_limit=1e-3,
        bias_reference=3e-5,
        bias_limit=1e-3,
    ),
    # bf16 sampler, re-scored in fp32 (or bf16). Honest, max |Δ| a token: 0.18 (toy, CUDA), 0.60 (SmolLM2,
    # CUDA bf16 vs fp32), 0.43 (bf16 vs bf16); mean |Δ| a token 4.6e-3 (toy), 0.033 / 0.037 (SmolLM2,
    # median over groups) -- GPU_FIRST_RUN.md 3, 4. bench_precision.py on the CPU, toy (128 groups of G=8):
    # max 0.15, largest group mean 0.022 (median 0.004), largest group KL 7.4e-4, largest |mean signed Δ|
    # 0.0092 (median 0.001); SmolLM2 (16 groups of G=4, 32 tokens at most): max 0.31, largest group mean
    # 0.058 (median 0.041), largest group KL 0.0029, largest |mean signed Δ| 0.0091 (median 0.0042). A liar
    # reporting q at T=0.7 for draws at T=1.0: mean |Δ| 0.53 a token (SmolLM2, CUDA), group median 0.74
    # (SmolLM2, CPU), 0.091 with group KL up to 1.5 (toy, CPU: the per-group bounds refuse 68% of its
    # groups). group_kl is prime-rl's accepted mean mismatch KL (0.015; 5x SmolLM2's largest honest group
    # on the CPU); group_mean_abs 0.15 is 2.6x SmolLM2's largest honest group mean; token_max 2.0 is 3.3x
    # SmolLM2's largest honest token; reference 0.08 is 1.4x SmolLM2's largest honest group mean and 2x
    # its median (0.05, tried first, was only 0.009 above that median: too thin a margin for honest
    # SmolLM2 samplers over a long run); bias_reference 0.02 is 2.2x the largest honest |mean
    # signed Δ| of both models. q lowered by 0.04 a token fails at the 5th checked group (the tiny toy model
    # of tests/recipe/embedded/test_trust_precision.py).
    "bf16": Tolerance(
        token_max=2.0,
        group_mean_abs=0.15,
        group_kl=0.015,
        reference=0.08,
        cusum_limit=0.3,
        bias_reference=0.02,
        bias_limit=0.1,
    ),
}
PRECISIONS = tuple(TOLERANCES)


def precision_of(model) -> str:
    """What a sampler declares: ``"fp32"`` / ``"bf16"`` from its model's first floating
    parameter (another dtype is named as torch names it, and refused by the learner)."""
    import torch

    names = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    for p in model.parameters():
        if p.is_floating_point():
            return names.get(p.dtype, str(p.dtype).replace("torch.", ""))
    return "fp32"


def precision_refusal(declared: Optional[str]) -> Optional[tuple[str, str]]:
    """None when ``declared`` is a known precision, else (reason, detail)."""
    if declared is None or declared == "":
        return UNDECLARED, f"the record declares no sampler_precision (one of {', '.join(PRECISIONS)})"
    if declared not in TOLERANCES:
        return UNKNOWN, f"sampler_precision={declared!r} is not one of {', '.join(PRECISIONS)}"
    return None


@dataclass(frozen=True)
class Mismatch:
    """One group's log q reported against re-scored, over its response tokens (Δ = log p
    re-scored - log q reported)."""

    token_max: float
    mean_abs: float
    kl: float
    tokens: int
    mean_signed: float = 0.0


def group_mismatch(reported: np.ndarray, rescored: np.ndarray, mask: np.ndarray) -> Mismatch:
    """The three statistics of the module docstring (NaN in either side makes them NaN)."""
    keep = np.asarray(mask).astype(bool)
    q = np.asarray(reported, np.float64)[keep]
    p = np.asarray(rescored, np.float64)[keep]
    if q.size == 0:
        return Mismatch(0.0, 0.0, 0.0, 0)
    delta = p - q
    with np.errstate(over="ignore", invalid="ignore"):
        kl = float(np.mean(np.expm1(delta) - delta))
    return Mismatch(float(np.max(np.abs(delta))), float(np.mean(np.abs(delta))), kl, int(q.size), float(np.mean(delta)))


def single_group_failure(m: Mismatch, tol: Tolerance, precision: str) -> Optional[str]:
    """The detail of the first per-group bound ``m`` is over, or None (NaN is over every bound)."""
    for name, value, bound in (
        ("max |Δ log q| a token", m.token_max, tol.token_max),
        ("mean |Δ log q| a token", m.mean_abs, tol.group_mean_abs),
        ("mismatch KL a token", m.kl, tol.group_kl),
    ):
        if not value <= bound:
            return f"{name} = {value:.3g} > {bound:g} ({precision})"
    return None


class MismatchCusum:
    """Per sampler, one-sided CUSUMs over its checked groups (thread use: one caller at a time, the
    gate's lock):

    - of the mean |Δ| a token above the precision's ``reference``: S <- max(0, S + mean_abs - reference),
      for lies that make q noisier than honest arithmetic does;
    - of the mean signed Δ a token beyond ``bias_reference``, one sum each way: U <- max(0, U +
      mean_signed - bias_reference), D <- max(0, D - mean_signed - bias_reference), for q shifted one
      way on every token (honest noise is close to zero-mean, so a bias shows in full).

    A group that takes a sum over its limit (``cusum_limit``, ``bias_limit``) fails, and that
    sampler's sums start again from 0."""

    def __init__(self):
        self.sums: dict[str, float] = {}  # sampler -> S (reported as trust/<sampler>/mismatch_cusum)
        self.bias: dict[str, tuple[float, float]] = {}  # sampler -> (U, D)

    def add(self, sampler_id: str, m: Mismatch, tol: Tolerance, precision: str) -> Optional[str]:
        """Add one checked group; the failure's detail when a sum crosses its limit, else None."""
        total = max(0.0, self.sums.get(sampler_id, 0.0) + m.mean_abs - tol.reference)
        up, down = self.bias.get(sampler_id, (0.0, 0.0))
        up = max(0.0, up + m.mean_signed - tol.bias_reference)
        down = max(0.0, down - m.mean_signed - tol.bias_reference)
        detail = None
        if total > tol.cusum_limit:
            detail = (
                f"the sum over this sampler's checked groups of (mean |Δ log q| a token - {tol.reference:g}) "
                f"= {total:.3g} > {tol.cusum_limit:g} ({precision}): a small lie, repeated"
            )
        elif max(up, down) > tol.bias_limit:
            sign = "above" if up > down else "below"
            detail = (
                f"q {sign} the re-scored log-probs: the sum over this sampler's checked groups of (|mean Δ log q| "
                f"a token - {tol.bias_reference:g}) = {max(up, down):.3g} > {tol.bias_limit:g} ({precision}): "
                f"a small lie, repeated"
            )
        if detail is not None:
            total, up, down = 0.0, 0.0, 0.0
        self.sums[sampler_id], self.bias[sampler_id] = total, (up, down)
        return detail

    def state_dict(self) -> dict:
        return {"sums": dict(self.sums), "bias": {k: list(v) for k, v in self.bias.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.sums = {str(k): float(v) for k, v in state.get("sums", {}).items()}
        self.bias = {str(k): (float(v[0]), float(v[1])) for k, v in state.get("bias", {}).items()}
