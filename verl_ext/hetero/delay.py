"""Delay models for emulating heterogeneous, geographically spread compute.

A delay model draws non-negative delays in the caller's unit: seconds in async runs (until a
sampler sees new weights), learner steps in replay (how many versions behind a batch is). Models
(:func:`make_delay_model`): ``none``, ``constant``, ``uniform`` (``integer=True``: the whole numbers
low..high), ``lognormal`` / ``weibull`` (``low`` and ``high`` the (1-c)/2 and 1-(1-c)/2 quantiles of
an underlying T, the delay ``clip(T - offset, low, high)``: the GEPO paper's emulation) and
``trace`` (measured delays from a file). Each has ``sample(n, rng) -> float64 [n]``, depending only
on the ``numpy.random.Generator`` passed in, and ``summary()``.

:class:`DelaySchedule` is the one rule from a model to a run's delays, for every engine and mode:
item ``key``'s delay for receiver ``stream`` is one draw from ``default_rng([seed, key, stream])``
times the receiver's speed factor (learner steps: rounded half to even, capped): receivers draw
independently, and a delay never depends on when or how often it is asked. Settings, CLI: docs/heterogeneity.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from scipy.special import ndtri  # standard normal quantile; far lighter to import than scipy.stats

DISTRIBUTIONS = ("none", "constant", "uniform", "lognormal", "weibull", "trace")
DEFAULT_CONFIDENCE = 0.995


@dataclass(frozen=True)
class DelaySummary:
    """Empirical summary of a delay model, in the model's unit (seconds or steps).

    Computed from ``n_samples`` draws with ``seed``; ``frac_at_low`` / ``frac_at_high`` are the
    fractions of draws that the clip pinned to ``low`` / ``high`` (0 for unclipped models).
    """

    median: float
    mean: float
    p95: float
    max: float
    min: float
    frac_at_low: float
    frac_at_high: float
    n_samples: int
    seed: int


class DelayModel(ABC):
    """Base class: a distribution of non-negative delays."""

    name: str = "abstract"

    @abstractmethod
    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Draw ``n`` delays; returns float64 array of shape (n,), every value >= 0."""

    def params(self) -> dict:
        """The parameters that define this model (for logs and the CLI)."""
        return {}

    def summary(self, n_samples: int = 200_000, seed: int = 0) -> DelaySummary:
        """Median, mean, p95, max (and min, clip fractions) over ``n_samples`` seeded draws."""
        if n_samples < 1:
            raise ValueError(f"n_samples={n_samples} must be >= 1")
        draws = self.sample(n_samples, np.random.default_rng(seed))
        low, high = self._clip_bounds()
        return DelaySummary(
            median=float(np.median(draws)),
            mean=float(np.mean(draws)),
            p95=float(np.quantile(draws, 0.95)),
            max=float(np.max(draws)),
            min=float(np.min(draws)),
            frac_at_low=float(np.mean(draws <= low)) if low is not None else 0.0,
            frac_at_high=float(np.mean(draws >= high)) if high is not None else 0.0,
            n_samples=n_samples,
            seed=seed,
        )

    def _clip_bounds(self) -> tuple[float | None, float | None]:
        return None, None


def _check_n(n: int) -> int:
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n={n!r} must be a non-negative integer")
    return int(n)


class NoDelay(DelayModel):
    """Zero delay: every message is visible at once, every batch is on-policy."""

    name = "none"

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.zeros(_check_n(n), dtype=np.float64)


class ConstantDelay(DelayModel):
    """Every delay equals ``value`` (>= 0, in the caller's unit)."""

    name = "constant"

    def __init__(self, value: float):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"constant: value={value} must be finite and >= 0")
        self.value = float(value)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(_check_n(n), self.value, dtype=np.float64)

    def params(self) -> dict:
        return {"value": self.value}


class UniformDelay(DelayModel):
    """Uniform on [low, high] (0 <= low <= high, finite); ``integer=True``: the whole numbers
    low..high, each with probability 1 / (high - low + 1) (both bounds must then be whole)."""

    name = "uniform"

    def __init__(self, low: float, high: float, integer: bool = False):
        if not (math.isfinite(low) and math.isfinite(high) and 0 <= low <= high):
            raise ValueError(f"uniform: low={low}, high={high} must be finite with 0 <= low <= high")
        if integer and (float(low) != int(low) or float(high) != int(high)):
            raise ValueError(f"uniform: integer=True needs whole bounds, got low={low}, high={high}")
        self.low, self.high, self.integer = float(low), float(high), bool(integer)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        n = _check_n(n)
        if self.integer:  # the same draws as a trace of the values low..high resampled (uni<K>)
            return self.low + rng.integers(0, int(self.high - self.low) + 1, size=n).astype(np.float64)
        return rng.uniform(self.low, self.high, size=n)

    def params(self) -> dict:
        return {"low": self.low, "high": self.high, "integer": self.integer}


def _check_bounds(name: str, low: float, high: float, confidence: float, offset: float) -> None:
    if not (math.isfinite(low) and low > 0):
        raise ValueError(f"{name}: low={low} must be finite and > 0")
    if not math.isfinite(high):
        raise ValueError(f"{name}: high={high} must be finite")
    if not low < high:
        raise ValueError(f"{name}: low={low} must be < high={high}")
    if not 0 < confidence < 1:
        raise ValueError(f"{name}: confidence={confidence} must be in (0, 1)")
    if not math.isfinite(offset):
        raise ValueError(f"{name}: offset={offset} must be finite")


class _ClippedQuantileModel(DelayModel):
    """Shared part of lognormal and Weibull: T has quantiles ``low``/``high`` at
    (1-c)/2 and 1-(1-c)/2; the delay is clip(T - offset, low, high)."""

    def __init__(self, low: float, high: float, confidence: float = DEFAULT_CONFIDENCE, offset: float = 0.0):
        _check_bounds(self.name, low, high, confidence, offset)
        self.low, self.high = float(low), float(high)
        self.confidence, self.offset = float(confidence), float(offset)

    @property
    def quantile_levels(self) -> tuple[float, float]:
        """(p_low, p_high) = ((1-c)/2, 1-(1-c)/2): where low and high sit in T's distribution."""
        tail = (1.0 - self.confidence) / 2.0
        return tail, 1.0 - tail

    @abstractmethod
    def sample_underlying(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Draw the unclipped, unshifted T; float64 array of shape (n,)."""

    @abstractmethod
    def underlying_quantile(self, p: float | np.ndarray) -> np.ndarray:
        """Exact quantile function of T."""

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.clip(self.sample_underlying(_check_n(n), rng) - self.offset, self.low, self.high)

    def _clip_bounds(self) -> tuple[float | None, float | None]:
        return self.low, self.high

    def params(self) -> dict:
        return {"low": self.low, "high": self.high, "confidence": self.confidence, "offset": self.offset}


class LogNormalDelay(_ClippedQuantileModel):
    """T ~ LogNormal(mu, sigma) with mu = (ln L + ln U)/2, sigma = (ln U - ln L)/(2 z),
    z = Phi^-1(1 - (1-c)/2): the paper's closed form, so L and U are T's tail quantiles."""

    name = "lognormal"

    def __init__(self, low: float, high: float, confidence: float = DEFAULT_CONFIDENCE, offset: float = 0.0):
        super().__init__(low, high, confidence, offset)
        z = float(ndtri(self.quantile_levels[1]))
        self.mu = (math.log(self.low) + math.log(self.high)) / 2.0
        self.sigma = (math.log(self.high) - math.log(self.low)) / (2.0 * z)

    def sample_underlying(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return rng.lognormal(mean=self.mu, sigma=self.sigma, size=n)

    def underlying_quantile(self, p):
        return np.exp(self.mu + self.sigma * ndtri(p))

    def params(self) -> dict:
        return {**super().params(), "mu": self.mu, "sigma": self.sigma}


class WeibullDelay(_ClippedQuantileModel):
    """T ~ Weibull(shape k, scale lam), solved so L and U are T's (1-c)/2 and 1-(1-c)/2 quantiles.

    Weibull's quantile is Q(p) = lam * (-ln(1-p))^(1/k), so ln Q is affine in 1/k and the two
    quantile equations solve exactly: 1/k = (ln U - ln L) / (ln g_hi - ln g_lo),
    g = -ln(1-p); then lam = L / g_lo^(1/k).
    """

    name = "weibull"

    def __init__(self, low: float, high: float, confidence: float = DEFAULT_CONFIDENCE, offset: float = 0.0):
        super().__init__(low, high, confidence, offset)
        p_lo, p_hi = self.quantile_levels
        g_lo, g_hi = -math.log1p(-p_lo), -math.log1p(-p_hi)
        inv_shape = (math.log(self.high) - math.log(self.low)) / (math.log(g_hi) - math.log(g_lo))
        self.shape = 1.0 / inv_shape
        self.scale = self.low / g_lo**inv_shape

    def sample_underlying(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return self.scale * rng.weibull(self.shape, size=n)

    def underlying_quantile(self, p):
        return self.scale * (-np.log1p(-np.asarray(p, dtype=np.float64))) ** (1.0 / self.shape)

    def params(self) -> dict:
        return {**super().params(), "shape": self.shape, "scale": self.scale}


class TraceDelay(DelayModel):
    """Replays measured delays.

    Args:
        path: text file with one number a line (blank lines and ``#`` comments skipped), or a CSV
            file (``.csv`` suffix, header row) from which ``column`` is read.
        column: CSV column name or 0-based index; required for CSV files.
        values: the delays themselves, instead of ``path`` (exactly one of the two).
        order: ``"resample"`` draws i.i.d. from the measured values with the given rng (each
            sampler gets its own sequence); ``"sequential"`` replays them in file order, cycling,
            starting at a position drawn from the rng -- within one ``sample(n, rng)`` call only:
            :class:`DelaySchedule` (every engine and mode) refuses it. Python API (and the CLI's
            ``--order``) only; ``hetero.delay`` has no key for it.
        scale: multiplies every value (e.g. 1e-3 for a trace in milliseconds); Python API only.
    """

    name = "trace"

    def __init__(
        self,
        path: str | Path | None = None,
        column: str | int | None = None,
        values: Sequence[float] | None = None,
        order: str = "resample",
        scale: float = 1.0,
    ):
        if (path is None) == (values is None):
            raise ValueError("trace: give exactly one of path= or values=")
        if order not in ("resample", "sequential"):
            raise ValueError(f"trace: order={order!r} must be 'resample' or 'sequential'")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"trace: scale={scale} must be finite and > 0")
        self.path = None if path is None else str(path)
        self.column, self.order, self.scale = column, order, float(scale)
        raw = _read_trace(Path(path), column) if path is not None else [("values", i, v) for i, v in enumerate(values)]
        parsed = []
        for source, index, value in raw:
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"trace: {source} entry {index}: {value!r} is not a number") from None
            if not math.isfinite(number) or number < 0:
                raise ValueError(f"trace: {source} entry {index}: delay {number} must be finite and >= 0")
            parsed.append(number * self.scale)
        if not parsed:
            raise ValueError(f"trace: no delays found in {self.path or 'values'}")
        self.values = np.asarray(parsed, dtype=np.float64)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        n = _check_n(n)
        if self.order == "resample":
            return self.values[rng.integers(0, len(self.values), size=n)]
        start = int(rng.integers(0, len(self.values)))
        return self.values[(start + np.arange(n)) % len(self.values)]

    def params(self) -> dict:
        return {
            "path": self.path,
            "column": self.column,
            "order": self.order,
            "scale": self.scale,
            "n_values": int(len(self.values)),
        }


def _read_trace(path: Path, column: str | int | None) -> list[tuple[str, int, str]]:
    if not path.is_file():
        raise ValueError(f"trace: path={str(path)!r} is not a file")
    if path.suffix.lower() == ".csv":
        if column is None:
            raise ValueError(f"trace: {path} is a CSV file; pass column= (name or 0-based index)")
        with path.open(newline="") as handle:
            rows = list(csv.reader(handle))
        if not rows:
            raise ValueError(f"trace: {path} is empty")
        header, body = rows[0], rows[1:]
        if isinstance(column, str) and not column.isdigit():
            if column not in header:
                raise ValueError(f"trace: column={column!r} not in {path} header {header}")
            col = header.index(column)
        else:
            col = int(column)
            if not 0 <= col < len(header):
                raise ValueError(f"trace: column={column} out of range for {path} ({len(header)} columns)")
        # line numbers are 1-based and count the header, so errors point at the file line
        return [
            (str(path), line_no, row[col] if col < len(row) else "")
            for line_no, row in enumerate(body, start=2)
            if any(cell.strip() for cell in row)
        ]
    entries = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if text:
            entries.append((str(path), line_no, text))
    return entries


_MODELS = {
    "none": NoDelay,
    "constant": ConstantDelay,
    "uniform": UniformDelay,
    "lognormal": LogNormalDelay,
    "weibull": WeibullDelay,
    "trace": TraceDelay,
}


def make_delay_model(dist: str, **params) -> DelayModel:
    """Build a delay model by name. ``dist`` in none, constant, uniform, lognormal, weibull, trace;
    ``params`` are the model's constructor arguments (see each class)."""
    if dist not in _MODELS:
        raise ValueError(f"unknown delay dist={dist!r}; expected one of {', '.join(DISTRIBUTIONS)}")
    try:
        return _MODELS[dist](**params)
    except TypeError as err:  # unknown or missing keyword: name the model in the message
        raise ValueError(f"{dist}: bad parameters {sorted(params)}: {err}") from None


def to_steps(delay: float, cap: int | None = None) -> int:
    """A delay in whole learner steps: rounded half to even (Python's ``round``), then capped at
    ``cap`` (>= 0) if given."""
    if cap is not None and cap < 0:
        raise ValueError(f"cap={cap} must be >= 0")
    steps = int(round(float(delay)))
    return steps if cap is None else min(steps, int(cap))


class DelaySchedule:
    """The delays of one run (see the module docstring): a pure function of (seed, key, stream).

    Args:
        model: the delay model (``hetero.delay``).
        seed: root seed (``hetero.seed``).

    Streams (:mod:`verl_ext.hetero.seeding`): 0 = the learner receiving rollouts, i + 1 =
    sampler i. Replay mode's emulated sampler and the verl engine's rollout replicas are
    sampler 0, so ``delay(k, 1)`` is the same number in all three.
    """

    def __init__(self, model: DelayModel, seed: int = 0):
        # one draw from a fresh rng per delay: a trace cannot be walked in file order here, and
        # "sequential" would silently give exactly the draws of "resample"
        if isinstance(model, TraceDelay) and model.order == "sequential":
            raise ValueError(
                "DelaySchedule: trace order='sequential' cannot replay the trace in file order: each "
                "delay is one draw from its own rng (seed, key, stream), which would give exactly the "
                "draws of order='resample'; use order='resample' (what hetero.delay.dist=trace runs)"
            )
        self.model, self.seed = model, int(seed)

    def delay(self, key: int, stream: int = 0, speed_factor: float = 1.0) -> float:
        """The delay of item ``key`` (>= 0) for receiver ``stream`` (>= 0), in the model's unit,
        times ``speed_factor`` (> 0: how much slower/farther this receiver is)."""
        if key < 0 or stream < 0:
            raise ValueError(f"DelaySchedule: key={key} and stream={stream} must be >= 0")
        if not (math.isfinite(speed_factor) and speed_factor > 0):
            raise ValueError(f"DelaySchedule: speed_factor={speed_factor} must be finite and > 0")
        draw = float(self.model.sample(1, np.random.default_rng([self.seed, int(key), int(stream)]))[0])
        return draw * speed_factor

    def steps(self, key: int, stream: int = 0, cap: int | None = None) -> int:
        """:meth:`delay` in whole learner steps (:func:`to_steps`), capped at ``cap``."""
        return to_steps(self.delay(key, stream), cap)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m verl_ext.hetero.delay", description="Summarise (and plot) a delay model."
    )
    parser.add_argument("--dist", choices=DISTRIBUTIONS, required=True)
    parser.add_argument(
        "--low", type=float, help="lognormal/weibull: lower quantile L (also the clip floor); uniform: lower bound"
    )
    parser.add_argument(
        "--high", type=float, help="lognormal/weibull: upper quantile U (also the clip ceiling); uniform: upper bound"
    )
    parser.add_argument("--integer", action="store_true", help="uniform: whole numbers low..high")
    parser.add_argument(
        "--confidence",
        type=float,
        default=DEFAULT_CONFIDENCE,
        help="lognormal/weibull: mass between L and U (default 0.995)",
    )
    parser.add_argument("--offset", type=float, default=0.0, help="lognormal/weibull: subtracted before the clip")
    parser.add_argument("--value", type=float, help="constant: the delay")
    parser.add_argument("--path", help="trace: file with delays")
    parser.add_argument("--column", help="trace: CSV column name or index")
    parser.add_argument("--order", default="resample", choices=("resample", "sequential"), help="trace: replay order")
    parser.add_argument("--n", type=int, default=200_000, help="number of draws for the summary")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unit", default="s", help="label printed after numbers (s or steps)")
    parser.add_argument("--plot", help="save a histogram to this path (png, pdf, svg)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser


def _params_from_args(args: argparse.Namespace) -> dict:
    if args.dist in ("lognormal", "weibull"):
        if args.low is None or args.high is None:
            raise ValueError(f"{args.dist}: --low and --high are required")
        return {"low": args.low, "high": args.high, "confidence": args.confidence, "offset": args.offset}
    if args.dist == "uniform":
        if args.low is None or args.high is None:
            raise ValueError("uniform: --low and --high are required")
        return {"low": args.low, "high": args.high, "integer": args.integer}
    if args.dist == "constant":
        if args.value is None:
            raise ValueError("constant: --value is required")
        return {"value": args.value}
    if args.dist == "trace":
        if args.path is None:
            raise ValueError("trace: --path is required")
        return {"path": args.path, "column": args.column, "order": args.order}
    return {}


def plot_histogram(model: DelayModel, path: str, n_samples: int = 200_000, seed: int = 0, unit: str = "s") -> None:
    """Save a histogram of ``n_samples`` draws, with median and p95 marked, to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    draws = model.sample(n_samples, np.random.default_rng(seed))
    summary = model.summary(n_samples, seed)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(draws, bins=80, color="tab:blue", alpha=0.8)
    ax.axvline(summary.median, color="k", linestyle="--", label=f"median {summary.median:.1f} {unit}")
    ax.axvline(summary.p95, color="tab:red", linestyle=":", label=f"p95 {summary.p95:.1f} {unit}")
    ax.set_xlabel(f"delay ({unit})")
    ax.set_ylabel("count")
    ax.set_title(
        f"{model.name} "
        + ", ".join(
            f"{k}={v:g}"
            for k, v in model.params().items()
            if isinstance(v, (int, float)) and k in ("low", "high", "offset", "value")
        )
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        model = make_delay_model(args.dist, **_params_from_args(args))
        summary = model.summary(args.n, args.seed)
    except ValueError as err:
        parser.error(str(err))
    if args.json:
        print(json.dumps({"dist": model.name, "params": model.params(), "summary": asdict(summary)}))
    else:
        params = ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in model.params().items())
        print(f"dist: {model.name} ({params})")
        print(f"summary over {summary.n_samples} draws, seed {summary.seed} (unit: {args.unit}):")
        for field in ("median", "mean", "p95", "max", "min"):
            print(f"  {field:<7} {getattr(summary, field):10.2f}")
        print(f"  at low  {summary.frac_at_low:10.4f}  (fraction clipped to low)")
        print(f"  at high {summary.frac_at_high:10.4f}  (fraction clipped to high)")
    if args.plot:
        plot_histogram(model, args.plot, args.n, args.seed, args.unit)
        print(f"histogram saved to {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
