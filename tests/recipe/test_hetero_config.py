"""The hetero: section composes and validates; bad values fail before any work, naming the field."""

import re
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
    assert hc.engine == "embedded" and hc.mode == "async"
    model = hc.delay.build()
    draws = model.sample(1000, __import__("numpy").random.default_rng(0))
    assert draws.min() >= hc.delay.low and draws.max() <= hc.delay.high


def test_the_embedded_engine_keeps_its_old_name_local_as_an_alias():
    assert hetero_from("hetero.engine=local").engine == "embedded"
    assert hetero_from("hetero.engine=embedded").engine == "embedded"
    with pytest.raises(ValueError, match="hetero.engine='embeded'"):
        hetero_from("hetero.engine=embeded")


def test_paper_setting_overrides():
    hc = hetero_from("hetero.delay.low=60", "hetero.delay.high=1920", "hetero.delay.offset=400", "hetero.max_delay=64")
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


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["hetero.delay.dist=lognormal", "hetero.delay.integer=true"], "hetero.delay.integer=True"),
        (["hetero.delay.dist=constant", "hetero.delay.value=4", "hetero.delay.offset=100"], "hetero.delay.offset=100"),
        (
            ["hetero.delay.dist=uniform", "hetero.delay.low=0", "hetero.delay.trace_path=x.csv"],
            "hetero.delay.trace_path='x.csv'",
        ),
        (["hetero.delay.dist=none", "hetero.delay.value=5"], "hetero.delay.value=5"),
        (["hetero.delay.dist=constant", "hetero.delay.value=4", "hetero.delay.low=60"], "hetero.delay.low=60"),
    ],
)
def test_a_delay_field_the_distribution_does_not_read_is_refused(overrides, key):
    """A parameter of another distribution would be ignored: refused, naming it and what dist takes."""
    with pytest.raises(ValueError, match=re.escape(key) + " is not read by hetero.delay.dist="):
        hetero_from(*overrides)


def test_each_distribution_takes_its_own_fields():
    assert hetero_from("hetero.delay.dist=constant", "hetero.delay.value=4").delay.build().sample(
        3, __import__("numpy").random.default_rng(0)
    ).tolist() == [4.0, 4.0, 4.0]
    uniform = hetero_from(
        "hetero.delay.dist=uniform", "hetero.delay.low=0", "hetero.delay.high=3", "hetero.delay.integer=true"
    )
    draws = uniform.delay.build().sample(200, __import__("numpy").random.default_rng(0))
    assert set(draws.tolist()) == {0.0, 1.0, 2.0, 3.0}
    assert hetero_from("hetero.delay.dist=weibull", "hetero.delay.offset=1").delay.offset == 1


def test_transport_url_needs_the_fs_transport():
    with pytest.raises(
        ValueError, match=r"hetero.transport_url='/x' is read by hetero.transport=fs only \(hetero.transport=ray\)"
    ):
        hetero_from("hetero.transport=ray", "hetero.transport_url=/x")
    assert hetero_from("hetero.transport=fs", "hetero.transport_url=/x").transport_url == "/x"
