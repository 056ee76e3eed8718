"""The hetero: section composes and validates; bad values fail before any work, naming the field."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from recipe.gepo.sections import HeteroConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipe" / "gepo" / "config"


def hetero_from(*overrides) -> HeteroConfig:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(config_name="gepo_trainer", overrides=list(overrides))
    return HeteroConfig.from_omegaconf(cfg.hetero)


def test_defaults_compose_and_build_the_delay_model():
    hc = hetero_from()
    assert hc.engine == "local" and hc.mode == "async"
    model = hc.delay.build()
    draws = model.sample(1000, __import__("numpy").random.default_rng(0))
    assert draws.min() >= hc.delay.low and draws.max() <= hc.delay.high


def test_paper_setting_overrides():
    hc = hetero_from("hetero.delay.low=60", "hetero.delay.high=1920", "hetero.delay.offset=400",
                     "hetero.max_delay=64")
    assert (hc.delay.low, hc.delay.high, hc.delay.offset, hc.max_delay) == (60, 1920, 400, 64)


@pytest.mark.parametrize(
    "override, field",
    [
        ("hetero.engine=tpu", "hetero.engine"),
        ("hetero.mode=sometimes", "hetero.mode"),
        ("hetero.max_delay=-1", "hetero.max_delay"),
        ("hetero.num_samplers=0", "hetero.num_samplers"),
        ("hetero.max_queued_groups=-1", "hetero.max_queued_groups=-1"),
        ("hetero.stale_policy=ignore", "hetero.stale_policy"),
        ("hetero.delay.low=10", "low"),  # low > high (8)
        ("hetero.delay.dist=gamma", "gamma"),
        ("hetero.sampler_speed_factors=[1.0]", "sampler_speed_factors"),
        ("hetero.sampler_speed_factors=[1.0,-2.0]", "sampler_speed_factors"),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ValueError, match=field):
        hetero_from(override)


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match="max_dealy"):
        hetero_from("+hetero.max_dealy=3")
