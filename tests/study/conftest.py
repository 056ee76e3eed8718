"""Fixtures of the study tests: a tiny 1-digit toy warm start (seconds, cached) and config composition."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipe" / "gepo" / "config"


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="gepo_trainer", overrides=overrides)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from verl_ext.data.toy import warm_start

    cache = Path(os.environ.get("HETERORL_TEST_CACHE", Path(tempfile.gettempdir()) / "heterorl-test-cache"))
    return str(warm_start(cache, digits=1, target_accuracy=(0.2, 1.0), max_seconds=60, max_steps=300,
                          eval_every=25, n_eval=32, batch_size=32, warmup_steps=5))  # fmt: skip
