"""Accuracy metrics for sampled evaluation: mean@k and the unbiased pass@k estimator.

Definitions (per problem with ``n`` samples of which ``c`` are correct):

* ``mean@n`` -- the fraction of correct samples, ``c / n``; the paper's "mean@8" is
  "pass@1 averaged over 8 samples". The benchmark score is the mean over problems.
* ``pass@k`` -- the unbiased estimator of the probability that at least one of ``k``
  samples drawn without replacement from the ``n`` is correct:
  ``1 - C(n - c, k) / C(n, k)`` (Chen et al., 2021). ``pass@1 == mean@n`` exactly.

Benchmark scores are macro averages over problems; the cross-benchmark "Avg" is a macro
average over benchmarks (each benchmark weighs the same, as in the paper's table).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "pass_at_k",
    "mean_at_k",
    "ProblemResult",
    "BenchmarkMetrics",
    "group_records",
    "benchmark_metrics",
    "summarize",
]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: ``1 - C(n-c, k) / C(n, k)``.

    Exact integer binomials (no floating-point cancellation for large ``n``).
    Raises ``ValueError`` naming the bad value unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or int(v) != v:
            raise ValueError(f"pass_at_k: {name}={v!r} must be an integer")
    n, c, k = int(n), int(c), int(k)
    if n < 1:
        raise ValueError(f"pass_at_k: n={n} must be >= 1")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c={c} must be in [0, n={n}]")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in [1, n={n}]")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_at_k(scores: Sequence[float]) -> float:
    """Mean of one problem's per-sample scores (0/1 accuracies give ``c / n``)."""
    if len(scores) == 0:
        raise ValueError("mean_at_k: empty list of scores")
    return float(sum(float(s) for s in scores) / len(scores))


@dataclass
class ProblemResult:
    """All samples of one problem: ``accs[i]`` is the 0/1 accuracy of sample ``i``."""

    benchmark: str
    problem_id: str
    accs: list[float]
    errors: list[str | None] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.accs)

    @property
    def c(self) -> int:
        return int(sum(1 for a in self.accs if float(a) >= 0.5))


@dataclass
class BenchmarkMetrics:
    """Metrics of one benchmark; ``to_dict`` is what the JSON summary stores."""

    benchmark: str
    n_problems: int
    samples_per_problem: int
    mean_at_k: float
    pass_at: dict[int, float]
    n_samples: int
    n_correct: int
    error_counts: dict[str, int]
    extra: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        k = self.samples_per_problem
        out = {
            "n_problems": self.n_problems,
            "samples_per_problem": k,
            f"mean@{k}": self.mean_at_k,
            **{f"pass@{kk}": v for kk, v in sorted(self.pass_at.items())},
            "n_samples": self.n_samples,
            "n_correct": self.n_correct,
            "n_errors": int(sum(self.error_counts.values())),
            "error_counts": dict(sorted(self.error_counts.items())),
        }
        out.update(self.extra)
        return out


def _acc_of(record: Mapping) -> float:
    """The 0/1 accuracy of a record: ``acc`` if present, else ``score``."""
    if "acc" in record and record["acc"] is not None:
        return float(record["acc"])
    if "score" in record and record["score"] is not None:
        return float(record["score"])
    raise KeyError(f"record has neither 'acc' nor 'score': keys={sorted(record)}")


def group_records(records: Iterable[Mapping]) -> dict[str, dict[str, ProblemResult]]:
    """Group per-sample records into ``{benchmark: {problem_id: ProblemResult}}``.

    Records need ``benchmark``, ``problem_id``, ``sample_idx`` and ``acc`` (or ``score``);
    a later record with the same (benchmark, problem_id, sample_idx) replaces an earlier
    one (a redone problem after a resume). Samples are ordered by ``sample_idx``.
    """
    by_key: dict[tuple[str, str], dict[int, Mapping]] = defaultdict(dict)
    order: list[tuple[str, str]] = []
    for r in records:
        key = (str(r["benchmark"]), str(r["problem_id"]))
        if key not in by_key:
            order.append(key)
        by_key[key][int(r["sample_idx"])] = r
    out: dict[str, dict[str, ProblemResult]] = {}
    for key in order:
        samples = by_key[key]
        idx = sorted(samples)
        out.setdefault(key[0], {})[key[1]] = ProblemResult(
            benchmark=key[0],
            problem_id=key[1],
            accs=[_acc_of(samples[i]) for i in idx],
            errors=[samples[i].get("error") for i in idx],
        )
    return out


def benchmark_metrics(name: str, problems: Sequence[ProblemResult], pass_ks: Sequence[int] = ()) -> BenchmarkMetrics:
    """mean@n and pass@k of one benchmark (macro average over problems).

    All problems must have the same number of samples ``n``; every ``k`` in ``pass_ks``
    must satisfy ``1 <= k <= n``.
    """
    if not problems:
        raise ValueError(f"benchmark {name!r}: no problems to score")
    ns = Counter(p.n for p in problems)
    if len(ns) != 1:
        raise ValueError(
            f"benchmark {name!r}: problems have different sample counts {dict(ns)}; "
            "finish the evaluation (resume) before summarising"
        )
    n = problems[0].n
    for k in pass_ks:
        if not 1 <= int(k) <= n:
            raise ValueError(f"pass_ks: k={k} must be in [1, samples_per_problem={n}]")
    mean = sum(mean_at_k(p.accs) for p in problems) / len(problems)
    pass_at = {int(k): sum(pass_at_k(n, p.c, int(k)) for p in problems) / len(problems) for k in pass_ks}
    errors = Counter(str(e) for p in problems for e in p.errors if e)
    return BenchmarkMetrics(
        benchmark=name,
        n_problems=len(problems),
        samples_per_problem=n,
        mean_at_k=mean,
        pass_at=pass_at,
        n_samples=n * len(problems),
        n_correct=sum(p.c for p in problems),
        error_counts=dict(errors),
    )


def summarize(records: Iterable[Mapping], pass_ks: Sequence[int] = (), benchmarks: Sequence[str] | None = None) -> dict:
    """Per-benchmark metrics and their macro average over benchmarks, from per-sample records.

    Returns ``{"benchmarks": {name: BenchmarkMetrics.to_dict()}, "average": {...}}``. The
    average holds ``mean@n`` and each ``pass@k`` averaged over benchmarks with equal weight;
    it is present only when every benchmark has the same ``n``.
    """
    grouped = group_records(records)
    names = list(benchmarks) if benchmarks is not None else list(grouped)
    missing = [b for b in names if b not in grouped]
    if missing:
        raise ValueError(f"no records for benchmark(s) {missing}; have {sorted(grouped)}")
    per = {b: benchmark_metrics(b, list(grouped[b].values()), pass_ks) for b in names}
    out: dict = {"benchmarks": {b: m.to_dict() for b, m in per.items()}}
    ns = {m.samples_per_problem for m in per.values()}
    if len(ns) == 1 and per:
        n = ns.pop()
        avg = {f"mean@{n}": sum(m.mean_at_k for m in per.values()) / len(per)}
        for k in pass_ks:
            avg[f"pass@{int(k)}"] = sum(m.pass_at[int(k)] for m in per.values()) / len(per)
        avg["n_benchmarks"] = len(per)
        out["average"] = avg
    return out
