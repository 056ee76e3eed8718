"""GRPO with truncated IS (verl's decoupled rollout correction) in replay mode."""

import pytest

from verl_ext.algos.objective import RolloutCorrection, rollout_correction_settings

from .conftest import compose_cfg
from .test_adv_diagnostic import BASE, _lines, _run


def test_settings_parsing():
    off = compose_cfg(["algorithm_preset=grpo"]).algorithm
    assert rollout_correction_settings(off) is None
    on = compose_cfg(
        [
            "algorithm_preset=grpo",
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=3.5",
        ]
    ).algorithm
    assert rollout_correction_settings(on) == RolloutCorrection("token", 3.5, rollout_is_batch_normalize=False)
    bypass = compose_cfg(
        [
            "algorithm_preset=grpo",
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.bypass_mode=true",
        ]
    ).algorithm
    with pytest.raises(ValueError, match="bypass"):
        rollout_correction_settings(bypass)


@pytest.mark.slow
def test_tis_equals_vanilla_on_policy_and_truncates_when_stale(tiny_model_path, tmp_path):
    model = f"actor_rollout_ref.model.path={tiny_model_path}"
    tis = ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=1.05"]
    # on-policy first step: p == q, every weight is 1 < C, so the gradient is vanilla GRPO's
    for name, extra in (("van", []), ("tis", tis)):
        _run(
            compose_cfg(
                BASE
                + [
                    model,
                    "algorithm_preset=grpo",
                    "hetero.max_delay=0",
                    "trainer.total_training_steps=1",
                    f"trainer.default_local_dir={tmp_path / name}",
                ]
                + extra
            )
        )
    van, got = _lines(tmp_path / "van")[1], _lines(tmp_path / "tis")[1]
    assert got["actor/grad_norm"] == pytest.approx(van["actor/grad_norm"], rel=1e-3)
    assert got["is/tis_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    # stale batches: raw weights exceed C = 1.05 somewhere and get truncated; is/* stays sampler-vs-learner
    _run(
        compose_cfg(
            BASE
            + [
                model,
                "algorithm_preset=grpo",
                "hetero.max_delay=4",
                "actor_rollout_ref.actor.optim.lr=3e-3",
                f"trainer.default_local_dir={tmp_path / 'stale'}",
            ]
            + tis
        )
    )
    rows = [x for x in _lines(tmp_path / "stale") if x["step"] > 0]
    assert any(x["is/tis_truncated_frac"] > 0 for x in rows)
    assert all(x["is/tis_weight_mean"] <= 1.05 + 1e-6 for x in rows)
    assert any(x["is/kl_sampler_learner"] > 1e-6 for x in rows if x["hetero/staleness_min"] > 0)
