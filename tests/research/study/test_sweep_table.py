"""The delay sweep's table arithmetic (research/study) against hand computation on synthetic run directories."""

import json
import math
from pathlib import Path

import pytest

from research.study.analyse import run_numbers, stability_rows, summarize
from research.study.plan import Plan
from research.study.render import markdown_table, stability_table, write_outputs
from research.study.rows import collect


def _write_run(d: Path, evals: dict[int, float], kl: dict[int, float], var: dict[int, float], err=None):
    d.mkdir(parents=True)
    rows = []
    for step in range(0, 9):
        row = {"step": step}
        if step in evals:
            row["eval/acc_mean"] = evals[step]
        if step > 0:
            row["is/kl_sampler_learner"] = kl[step]
            row["is/weight_var"] = var[step]
            if err and step in err:
                row["diag/adv_estimation_error"] = err[step]
        rows.append(row)
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (d / "DONE").write_text("{}")


def test_table_matches_hand_computation(tmp_path):
    kl = {s: 0.01 * s for s in range(1, 9)}
    var = {s: 0.1 * s for s in range(1, 9)}
    root = tmp_path / "runs" / "short" / "gepo"
    # total 8 steps: last quarter = steps > 6, i.e. evaluations at 8 only (evals every 2), KL/var at 7, 8
    _write_run(root / "d0" / "s0", {0: 0.3, 2: 0.5, 4: 0.7, 6: 0.6, 8: 0.4}, kl, var, err={1: 0.2, 5: 0.4})
    _write_run(root / "d0" / "s1", {0: 0.3, 2: 0.4, 4: 0.5, 6: 0.5, 8: 0.6}, kl, var)
    _write_run(root / "d64" / "s0", {0: 0.3, 2: 0.2, 4: 0.1, 6: 0.1, 8: 0.0}, kl, var)
    _write_run(root / "d64" / "s1", {0: 0.3, 2: 0.3, 4: 0.2, 6: 0.2, 8: 0.1}, kl, var)
    _write_run(root / "d8" / "s1", {0: 0.3, 2: 0.4, 4: 0.5, 6: 0.5, 8: 0.5}, kl, var)
    plan = Plan(
        tasks=["short"],
        algos=["gepo"],
        delays=[0, 8, 64],
        seeds=[0, 1],
        steps=8,
        lr=1e-4,
        test_freq=2,
        eval_size=8,
        prompts=2,
        diagnostics_every=0,
        diagnostics_samples=1,
    )
    per_run = collect(tmp_path, plan)
    assert len(per_run) == 5
    rows = {r["delay"]: r for r in summarize(per_run)}

    def ms(a, b):
        m = (a + b) / 2
        return m, math.sqrt(((a - m) ** 2 + (b - m) ** 2) / 1)

    d0 = rows[0]
    assert d0["n"] == 2 and d0["seeds"] == [0, 1]
    assert (d0["best_mean"], d0["best_std"]) == pytest.approx(ms(0.7, 0.6))
    assert (d0["last_mean"], d0["last_std"]) == pytest.approx(ms(0.4, 0.6))
    assert (d0["lq_mean_mean"], d0["lq_mean_std"]) == pytest.approx(ms(0.4, 0.6))
    assert (d0["gap_mean"], d0["gap_std"]) == pytest.approx(ms(0.3, 0.0))
    assert d0["start_mean"] == pytest.approx(0.3)
    assert d0["kl_mean"] == pytest.approx((0.07 + 0.08) / 2) and d0["kl_std"] == pytest.approx(0.0)
    assert d0["var_mean"] == pytest.approx((0.7 + 0.8) / 2)
    assert d0["err_mean"] == pytest.approx(0.3) and math.isnan(d0["err_std"])  # one seed logged it
    d64 = rows[64]
    assert (d64["best_mean"], d64["last_mean"]) == pytest.approx((0.25, 0.05))
    # drop 0 -> 64 on the last-quarter means, paired by seed: 0.4 - 0.0 and 0.6 - 0.1
    assert (d64["drop_mean"], d64["drop_std"]) == pytest.approx(ms(0.4, 0.5)) and d64["drop_n"] == 2
    assert math.isnan(d0["drop_mean"]) and d0["drop_n"] == 0
    # delay 8 ran for seed 1 only: its drop pairs that seed alone (0.6 - 0.5)
    assert rows[8]["n"] == 1 and rows[8]["drop_n"] == 1
    assert rows[8]["drop_mean"] == pytest.approx(0.1) and math.isnan(rows[8]["drop_std"])
    md = markdown_table(summarize(per_run))
    assert "| gepo | 0 | 2 | 0.650 ± 0.071 |" in md
    # pooled over delays 8 and 64, paired by seed: 0.4, 0.5 (delay 64) and 0.1 (delay 8, seed 1)
    (stable,) = stability_rows(summarize(per_run), per_run)
    assert (stable["lq_0"], stable["lq_8"], stable["lq_64"]) == pytest.approx((0.5, 0.5, 0.05))
    m, sd = 1.0 / 3, math.sqrt(((0.4 - 1 / 3) ** 2 + (0.5 - 1 / 3) ** 2 + (0.1 - 1 / 3) ** 2) / 2)
    assert (stable["pooled_drop"], stable["pooled_se"]) == pytest.approx((m, sd / math.sqrt(3)))
    assert stable["pooled_n"] == 3 and stable["worse"] == 3
    assert "| gepo | 0.500 | 0.500 | 0.050 | 0.333 ± 0.120 | 3/3 |" in stability_table([stable])
    write_outputs(tmp_path, plan, per_run, figures=False, log=lambda *a: None)
    seeds = (tmp_path / "runs_short.csv").read_text().splitlines()
    assert seeds[0] == (
        "task,algo,delay,seed,start,best,last,lq_mean,gap,kl,var,weight_mean,clipfrac,staleness,"
        "staleness_max,err,clipfrac_pos,clipfrac_neg,zero_grad_stale,weight_right,weight_wrong"
    )
    assert len(seeds) == 6


def test_run_numbers_last_quarter_uses_steps_after_three_quarters():
    metrics = [{"step": 0, "eval/acc_mean": 0.1}] + [
        {"step": s, "eval/acc_mean": s / 100} for s in (25, 50, 75, 76, 100)
    ]
    n = run_numbers(metrics, total_steps=100)
    assert n["lq_mean"] == pytest.approx((0.76 + 1.0) / 2)  # 75 is not > 75
    assert n["best"] == 1.0 and n["last"] == 1.0 and n["start"] == 0.1 and n["gap"] == 0.0
    assert math.isnan(n["kl"]) and math.isnan(n["err"])
