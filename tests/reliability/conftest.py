"""Shared helpers for the reliability tests: compose the real trainer config, find the toy model."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "recipe" / "gepo" / "config"
CACHE_DIR = REPO / ".cache" / "heterorl"


TRUSTING = ("hetero.trust.sign_records=false", "hetero.trust.verify_fraction=0", "hetero.trust.check_rewards=false")
"""A learner that trusts its samplers: for tests that send synthetic groups (random tokens, any q)
to exercise the inbox and the buffer; the trust gate has its own tests
(tests/recipe/embedded/test_trust_gate.py)."""


def compose_trainer(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="gepo_trainer", overrides=[f"task.cache_dir={CACHE_DIR}", *overrides])


@pytest.fixture(scope="session")
def toy_model_path() -> str:
    """The cached warm-started toy model (built once, ~75 s, if the cache is empty)."""
    from recipe.gepo.embedded.tasks import resolve_model_path
    from recipe.gepo.sections import TaskConfig

    cfg = compose_trainer()
    return str(resolve_model_path("", TaskConfig.from_omegaconf(cfg.task), 0))
