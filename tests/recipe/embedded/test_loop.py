"""The one driver loop: options that used to work in replay mode only work in async mode too,
because both modes build the learner and run the step in one place
(``recipe/gepo/embedded/loop.py``). The async learner here is the engine's own ``LearnerWorker``
in-process over a real fs exchange (Ray only for its trust checker: the module's local Ray)."""

from __future__ import annotations

import pickle

import pytest

from recipe.gepo.embedded.engine_config import EngineConfig
from verl_ext.hetero.exchange import send_group
from verl_ext.algos.objective import rollout_correction_settings

from .test_wait_policy import KEY, _groups, _learner, _until


@pytest.mark.usefixtures("local_ray")  # the learner built here starts its trust checker
def test_async_learner_applies_rollout_correction_and_diagnostics(tiny_cfg, tmp_path):
    worker = _learner(
        tiny_cfg,
        tmp_path,
        "drop",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=1.5",
        "task.diagnostics_every=1",
        "task.diagnostics_samples=2",
    )
    try:
        assert worker.learner.rollout_correction.rollout_is_threshold == 1.5
        for g in _groups(worker, "g", 0, 2):
            send_group(worker.source.transport, g, key=KEY)
        _until(lambda: len(worker.buffer) == 2, "the groups")
        metrics = worker.step(0)
        assert 0 < metrics["is/tis_weight_mean"] <= 1.5  # truncated importance weights were applied
        assert "is/tis_truncated_frac" in metrics
        assert "diag/adv_estimation_error" in metrics and metrics["diag/staleness"] == 0.0
    finally:
        worker.shutdown()


def test_actors_get_typed_configs_that_survive_pickling(tiny_cfg, tmp_path):
    cfg = tiny_cfg(tmp_path, "hetero.mode=async", "algorithm.rollout_correction.rollout_is=sequence")
    engine = EngineConfig.from_omegaconf(cfg)
    again = pickle.loads(pickle.dumps(engine))  # what Ray does when it starts an actor
    assert again.hetero == engine.hetero and again.task == engine.task and again.settings == engine.settings
    assert rollout_correction_settings(again.algorithm).rollout_is == "sequence"
    assert again.actor.policy_loss.loss_mode == engine.actor.policy_loss.loss_mode
