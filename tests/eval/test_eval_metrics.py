"""mean@k and unbiased pass@k against brute force: enumerate all k-subsets of the n samples."""

from __future__ import annotations

import itertools
import random

import pytest

from verl_ext.eval.metrics import benchmark_metrics, group_records, mean_at_k, pass_at_k, summarize


def brute_pass_at_k(outcomes: list[int], k: int) -> float:
    """Fraction of k-subsets of the samples that contain at least one correct one."""
    subsets = list(itertools.combinations(range(len(outcomes)), k))
    hit = sum(1 for s in subsets if any(outcomes[i] for i in s))
    return hit / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 10])
def test_pass_at_k_equals_subset_enumeration(n):
    rng = random.Random(n)
    for _ in range(6):
        outcomes = [rng.randint(0, 1) for _ in range(n)]
        c = sum(outcomes)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(outcomes, k), abs=1e-12), (outcomes, k)


def test_pass_at_1_is_mean_and_pass_at_n_is_any():
    for outcomes in ([0, 0, 0, 0], [1, 0, 0, 1], [1, 1, 1, 1], [0, 1, 0, 0, 0, 0, 0, 0]):
        n, c = len(outcomes), sum(outcomes)
        assert pass_at_k(n, c, 1) == pytest.approx(mean_at_k(outcomes))
        assert pass_at_k(n, c, n) == (1.0 if c else 0.0)


def test_pass_at_k_monotone_in_k_and_large_n_exact():
    # large n: exact binomials, no overflow or cancellation; monotone non-decreasing in k
    vals = [pass_at_k(200, 3, k) for k in range(1, 201)]
    assert all(b >= a - 1e-15 for a, b in zip(vals, vals[1:]))
    assert vals[0] == pytest.approx(3 / 200)
    assert vals[-1] == 1.0


@pytest.mark.parametrize(
    "n,c,k,msg",
    [(0, 0, 1, "n=0"), (4, 5, 1, "c=5"), (4, -1, 1, "c=-1"), (4, 1, 0, "k=0"), (4, 1, 5, "k=5"), (4, 1.5, 1, "c=1.5")],
)
def test_pass_at_k_rejects_bad_values_by_name(n, c, k, msg):
    with pytest.raises(ValueError, match=msg.replace(".", r"\.")):
        pass_at_k(n, c, k)


def _records(table: dict[str, dict[str, list[int]]]):
    return [
        {"benchmark": b, "problem_id": pid, "sample_idx": j, "acc": float(a)}
        for b, probs in table.items()
        for pid, accs in probs.items()
        for j, a in enumerate(accs)
    ]


def test_summarize_against_brute_force_macro_averages():
    rng = random.Random(7)
    n = 6
    table = {
        b: {f"p{i}": [rng.randint(0, 1) for _ in range(n)] for i in range(rng.randint(2, 7))}
        for b in ("amc23", "aime24", "math500")
    }
    recs = _records(table)
    rng.shuffle(recs)  # order of records must not matter
    summ = summarize(recs, pass_ks=[1, 2, 4, 6])
    bench_means = {}
    for b, probs in table.items():
        m = summ["benchmarks"][b]
        exp_mean = sum(sum(a) / n for a in probs.values()) / len(probs)
        assert m["mean@6"] == pytest.approx(exp_mean)
        for k in (1, 2, 4, 6):
            exp = sum(brute_pass_at_k(a, k) for a in probs.values()) / len(probs)
            assert m[f"pass@{k}"] == pytest.approx(exp)
        assert m["n_problems"] == len(probs)
        assert m["n_correct"] == sum(sum(a) for a in probs.values())
        bench_means[b] = exp_mean
    # the average weighs benchmarks equally (not problems)
    assert summ["average"]["mean@6"] == pytest.approx(sum(bench_means.values()) / 3)
    assert summ["average"]["n_benchmarks"] == 3


def test_later_record_replaces_earlier_and_errors_counted():
    recs = _records({"math500": {"a": [0, 0], "b": [1, 0]}})
    recs[0] = {**recs[0], "error": "gold_unparsable"}
    recs.append({"benchmark": "math500", "problem_id": "a", "sample_idx": 0, "acc": 1.0, "error": "timeout"})
    g = group_records(recs)
    assert g["math500"]["a"].accs == [1.0, 0.0]
    m = benchmark_metrics("math500", list(g["math500"].values()), [2])
    assert m.mean_at_k == pytest.approx((0.5 + 0.5) / 2)
    assert m.error_counts == {"timeout": 1}  # the replaced record's error is gone


def test_uneven_samples_and_bad_k_are_refused():
    g = group_records(_records({"x": {"a": [1, 0, 1], "b": [1, 0]}}))
    with pytest.raises(ValueError, match="different sample counts"):
        benchmark_metrics("x", list(g["x"].values()))
    g = group_records(_records({"x": {"a": [1, 0]}}))
    with pytest.raises(ValueError, match="k=3"):
        benchmark_metrics("x", list(g["x"].values()), [3])
    with pytest.raises(ValueError, match="aime24"):
        summarize(_records({"x": {"a": [1]}}), benchmarks=["x", "aime24"])
