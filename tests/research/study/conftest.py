"""Fixtures of the study tests: a tiny 1-digit toy warm start (seconds, cached) and config
composition. The sweep package is ``research.study`` (the tests run from the repository root)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[3]
CONFIG_DIR = REPO / "recipe" / "gepo" / "config"


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="gepo_trainer", overrides=overrides)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from verl_ext.data.toy.checkpoints import warm_start

    cache = Path(os.environ.get("HETERORL_TEST_CACHE", Path(tempfile.gettempdir()) / "heterorl-test-cache"))
    return str(warm_start(cache, digits=1, steps=50, n_eval=32, batch_size=32, warmup_steps=5))
