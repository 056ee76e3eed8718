"""Fixtures for the embedded-engine tests: a tiny warm-started toy model and its config.

The model is a 1-digit toy-addition warm start with a tiny step budget (a few seconds the first
time, cached afterwards under ``$HETERORL_TEST_CACHE`` or ``<tmp>/heterorl-test-cache``).
Accuracy does not matter for these tests, only that the model is a real HF checkpoint.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from omegaconf import DictConfig

from .helpers import TINY, compose_cfg


def _cache_dir() -> Path:
    return Path(os.environ.get("HETERORL_TEST_CACHE", Path(tempfile.gettempdir()) / "heterorl-test-cache"))


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from verl_ext.data.toy.checkpoints import warm_start

    # 50 steps: held-out sampled accuracy ~0.3 (where the earlier accuracy-window start stopped)
    path = warm_start(_cache_dir(), digits=1, steps=50, n_eval=32, batch_size=32, warmup_steps=5)
    return str(path)


@pytest.fixture
def tiny_cfg(tiny_model_path):
    """``tiny_cfg(run_dir, *overrides)``: the tiny config with this test's run dir and overrides."""

    def make(run_dir: Path, *overrides: str) -> DictConfig:
        return compose_cfg(
            TINY
            + [f"actor_rollout_ref.model.path={tiny_model_path}", f"trainer.default_local_dir={run_dir}", *overrides]
        )

    return make


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray for the module's tests, shut down after them: the trust checker
    (``hetero.trust.check_process``, on by default) is a Ray actor, so a learner built in this
    process starts one, and without Ray up its remote call would start Ray itself and leave it up
    for every later test (whose own ``ray.init`` then fails)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
