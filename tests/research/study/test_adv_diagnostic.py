"""The E[A] estimation-error diagnostic: hand-computed values on a tiny batch, and in replay mode."""

import math

import pytest
import torch

from verl_ext.analysis.run_diagnostics import (
    ERROR,
    estimation_errors,
    main_weight_kind,
    weighted_advantage_estimates,
)
from verl_ext.rundir import read_metric_rows

from .conftest import compose_cfg


def _tiny_batch():
    ln = math.log
    # group 0: rewards 1, 0 (baseline 0.5, A = +-0.5); group 1: rewards 1, 1 (A = 0)
    return dict(
        seq_log_p=torch.tensor([ln(0.6), ln(0.2), ln(0.5), ln(0.5)]),
        seq_log_q=torch.tensor([ln(0.3), ln(0.4), ln(0.5), ln(0.1)]),
        full_log_p=torch.tensor([ln(0.36), ln(0.04), ln(0.25), ln(0.25)]),
        full_log_q=torch.tensor([ln(0.09), ln(0.16), ln(0.25), ln(0.01)]),
        rewards=torch.tensor([1.0, 0.0, 1.0, 1.0]),
        group_index=torch.tensor([0, 0, 1, 1]),
    )


def test_estimates_and_errors_by_hand():
    est = weighted_advantage_estimates(**_tiny_batch())
    # ratio p/q = 2, 0.5 -> (2 * 0.5 + 0.5 * -0.5) / 2
    assert est["ratio"].tolist() == pytest.approx([0.375, 0.0])
    # E_q[q] = (0.3^2 + 0.4^2) / (0.3 + 0.4) = 0.25 / 0.7; w = p / E_q[q]
    den = 0.25 / 0.7
    assert est["group_expectation"].tolist() == pytest.approx([(0.6 / den * 0.5 - 0.2 / den * 0.5) / 2, 0.0])
    assert est["ratio_full"].tolist() == pytest.approx([(4 * 0.5 - 0.25 * 0.5) / 2, 0.0])
    assert est["none"].tolist() == pytest.approx([0.0, 0.0])
    assert est["baseline"].tolist() == pytest.approx([0.5, 1.0])

    fresh = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 1.0, 1.0]])  # fresh A: +0.25, -0.25
    m = estimation_errors(est, fresh, main_kind="group_expectation")
    assert m[f"{ERROR}/ratio"] == pytest.approx((0.125 + 0.25) / 2)
    assert m[f"{ERROR}/group_expectation"] == pytest.approx(
        (abs(0.6 / den * 0.25 - 0.2 / den * 0.25 - 0.25) + 0.25) / 2
    )
    assert m[f"{ERROR}/ratio_full"] == pytest.approx((0.6875 + 0.25) / 2)
    assert m[f"{ERROR}/none"] == pytest.approx(0.25)
    assert m[ERROR] == m[f"{ERROR}/group_expectation"]
    assert m["diag/fresh_std_error"] == pytest.approx(0.25)  # std 0.5 (ddof 1) / sqrt(4)
    assert m["diag/fresh_reward_mean"] == pytest.approx(0.75)
    assert main_weight_kind("gepo") == "group_expectation" and main_weight_kind("vanilla") == "ratio"


def _run(cfg):
    from recipe.gepo.main_gepo import run

    return run(cfg)


def _lines(path):
    return read_metric_rows(path)


BASE = [
    "task.name=toy_addition",
    "task.digits=1",
    "task.eval_size=16",
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "data.max_response_length=4",
    "trainer.logger=[]",
    "trainer.resume_mode=disable",
    "hetero.mode=replay",
    "trainer.total_training_steps=6",
    "trainer.test_freq=3",
    "hetero.delay.low=1",
    "hetero.delay.high=8",
]


def test_replay_diagnostics_observe_without_changing_training(tiny_model_path, tmp_path):
    model = f"actor_rollout_ref.model.path={tiny_model_path}"
    common = BASE + [model, "hetero.max_delay=3", "algorithm_preset=gepo"]
    _run(compose_cfg(common + [f"trainer.default_local_dir={tmp_path / 'off'}"]))
    _run(
        compose_cfg(
            common
            + [f"trainer.default_local_dir={tmp_path / 'on'}", "task.diagnostics_every=2", "task.diagnostics_samples=6"]
        )
    )
    off, on = _lines(tmp_path / "off"), _lines(tmp_path / "on")
    for a, b in zip(off, on):  # the fresh samples use their own RNG: the training is identical
        for key in ("reward/mean", "actor/loss", "eval/acc_mean"):
            assert a.get(key) == b.get(key), (a["step"], key)
    diag_steps = [x["step"] for x in on if ERROR in x]
    assert diag_steps == [1, 3, 5]  # steps 0, 2, 4 (logged as done = step + 1)
    assert not any(ERROR in x for x in off)
    for x in on:
        if ERROR in x:
            assert 0.0 <= x[ERROR] <= 2.0 and x[ERROR] == x[f"{ERROR}/group_expectation"]
            assert 0.0 <= x["diag/fresh_reward_mean"] <= 1.0
            assert x["diag/staleness"] == x["hetero/staleness_max"]


def test_on_policy_ratio_estimate_is_zero(tiny_model_path, tmp_path):
    # max delay 0: p == q, so p/q = 1 and the ratio estimate is the centred mean, 0: its error
    # equals the unweighted one, and the full ratio agrees
    cfg = compose_cfg(
        BASE
        + [
            f"actor_rollout_ref.model.path={tiny_model_path}",
            "hetero.max_delay=0",
            "algorithm_preset=grpo",
            f"trainer.default_local_dir={tmp_path}",
            "task.diagnostics_every=1",
            "task.diagnostics_samples=4",
        ]
    )
    _run(cfg)
    rows = [x for x in _lines(tmp_path) if ERROR in x]
    assert len(rows) == 6
    for x in rows:
        assert abs(x["diag/adv_estimate/ratio"]) < 1e-4
        assert x[f"{ERROR}/ratio"] == pytest.approx(x[f"{ERROR}/none"], abs=1e-4)
        assert x[f"{ERROR}/ratio_full"] == pytest.approx(x[f"{ERROR}/none"], abs=1e-4)
        assert x[ERROR] == x[f"{ERROR}/ratio"]
