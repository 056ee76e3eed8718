"""task.warm_start_steps: the embedded engine's toy model is the pinned warm start when it is > 0."""

import json

import pytest

from recipe.gepo.embedded.tasks import resolve_model_path
from recipe.gepo.sections import TaskConfig
from tests.research.study.conftest import compose_cfg
from verl_ext.data.toy.checkpoints import WARM_START_INFO, weights_sha256


def test_warm_start_steps_selects_the_pinned_warm_start(tmp_path):
    cfg = compose_cfg(["task.digits=1", "task.warm_start_steps=6", f"task.cache_dir={tmp_path}"])
    task = TaskConfig.from_omegaconf(cfg.task)
    assert task.warm_start_steps == 6
    path = resolve_model_path("", task, seed=0)
    info = json.loads((tmp_path / path.split("/")[-1] / WARM_START_INFO).read_text())
    assert "-pin6-" in path and info["stop_reason"] == "steps" and info["steps"] == 6
    assert info["weights_sha256"] == weights_sha256(path)
    assert resolve_model_path("", task, seed=0) == path  # cached, same folder


def test_warm_start_steps_must_be_null_or_a_positive_int():
    for bad in (-1, 0, True):
        with pytest.raises(ValueError, match="task.warm_start_steps"):
            TaskConfig(warm_start_steps=bad)
    assert TaskConfig().warm_start_steps is None  # the YAML's default: the answer format's pinned steps
