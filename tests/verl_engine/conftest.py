"""Shared helpers: compose the recipe's config with the presets in configs/ the way main_gepo does
(gepo_trainer.yaml as the primary config, ``--config-dir configs`` on the search path)."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]
RECIPE_CONFIG = ROOT / "recipe" / "gepo" / "config"
PRESET_DIR = ROOT / "configs"
PRESETS = sorted(p.stem for p in (PRESET_DIR / "verl_preset").glob("*.yaml"))


def compose_config(*overrides: str):
    """gepo_trainer.yaml + configs/ on the search path + overrides (e.g. ``+verl_preset=...``)."""
    searchpath = f"hydra.searchpath=[pkg://verl.trainer.config,file://{PRESET_DIR}]"
    with initialize_config_dir(config_dir=str(RECIPE_CONFIG), version_base=None):
        return compose(config_name="gepo_trainer", overrides=[searchpath, *overrides])


@pytest.fixture
def compose_cfg():
    return compose_config
