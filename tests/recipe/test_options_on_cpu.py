"""The option contract (issue 20, item 1): every option a user can set is honoured by the chosen
engine and mode, or refused at start naming the key, the runner that would ignore it and the
runners that honour it. The walk covers every field of every config dataclass (hetero:, task:,
verl_engine:) and every verl key written in gepo_trainer.yaml, in each of the three runners."""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from recipe.gepo import options
from recipe.gepo.sections import HeteroConfig
from recipe.gepo.sections import TaskConfig
from recipe.gepo.main_gepo import run_local
from recipe.gepo.sections import VerlEngineConfig
from verl_ext.rundir import config_leaves

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "recipe" / "gepo" / "config"
SECTIONS = [("hetero", HeteroConfig), ("task", TaskConfig), ("verl_engine", VerlEngineConfig)]
# a value the field accepts that differs from its default, where the type alone cannot say
CHOICES = {"engine": "verl", "mode": "replay", "stale_policy": "wait", "order": "newest", "transport": "fs",
           "weight_sync": "delta", "dist": "weibull", "name": "math", "answer_format": "scratchpad",
           "old_log_prob": "recompute"}  # fmt: skip


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="gepo_trainer", overrides=list(overrides))


@pytest.fixture(scope="module")
def defaults():
    return compose_cfg()


def other_value(name: str, default):
    if name in CHOICES:
        return CHOICES[name]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default + 0.5
    if isinstance(default, str):
        return default + "x"
    if isinstance(default, list):
        return [0]
    if isinstance(default, dict):
        return {"node": 1.0}
    if default is None:
        return "column"
    raise AssertionError(f"no other value for {name}={default!r}")


def test_tests_dir_mentions():
    """The 'behaviour test exists' check below greps the tests for the key: make sure the grep sees files."""
    assert len(_test_texts()) > 50


_TEXTS: list[str] = []


def _test_texts() -> list[str]:
    if not _TEXTS:
        here = Path(__file__).resolve()
        _TEXTS.extend(p.read_text() for p in (ROOT / "tests").rglob("*.py") if p.resolve() != here)
    return _TEXTS


def _setting(section: type, key: str, field: dataclasses.Field, value) -> object:
    """A default ``section`` instance with the (dotted) ``key`` set to ``value``, past validation
    (the contract compares values; validation of values is tested elsewhere)."""
    obj = section()
    parts = key.split(".")[1:]
    target = obj
    for part in parts[:-1]:
        target = getattr(target, part)
    object.__setattr__(target, parts[-1], value)
    return obj


CASES = [
    (prefix, cls, key, field, runner)
    for prefix, cls in SECTIONS
    for key, field, _ in options.option_fields(cls, prefix)
    for runner in options.RUNNERS
]


@pytest.mark.parametrize("prefix, cls, key, field, runner", CASES, ids=[f"{c[2]}-{c[4]}" for c in CASES])
def test_every_field_is_honoured_or_refused(prefix, cls, key, field, runner):
    default = options.field_default(field)
    value = other_value(field.name, default)
    assert value != default
    setting = _setting(cls, key, field, value)
    if runner in options.honoured_by(field):
        options.check_section(setting, prefix, runner)  # accepted ...
        # ... and some behaviour test sets or reads it (the key's own name outside this file)
        name = key.split(".")[-1]
        assert any(re.search(rf"\b{name}\b", text) for text in _test_texts()), f"no test mentions {key}"
    else:
        with pytest.raises(options.OptionNotHonoured) as err:
            options.check_section(setting, prefix, runner)
        message = str(err.value)
        assert key in message and options.RUNNER_NAMES[runner] in message
        assert all(options.RUNNER_NAMES[r] in message for r in options.honoured_by(field))


def _yaml_verl_keys() -> list[str]:
    """Dotted leaf keys written in gepo_trainer.yaml outside HeteroRL's own sections."""
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "gepo_trainer.yaml"), resolve=False)
    return [k for k, _ in config_leaves(raw, skip=options.NOT_OPTIONS) if k.split(".")[0] not in options.PROJECT_SECTIONS]


VERL_KEYS = _yaml_verl_keys()
ISSUE_KEYS = ["actor_rollout_ref.rollout.top_p", "actor_rollout_ref.rollout.top_k", "actor_rollout_ref.actor.ppo_epochs",
              "actor_rollout_ref.actor.ppo_mini_batch_size", "data.max_prompt_length", "data.train_files",
              "data.val_files", "actor_rollout_ref.actor.optim.lr_scheduler_type"]  # fmt: skip


def _changed(defaults, key: str):
    cfg = copy.deepcopy(defaults)
    value = OmegaConf.select(cfg, key)
    new = {bool: lambda v: not v, int: lambda v: v + 1, float: lambda v: v * 2 + 1, str: lambda v: v + "x"}.get(
        type(value), lambda v: ["console"] if isinstance(v, (list, type(None))) or OmegaConf.is_list(v) else v
    )(value)
    if key.endswith("top_k"):
        new = 20
    if key.endswith("lr_scheduler_type"):
        new = "cosine"
    with open_dict(cfg):
        OmegaConf.update(cfg, key, new, merge=False)
    assert OmegaConf.select(cfg, key) != value, key
    return cfg


@pytest.mark.parametrize("key", sorted(set(VERL_KEYS) | set(ISSUE_KEYS)))
@pytest.mark.parametrize("runner", options.EMBEDDED)
def test_every_verl_key_is_honoured_or_refused_by_the_embedded_engine(defaults, key, runner):
    if key.startswith("actor_rollout_ref.actor.policy_loss.") and key.endswith(("_target_", "group_size")):
        pytest.skip("follows another key")
    cfg = _changed(defaults, key)
    if options.embedded_honours(key):
        options.check_verl_keys(cfg, defaults, runner)
    else:
        with pytest.raises(options.OptionNotHonoured, match=re.escape(key)):
            options.check_verl_keys(cfg, defaults, runner)
    options.check_verl_keys(cfg, defaults, options.VERL)  # the verl engine reads its own keys


def test_the_issue_keys_are_refused_by_the_embedded_engine():
    assert not any(options.embedded_honours(k) for k in ISSUE_KEYS)


def test_an_interpolated_key_follows_its_source_without_being_refused(defaults):
    # rollout.response_length: ${data.max_response_length} and group_size: ${rollout.n}
    cfg = compose_cfg("data.max_response_length=16", "actor_rollout_ref.rollout.n=4")
    options.check_verl_keys(cfg, defaults, options.REPLAY)


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONFIG_DIR / "algorithm_preset").glob("*.yaml")))
def test_every_algorithm_preset_runs_on_the_embedded_engine(defaults, preset):
    """Presets set only keys the embedded engine acts on (else a preset would be refused there)."""
    options.check_verl_keys(compose_cfg(f"algorithm_preset={preset}"), defaults, options.ASYNC)


@pytest.mark.parametrize("overrides, key", [
    (["hetero.mode=replay", "hetero.num_samplers=3"], "hetero.num_samplers"),
    (["hetero.mode=replay", "hetero.keep_weight_versions=9"], "hetero.keep_weight_versions"),
    (["hetero.mode=replay", "hetero.transport=fs"], "hetero.transport"),
    (["hetero.mode=async", "actor_rollout_ref.rollout.top_p=0.9"], "actor_rollout_ref.rollout.top_p"),
    (["hetero.mode=replay", "actor_rollout_ref.actor.ppo_epochs=2"], "actor_rollout_ref.actor.ppo_epochs"),
    (["hetero.mode=replay", "+verl_engine.old_log_prob=recompute"], "verl_engine.old_log_prob"),
])  # fmt: skip
def test_the_entry_refuses_before_any_work(tmp_path, overrides, key):
    run_dir = tmp_path / "run"
    cfg = compose_cfg(*overrides, f"trainer.default_local_dir={run_dir}")
    with pytest.raises(options.OptionNotHonoured, match=re.escape(key)):
        run_local(cfg)
    assert not run_dir.exists()  # nothing written, no warm start


def test_a_missing_math_dataset_file_fails_naming_the_key_and_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    cfg = compose_cfg("task.name=math", "task.dataset=aime24", f"task.dataset_path={missing}",
                      f"trainer.default_local_dir={tmp_path / 'run'}")  # fmt: skip
    with pytest.raises(ValueError, match=rf"task.dataset_path=.*{re.escape(str(missing))}"):
        run_local(cfg)
    assert not (tmp_path / "run").exists()
