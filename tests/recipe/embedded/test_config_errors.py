"""Bad configurations fail before any work (no model load, no Ray, no metrics) with a message
naming the field."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from hydra.errors import ConfigCompositionException

from recipe.gepo.main_gepo import run

from .helpers import TINY, compose_cfg

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "overrides, error, field",
    [
        (["hetero.max_delay=-1"], ValueError, "hetero.max_delay"),
        (["algorithm_preset=grpo", "actor_rollout_ref.rollout.n=1"], ValueError, "actor_rollout_ref.rollout.n"),
        (["trainer.total_training_steps=null"], ValueError, "trainer.total_training_steps"),
        (
            ["actor_rollout_ref.model.path=/nonexistent/heterorl-model"],
            FileNotFoundError,
            "actor_rollout_ref.model.path",
        ),
        (["hetero.mode=sideways"], ValueError, "hetero.mode"),
        (["hetero.num_samplers=2", "hetero.sampler_speed_factors=[1.0]"], ValueError, "hetero.sampler_speed_factors"),
        (["hetero.weight_sync=xor"], ValueError, "hetero.weight_sync='xor'"),
        (["hetero.weight_sync=delta", "hetero.max_delta_chain=0"], ValueError, "hetero.max_delta_chain=0"),
        # replay mode moves no weights over a transport: a delta setting would do nothing there
        (
            ["hetero.mode=replay", "hetero.weight_sync=delta"],
            ValueError,
            "hetero.weight_sync='delta'.*hetero.mode=replay",
        ),
        (
            ["hetero.mode=replay", "hetero.max_delta_chain=2"],
            ValueError,
            "hetero.max_delta_chain=2.*hetero.mode=replay",
        ),
        (
            ["hetero.mode=replay", "hetero.weights_bf16=true"],
            ValueError,
            "hetero.weights_bf16=True.*hetero.mode=replay",
        ),
        (["hetero.mode=replay", "hetero.system_cpus=[0]"], ValueError, r"hetero.system_cpus=\[0\].*hetero.mode=replay"),
        (["hetero.system_cpus=[0,0]"], ValueError, "hetero.system_cpus=.*repeat"),
    ],
    ids=[
        "max_delay",
        "grpo_group_size_1",
        "total_steps_null",
        "missing_model",
        "mode",
        "speed_factors",
        "weight_sync",
        "max_delta_chain",
        "replay_weight_sync",
        "replay_max_delta_chain",
        "replay_weights_bf16",
        "replay_system_cpus",
        "system_cpus_repeat",
    ],
)
def test_bad_config_fails_fast_naming_the_field(overrides, error, field, tmp_path, tiny_model_path):
    model = [] if any("model.path" in o for o in overrides) else [f"actor_rollout_ref.model.path={tiny_model_path}"]
    # async mode: a late check would start Ray and the actors before failing
    cfg = compose_cfg(TINY + model + ["hetero.mode=async", f"trainer.default_local_dir={tmp_path / 'run'}", *overrides])
    assert not ray.is_initialized()
    start = time.monotonic()
    with pytest.raises(error, match=field.replace(".", r"\.").replace(r"\.*", ".*")):
        run(cfg)
    assert time.monotonic() - start < 10
    assert not ray.is_initialized()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_unknown_preset_fails_at_composition_naming_the_group():
    with pytest.raises(ConfigCompositionException, match="algorithm_preset/nope") as info:
        compose_cfg(TINY + ["algorithm_preset=nope"])
    assert "gepo" in str(info.value) and "grpo" in str(info.value)  # the available presets are listed


@pytest.mark.slow  # ~15 s of imports in a fresh interpreter on shared cores
def test_cli_reports_the_field_and_exits_nonzero(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "recipe.gepo.main_gepo", "hetero.max_delay=-1", f"trainer.default_local_dir={tmp_path}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "hetero.max_delay=-1" in proc.stderr + proc.stdout
    assert not (tmp_path / "metrics.jsonl").exists()
