"""How far an honest sampler's log-probs may be from the learner's re-scoring, per precision the
sampler declares, and the per-sampler sequential tests that let small systematic lies add up.

An honest sampler's q differs from the learner's re-score by its arithmetic, so a bound must know
its precision: the signed record declares it (``RolloutGroup.sampler_precision``, ``"fp32"`` or
``"bf16"``, stamped by :func:`precision_of`); a record without one or with another is refused
(``undeclared_precision`` / ``unknown_precision``). Per checked group :func:`group_mismatch` gives
the largest |log q reported - log q re-scored| of a token, the mean |Δ| a token and the mismatch
KL a token (k3); a group fails when one is over its precision's :class:`Tolerance`, or when it takes
one of its sampler's one-sided CUSUMs (:class:`MismatchCusum`) over its limit. :data:`TOLERANCES`
and :data:`TIE_MARGINS` cite their measurements beside each number; :func:`calibrate` sets bf16's
from the run's own model (``python -m recipe.gepo.calibrate`` writes ``hetero.trust.bounds_file``),
and :class:`TrustBounds` says whose bounds a group gets. The tables and their evidence:
docs/reliability.md, "Re-scoring" and "Numbers".
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
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
    tie_margin: the token check's near-tie allowance (``verl_ext.trust.gumbel``); None: the
        precision's :data:`TIE_MARGINS` (a calibration sets its own).
    near_tie_rate: the share of checked tokens an honest sampler draws as near ties (a token not
        the noised best, within ``tie_margin`` of it); None: no near-tie test (the table's).
    near_tie_limit: the sum of the near-tie test's evidence (:func:`near_tie_evidence`) over a
        sampler's checked groups that fails it.
    """

    token_max: float
    group_mean_abs: float
    group_kl: float
    reference: float
    cusum_limit: float
    bias_reference: float
    bias_limit: float
    tie_margin: Optional[float] = None
    near_tie_rate: Optional[float] = None
    near_tie_limit: Optional[float] = None


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

TIE_MARGINS: dict[str, float] = {
    # fp32: the largest honest |Δ log q| a token is 6.7e-5 (SmolLM2, CUDA vs CUDA; GPU_FIRST_RUN.md 3,
    # 4): a margin 2e-3 is 15x twice that, and 1e-3 above the hetero.trust tolerance on one token.
    "fp32": 2e-3,
    # bf16: 0.60 is the largest honest |Δ log q| a token (SmolLM2, CUDA bf16 vs fp32; GPU_FIRST_RUN.md 4),
    # so two tokens' noised scores move apart by 1.2 at most; bf16's argmax differs from fp32's at
    # 1.95% of SmolLM2's tokens, with the best two within 0.1 at 1.6% (GPU_FIRST_RUN.md 5).
    "bf16": 1.2,
}
"""The token check's near-tie allowance (``verl_ext.trust.gumbel``): the largest (best - chosen) noised
score a checked token may have, per declared precision. The noised scores of two tokens move apart
between two computations by at most the sum of their |Δ log q|: twice the largest honest one."""


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


NEAR_TIE_FACTOR = 4.0
"""The near-tie test weighs a rate this many times the honest one against the honest one."""


def near_tie_evidence(tokens: int, near_ties: int, rate: float) -> float:
    """log-likelihood ratio of ``near_ties`` among ``tokens`` checked tokens under a rate
    :data:`NEAR_TIE_FACTOR` x the honest ``rate`` against the honest rate (binomial): positive when a
    group has more near ties than honest arithmetic makes, negative (a little, per token) otherwise.
    A sampler drawing from slightly other weights, or at a slightly other temperature, picks another
    token than its seed's noise selects where the best two are close: near ties, at a higher rate."""
    r1 = min(NEAR_TIE_FACTOR * rate, 0.5)
    return near_ties * float(np.log(r1 / rate)) + (tokens - near_ties) * float(np.log((1 - r1) / (1 - rate)))


class MismatchCusum:
    """Per sampler, one-sided CUSUMs over its checked groups (thread use: one caller at a time, the
    gate's lock):

    - of the mean |Δ| a token above the precision's ``reference``: S <- max(0, S + mean_abs - reference),
      for lies that make q noisier than honest arithmetic does;
    - of the mean signed Δ a token beyond ``bias_reference``, one sum each way: U <- max(0, U +
      mean_signed - bias_reference), D <- max(0, D - mean_signed - bias_reference), for q shifted one
      way on every token (honest noise is close to zero-mean, so a bias shows in full);
    - with a calibration's near-tie test (``near_tie_rate``), of :func:`near_tie_evidence` of each
      token-checked group: T <- max(0, T + evidence), for tokens drawn from slightly other weights
      or another temperature, which the token check's margin alone lets through.

    A group that takes a sum over its limit (``cusum_limit``, ``bias_limit``, ``near_tie_limit``)
    fails, and that sampler's sums start again from 0."""

    def __init__(self):
        self.sums: dict[str, float] = {}  # sampler -> S (reported as trust/<sampler>/mismatch_cusum)
        self.bias: dict[str, tuple[float, float]] = {}  # sampler -> (U, D)
        self.ties: dict[str, float] = {}  # sampler -> the near-tie test's sum (a calibration's bounds)

    def add(
        self, sampler_id: str, m: Mismatch, tol: Tolerance, precision: str, near_ties: Optional[tuple[int, int]] = None
    ) -> Optional[str]:
        """Add one checked group (``near_ties``: its token check's (tokens checked, near ties), when
        it had one); the failure's detail when a sum crosses its limit, else None."""
        total = max(0.0, self.sums.get(sampler_id, 0.0) + m.mean_abs - tol.reference)
        up, down = self.bias.get(sampler_id, (0.0, 0.0))
        up = max(0.0, up + m.mean_signed - tol.bias_reference)
        down = max(0.0, down - m.mean_signed - tol.bias_reference)
        ties = self.ties.get(sampler_id, 0.0)
        if near_ties is not None and near_ties[0] > 0 and tol.near_tie_rate is not None:
            ties = max(0.0, ties + near_tie_evidence(near_ties[0], near_ties[1], tol.near_tie_rate))
        detail = None
        if tol.near_tie_limit is not None and ties > tol.near_tie_limit:
            detail = (
                f"near ties in this sampler's checked tokens: the sum of their evidence against the honest rate "
                f"{tol.near_tie_rate:.3g} = {ties:.3g} > {tol.near_tie_limit:.3g} ({precision}): its tokens are "
                "not what its declared weights, temperature and seeds select, by small margins, repeatedly"
            )
        elif total > tol.cusum_limit:
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
            total, up, down, ties = 0.0, 0.0, 0.0, 0.0
        self.sums[sampler_id], self.bias[sampler_id] = total, (up, down)
        if ties or sampler_id in self.ties:
            self.ties[sampler_id] = ties
        return detail

    def state_dict(self) -> dict:
        return {"sums": dict(self.sums), "bias": {k: list(v) for k, v in self.bias.items()}, "ties": dict(self.ties)}

    def load_state_dict(self, state: dict) -> None:
        self.sums = {str(k): float(v) for k, v in state.get("sums", {}).items()}
        self.bias = {str(k): (float(v[0]), float(v[1])) for k, v in state.get("bias", {}).items()}
        self.ties = {str(k): float(v) for k, v in state.get("ties", {}).items()}


# ---------------------------------------------------------------------------------------------------
# Per-model calibration of bf16's bounds
#
# The table's bf16 bounds come from SmolLM2-135M's honest spread. A model whose honest bf16 arithmetic
# moves log q less (the toy: its largest group mean |Δ| 0.022 against SmolLM2's 0.058) lets lies
# under them through (q x 1.05 on the toy is never refused); a larger model, longer responses or
# other kernels may move it more and have honest samplers quarantined. A calibration measures the
# run's own model, at its own lengths, temperature and device (``python -m recipe.gepo.calibrate``),
# and ``hetero.trust.bounds_file`` puts its bounds in place of the table's.

CALIBRATION_RULE = {
    "token_max": "3 x the largest honest |Δ log q| a token, or 1.5 x the largest of `horizon` groups under a "
    "fit of the honest sample's upper tail (exponential past its 75th percentile), whichever is larger",
    "group_mean_abs": "2 x the largest honest group mean |Δ|, or 1.5 x the fit's largest of `horizon` groups",
    "group_kl": "4 x the largest honest group mismatch KL, or the square of 1.5 x the fit's largest sqrt(KL) of "
    "`horizon` groups",
    "tie_margin": "token_max's bound (two tokens' noised scores move apart by the sum of their |Δ|)",
    "reference": "the 90th percentile of honest group mean |Δ|, and at least 1.5 x their mean (so that an honest "
    "sampler's sum drifts down)",
    "bias_reference": "the 90th percentile of honest group |mean signed Δ|, and at least 1.5 x |their mean|",
    "cusum_limit": "1.5 x the largest sum any of `trials` simulated honest samplers reached in `horizon` "
    "checked groups (groups resampled from the sample, and drawn with the fitted tail)",
    "bias_limit": "the same rule for the signed sums, each way (drawn from a normal fit of the signed means)",
    "near_tie_rate": "the honest sample's near ties at tie_margin per checked token, counting one more than seen "
    "(null: the sample had no token check, checkable sampling off)",
    "near_tie_limit": "1.5 x the largest sum of near-tie evidence any simulated honest sampler reached in `horizon` "
    "checked groups (resampled), and at least log(horizon / false_alarm)",
}
"""How :func:`calibrate` turns a sample of honest groups into bounds (written into every bounds file)."""


class _HonestTail:
    """The upper tail of one honest statistic x >= 0, past the sample's 75th percentile u, modelled
    as exponential (peaks over a threshold): P(x > u + y) = share x exp(-y / scale), ``share`` the
    sample's fraction above u, ``scale`` their mean excess. A sample of a hundred groups says
    little about the tail a run of ten thousand checked groups reaches; this extrapolates it from
    the sample's own largest values (and from no assumption about the bulk: bf16 against bf16 on
    one machine is exactly 0 in most groups)."""

    def __init__(self, values: np.ndarray):
        self.values = values
        self.threshold = float(np.percentile(values, 75))
        above = values[values > self.threshold]
        self.share = len(above) / max(len(values), 1)
        self.scale = float((above - self.threshold).mean()) if len(above) else 0.0

    def largest_of(self, n: int, false_alarm: float) -> float:
        """The value the largest of ``n`` draws exceeds with probability ``false_alarm``."""
        if self.share == 0:
            return self.threshold
        return self.threshold + self.scale * max(0.0, float(np.log(self.share * n / false_alarm)))

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """Groups resampled from the sample, those past the threshold redrawn from the tail."""
        x = rng.choice(self.values, size=size)
        tail = x > self.threshold
        x[tail] = self.threshold + rng.exponential(self.scale, int(tail.sum()))
        return x


def _largest_cusum_sum(draw, reference: float, horizon: int, trials: int) -> float:
    """The largest one-sided CUSUM max(0, S + x - reference) any of ``trials`` simulated honest
    samplers reaches over ``horizon`` checked groups, ``draw(size)`` giving each step's x."""
    sums = np.zeros(trials)
    peak = 0.0
    for _ in range(horizon):
        sums = np.maximum(0.0, sums + draw(trials) - reference)
        peak = max(peak, float(sums.max()))
    return peak


def calibrate(
    honest: list[Mismatch],
    horizon: int = 10_000,
    trials: int = 200,
    seed: int = 0,
    false_alarm: float = 0.01,
    token_margins: Optional[list[np.ndarray]] = None,
) -> Tolerance:
    """Bounds for one precision from a sample of honest groups (:data:`CALIBRATION_RULE`), set so
    that an honest sampler sending ``horizon`` checked groups is failed with probability about
    ``false_alarm`` at most: each per-group bound the larger of a multiple of the sample's largest
    value and 1.5x the largest of ``horizon`` groups under the sample's fitted tail
    (:class:`_HonestTail`); the CUSUMs' references a high percentile (above the honest mean), their
    limits 1.5x the largest sum any of ``trials`` simulated honest samplers reached, groups drawn
    from the sample and from the fitted tail. ``token_margins``: per honest group, its checked
    tokens' noised margins (:func:`verl_ext.trust.gumbel.noised_margins`), which set the near-tie
    test (:func:`near_tie_evidence`); None: no near-tie test."""
    if len(honest) < 16:
        raise ValueError(f"calibrate: {len(honest)} honest groups; at least 16 are needed for a percentile")
    token = np.asarray([m.token_max for m in honest], np.float64)
    mean_abs = np.asarray([m.mean_abs for m in honest], np.float64)
    kl = np.asarray([m.kl for m in honest], np.float64)
    signed = np.asarray([m.mean_signed for m in honest], np.float64)
    if not all(np.isfinite(v).all() for v in (token, mean_abs, kl, signed)):
        raise ValueError("calibrate: an honest group's mismatch is NaN or infinite")
    rng = np.random.default_rng(seed)

    def bound(values: np.ndarray, multiple: float, power: int = 1) -> float:
        """The per-group bound; ``power`` 2 for the KL, a square of |Δ| (its tail fitted on sqrt(KL),
        which is on |Δ|'s scale: an exponential tail of the KL itself is too light)."""
        tail = _HonestTail(values ** (1.0 / power)).largest_of(horizon, false_alarm)
        return max(multiple * float(values.max()), (1.5 * tail) ** power)

    def limit(values: np.ndarray, reference: float, fitted) -> float:
        resampled = _largest_cusum_sum(lambda size: rng.choice(values, size=size), reference, horizon, trials)
        return 1.5 * max(resampled, _largest_cusum_sum(fitted, reference, horizon, trials))

    mean_abs_tail = _HonestTail(mean_abs)
    # the signed mean is close to zero-mean noise: a normal fit
    mu, sigma = float(signed.mean()), float(signed.std(ddof=1))

    # above the honest mean, or an honest sampler's sum grows without end (a sample whose groups
    # are mostly exact, bf16 against bf16 on one machine, has a 90th percentile of 0)
    reference = max(float(np.percentile(mean_abs, 90)), 1.5 * float(mean_abs.mean()))
    bias_reference = max(float(np.percentile(np.abs(signed), 90)), 1.5 * abs(mu))
    tiny = 1e-9  # a sample of identical arithmetic gives zeros: keep bounds > 0
    token_bound = max(bound(token, 3.0), tiny)
    near_tie_rate = near_tie_limit = None
    if token_margins is not None and sum(len(m) for m in token_margins) > 0:
        checked = [len(m) for m in token_margins]
        ties = [int(((np.asarray(m) > 0) & (np.asarray(m) <= token_bound)).sum()) for m in token_margins]
        near_tie_rate = (sum(ties) + 1) / (sum(checked) + 1)  # a sample without a near tie is not a rate of 0
        evidence = np.asarray([near_tie_evidence(n, k, near_tie_rate) for n, k in zip(checked, ties)])
        resampled = _largest_cusum_sum(lambda size: rng.choice(evidence, size=size), 0.0, horizon, trials)
        near_tie_limit = max(1.5 * resampled, float(np.log(horizon / false_alarm)))
    return Tolerance(
        token_max=token_bound,
        group_mean_abs=max(bound(mean_abs, 2.0), tiny),
        group_kl=max(bound(np.maximum(kl, 0.0), 4.0, power=2), tiny),
        reference=max(reference, tiny),
        cusum_limit=max(limit(mean_abs, reference, lambda size: mean_abs_tail.draw(rng, size)), tiny),
        bias_reference=max(bias_reference, tiny),
        bias_limit=max(
            limit(signed, bias_reference, lambda size: rng.normal(mu, sigma, size)),
            limit(-signed, bias_reference, lambda size: rng.normal(-mu, sigma, size)),
            tiny,
        ),
        tie_margin=token_bound,
        near_tie_rate=near_tie_rate,
        near_tie_limit=near_tie_limit,
    )


@dataclass(frozen=True)
class TrustBounds:
    """The bounds a run's checks apply: :data:`TOLERANCES` and :data:`TIE_MARGINS`, with
    ``logprob_tolerance`` as fp32's bound on one token and a calibration's bounds in place of the
    table's for the precisions it names (``hetero.trust.bounds_file``: bf16).

    Whose bounds a group gets: the precision it declares, or bf16's when the learner re-scores in
    bf16 (``hetero.sampler_precision=bf16``: the re-score has bf16's spread itself)."""

    logprob_tolerance: float = 1e-3
    calibrated: dict = field(default_factory=dict)  # precision -> Tolerance

    def bounds_precision(self, scorer_precision: str, precision: str) -> str:
        return "bf16" if scorer_precision == "bf16" else precision

    def tolerance(self, scorer_precision: str, precision: str) -> Tolerance:
        """The bounds for a sampler declaring ``precision`` (a known one) to a scorer in ``scorer_precision``."""
        precision = self.bounds_precision(scorer_precision, precision)
        if precision in self.calibrated:
            return self.calibrated[precision]
        tolerance = TOLERANCES[precision]
        return replace(tolerance, token_max=float(self.logprob_tolerance)) if precision == "fp32" else tolerance

    def tie_margin(self, scorer_precision: str, precision: str) -> float:
        """The token check's near-tie margin for that sampler."""
        tolerance = self.tolerance(scorer_precision, precision)
        if tolerance.tie_margin is not None:
            return float(tolerance.tie_margin)
        return TIE_MARGINS[self.bounds_precision(scorer_precision, precision)]


CALIBRATED_PRECISIONS = ("bf16",)
"""What a bounds file may name: fp32's honest spread is arithmetic noise at 1e-5 a token, bounded by
``hetero.trust.logprob_tolerance`` and the table; bf16's depends on the model."""
BOUND_FIELDS = tuple(f.name for f in fields(Tolerance))
OPTIONAL_BOUNDS = ("near_tie_rate", "near_tie_limit")
"""Fields a bounds file may set to null (no near-tie test: the calibration had no token check)."""
MATCHED_FACTS = ("model", "scorer_precision", "temperature")
"""What a bounds file records about its measurement and a run using it must share (the honest spread
depends on each); the rest (device, lengths, groups) is recorded for the reader."""


def bounds_file_payload(precision: str, tolerance: Tolerance, measured: dict) -> dict:
    """The JSON a calibration writes: ``bounds`` (precision -> fields), ``measured`` (what, where,
    the honest sample's statistics; :data:`MATCHED_FACTS` among them) and ``rule`` (a tolerance
    without its own tie margin gets the precision's :data:`TIE_MARGINS`)."""
    if tolerance.tie_margin is None:
        tolerance = replace(tolerance, tie_margin=TIE_MARGINS[precision])
    return {
        "bounds": {precision: {name: getattr(tolerance, name) for name in BOUND_FIELDS}},
        "measured": measured,
        "rule": CALIBRATION_RULE,
    }


def read_bounds_file(path: str, key: str = "hetero.trust.bounds_file") -> tuple[dict, dict]:
    """(precision -> :class:`Tolerance`, the ``measured`` facts) of a bounds file; ValueError naming
    ``key`` and the bad part (unreadable, not JSON, a precision it may not name, a missing,
    unknown or non-positive field, a missing fact of :data:`MATCHED_FACTS`)."""
    import json
    import math

    where = f"{key}={path!r}"
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as err:
        raise ValueError(f"{where}: cannot be read ({err.strerror or err})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("bounds"), dict) or not data["bounds"]:
        raise ValueError(f"{where}: expected an object with 'bounds' (python -m recipe.gepo.calibrate writes one)")
    measured = data.get("measured")
    if not isinstance(measured, dict) or any(fact not in measured for fact in MATCHED_FACTS):
        raise ValueError(f"{where}: 'measured' must record {', '.join(MATCHED_FACTS)}")
    bounds = {}
    for precision, values in data["bounds"].items():
        if precision not in CALIBRATED_PRECISIONS:
            raise ValueError(
                f"{where}: bounds for {precision!r}; a bounds file calibrates {', '.join(CALIBRATED_PRECISIONS)} "
                "(fp32's bound on one token is hetero.trust.logprob_tolerance)"
            )
        if not isinstance(values, dict):
            raise ValueError(f"{where}: bounds.{precision} must be an object of {', '.join(BOUND_FIELDS)}")
        unknown = sorted(set(values) - set(BOUND_FIELDS))
        missing = [name for name in BOUND_FIELDS if name not in values]
        if unknown or missing:
            raise ValueError(f"{where}: bounds.{precision}: unknown {unknown}, missing {missing}")
        for name, value in values.items():
            if value is None and name in OPTIONAL_BOUNDS:
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise ValueError(f"{where}: bounds.{precision}.{name}={value!r} must be a finite number > 0")
        if (values["near_tie_rate"] is None) != (values["near_tie_limit"] is None):
            raise ValueError(f"{where}: bounds.{precision}: near_tie_rate and near_tie_limit are both null or both set")
        bounds[precision] = Tolerance(**{name: None if v is None else float(v) for name, v in values.items()})
    return bounds, measured
