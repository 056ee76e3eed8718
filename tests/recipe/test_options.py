"""The option contract: every option a user can set is honoured by the chosen engine and mode, or
refused at start naming the key, the runner that would ignore it and the runners that honour it.

- The walk covers every field of every config dataclass (hetero:, task:, verl_engine:) and every
  verl key written in gepo_trainer.yaml, in each of the three runners: a value a runner does not
  honour is refused.
- Every (option, replay) pair declared honoured has a behaviour case: a tiny replay run (2 steps,
  toy task) with the option changed must differ from the control run in its metrics, its files
  or its error. A control pair (the same config twice gives the same observation) shows that only
  the option makes the difference; a planted option that is declared honoured but not read is
  caught (the harness can fail). The full matrix is ``slow``; a representative subset runs by default.
- An option another key leaves without effect is refused naming both keys (or reported, where the
  study's presets keep it); an unknown key is refused in every section, with the closest known
  key; the command line prints a refusal as one line, the traceback only under HETERORL_DEBUG=1."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from recipe.gepo import options
from recipe.gepo.sections import HeteroConfig
from recipe.gepo.sections import TaskConfig
from recipe.gepo.main_gepo import DEBUG_ENV, run_command, run_local
from recipe.gepo.sections import VerlEngineConfig
from tests.subsets import default_run_keeps
from verl_ext.rundir import config_leaves

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "recipe" / "gepo" / "config"
SECTIONS = [("hetero", HeteroConfig), ("task", TaskConfig), ("verl_engine", VerlEngineConfig)]
# a value the field accepts that differs from its default, where the type alone cannot say
CHOICES = {
    "engine": "verl",
    "mode": "replay",
    "stale_policy": "wait",
    "order": "newest",
    "transport": "fs",
    "weight_sync": "delta",
    "dist": "weibull",
    "name": "math",
    "answer_format": "scratchpad",
    "old_log_prob": "recompute",
    "export_hf": "none",
}


def compose_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="gepo_trainer", overrides=list(overrides))


# the inert-option cases the default run keeps: one per kind of switch (the loss mode, a flag, a None,
# a project choice, a trust threshold)
INERT_FAST = (
    "actor_rollout_ref.actor.clip_ratio_c",
    "kl_loss_coef",
    "rollout_is_threshold",
    "hetero.max_delta_chain",
    "hetero.trust.checkable_sampling",
)
# the presets the default run starts (one per kind of loss; the two that set clip_ratio beside low/high)
FAST_PRESETS = ("gepo", "grpo", "gspo", "gmpo", "cispo")


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
        options.check_section(setting, prefix, runner)  # accepted (replay: the behaviour cases below run it)
    else:
        with pytest.raises(options.OptionNotHonoured) as err:
            options.check_section(setting, prefix, runner)
        message = str(err.value)
        assert key in message and options.RUNNER_NAMES[runner] in message
        assert all(options.RUNNER_NAMES[r] in message for r in options.honoured_by(field))


def _yaml_verl_keys() -> list[str]:
    """Dotted leaf keys written in gepo_trainer.yaml outside HeteroRL's own sections."""
    raw = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "gepo_trainer.yaml"), resolve=False)
    return [
        k for k, _ in config_leaves(raw, skip=options.NOT_OPTIONS) if k.split(".")[0] not in options.PROJECT_SECTIONS
    ]


VERL_KEYS = _yaml_verl_keys()
ISSUE_KEYS = [
    "actor_rollout_ref.rollout.top_p",
    "actor_rollout_ref.rollout.top_k",
    "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "data.max_prompt_length",
    "data.train_files",
    "data.val_files",
    "actor_rollout_ref.actor.optim.lr_scheduler_type",
]


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


@pytest.mark.parametrize(
    "preset", default_run_keeps(sorted(p.stem for p in (CONFIG_DIR / "algorithm_preset").glob("*.yaml")), FAST_PRESETS)
)
def test_every_algorithm_preset_runs_on_the_embedded_engine(defaults, preset):
    """Presets set only keys the embedded engine acts on (else a preset would be refused there)."""
    options.check_verl_keys(compose_cfg(f"algorithm_preset={preset}"), defaults, options.ASYNC)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["hetero.mode=replay", "hetero.num_samplers=3"], "hetero.num_samplers"),
        (["hetero.mode=replay", "hetero.keep_weight_versions=9"], "hetero.keep_weight_versions"),
        (["hetero.mode=replay", "hetero.transport=fs"], "hetero.transport"),
        (["hetero.mode=async", "actor_rollout_ref.rollout.top_p=0.9"], "actor_rollout_ref.rollout.top_p"),
        (["hetero.mode=replay", "actor_rollout_ref.actor.ppo_epochs=2"], "actor_rollout_ref.actor.ppo_epochs"),
        (["hetero.mode=replay", "+verl_engine.old_log_prob=recompute"], "verl_engine.old_log_prob"),
    ],
)
def test_the_entry_refuses_before_any_work(tmp_path, overrides, key):
    run_dir = tmp_path / "run"
    cfg = compose_cfg(*overrides, f"trainer.default_local_dir={run_dir}")
    with pytest.raises(options.OptionNotHonoured, match=re.escape(key)):
        run_local(cfg)
    assert not run_dir.exists()  # nothing written, no warm start


def test_a_missing_math_dataset_file_fails_naming_the_key_and_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    cfg = compose_cfg(
        "task.name=math",
        "task.dataset=aime24",
        f"task.dataset_path={missing}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    )
    with pytest.raises(ValueError, match=rf"task.dataset_path=.*{re.escape(str(missing))}"):
        run_local(cfg)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------ options another key leaves inert


@pytest.mark.parametrize(
    "overrides, key, on",
    default_run_keeps(
        [
            (
                ["actor_rollout_ref.actor.clip_ratio_c=2.0"],
                "actor_rollout_ref.actor.clip_ratio_c",
                "policy_loss.loss_mode='gepo'",
            ),
            (
                ["actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.1"],
                "policy_loss.kl_cov_ratio",
                "policy_loss.loss_mode",
            ),
            (["actor_rollout_ref.actor.policy_loss.dro_beta=0.5"], "policy_loss.dro_beta", "policy_loss.loss_mode"),
            (["actor_rollout_ref.actor.loss_scale_factor=8"], "loss_scale_factor", "loss_agg_mode"),
            (["actor_rollout_ref.actor.kl_loss_coef=0.1"], "kl_loss_coef", "use_kl_loss=False"),
            (["actor_rollout_ref.actor.kl_loss_type=kl"], "kl_loss_type", "use_kl_loss=False"),
            (["algorithm.rollout_correction.rollout_is_threshold=3.0"], "rollout_is_threshold", "rollout_is=None"),
            (
                ["algorithm.rollout_correction.rollout_is_batch_normalize=true"],
                "rollout_is_batch_normalize",
                "rollout_is=None",
            ),
            (["algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"], "rollout_rs_threshold", "rollout_rs=None"),
            (["trainer.project_name=other"], "trainer.project_name", "trainer.logger=[]"),
            (
                ["trainer.project_name=other", "trainer.logger=[tensorboard]"],
                "trainer.project_name",
                "trainer.logger=['tensorboard']",
            ),
            (["hetero.max_delta_chain=3"], "hetero.max_delta_chain", "hetero.weight_sync='full'"),
            (["hetero.trust.divergence_window=3"], "hetero.trust.divergence_window", "hetero.trust.max_divergence=0.0"),
            (
                ["hetero.trust.checkable_sampling=true", "hetero.trust.verify_fraction=0"],
                "hetero.trust.checkable_sampling",
                "hetero.trust.verify_fraction=0",
            ),
        ],
        lambda case: case[1] in INERT_FAST,
    ),
)
def test_an_option_another_key_leaves_inert_is_refused_naming_both(defaults, overrides, key, on):
    cfg = compose_cfg(*overrides)
    with pytest.raises(options.ConfigError, match=re.escape(key) + r"=.* has no effect with .*" + re.escape(on)):
        options.check_dependencies(cfg, defaults, options.ASYNC)


@pytest.mark.parametrize(
    "overrides",
    [
        ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1"],
        ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=3.0"],
        ["actor_rollout_ref.actor.policy_loss.loss_mode=vanilla", "actor_rollout_ref.actor.clip_ratio_c=2.0"],
        ["hetero.weight_sync=delta", "hetero.max_delta_chain=3"],
        ["hetero.trust.checkable_sampling=true"],
        ["trainer.logger=[file]", "trainer.project_name=other"],
        ["trainer.default_local_dir=runs/${trainer.project_name}", "trainer.project_name=other"],
    ],
)
def test_the_same_option_with_its_switch_on_is_accepted(defaults, overrides):
    assert options.check_dependencies(compose_cfg(*overrides), defaults, options.ASYNC) == []


@pytest.mark.parametrize(
    "preset", default_run_keeps(sorted(p.stem for p in (CONFIG_DIR / "algorithm_preset").glob("*.yaml")), FAST_PRESETS)
)
def test_every_preset_starts_and_what_it_keeps_inert_is_reported(defaults, preset):
    """The study's presets set clip_ratio for every loss mode: where it is inert it is reported, not refused."""
    notes = options.check_dependencies(compose_cfg(f"algorithm_preset={preset}"), defaults, options.REPLAY)
    assert all("actor_rollout_ref.actor.clip_ratio=" in n and "not refused" in n for n in notes)
    assert bool(notes) == (preset in ("gmpo", "gspo"))  # the two that set clip_ratio beside low/high


def test_a_reported_option_is_in_the_run_report(tmp_path, tiny_model):
    run_dir = tmp_path / "run"
    run_local(
        compose_cfg(
            *BASE,
            f"actor_rollout_ref.model.path={tiny_model}",
            f"trainer.default_local_dir={run_dir}",
            "actor_rollout_ref.actor.clip_ratio=0.3",
            "trainer.total_training_steps=1",
        )
    )
    report = (run_dir / "report.md").read_text()
    assert "No effect: `actor_rollout_ref.actor.clip_ratio=0.3 has no effect with" in report


# ------------------------------------------------------------------------ unknown keys


TYPOS = [
    ("+algorithm.rollout_correction.rollout_is_treshold=3", "algorithm.rollout_correction.rollout_is_threshold"),
    ("+trainer.total_training_step=3", "trainer.total_training_steps"),
    ("+actor_rollout_ref.actor.clip_ratio_hgih=1", "actor_rollout_ref.actor.clip_ratio_high"),
]
TYPOS_ONE_RUNNER = [
    ("+actor_rollout_ref.actor.policy_loss.sampler_kl_cof=1", "actor_rollout_ref.actor.policy_loss.sampler_kl_coef"),
    ("+task.digit=2", "task.digits"),
    ("+hetero.max_dealy=2", "hetero.max_delay"),
    ("+hetero.delay.lo=2", "hetero.delay.low"),
    ("+hetero.trust.verify_fracton=0.5", "hetero.trust.verify_fraction"),
]


@pytest.mark.parametrize(
    "override, suggestion, runner",
    default_run_keeps(
        [(*t, r) for t in TYPOS for r in options.RUNNERS] + [(*t, options.REPLAY) for t in TYPOS_ONE_RUNNER],
        # every runner once, and the project's own sections
        lambda case: case[0] == TYPOS[1][0] or case[0] in ("+task.digit=2", "+hetero.max_dealy=2"),
    ),
)
def test_an_unknown_key_is_refused_in_every_section_naming_the_closest(override, suggestion, runner):
    engine = ["hetero.engine=verl"] if runner == options.VERL else [f"hetero.mode={runner}"]
    cfg = compose_cfg(override, *engine)
    typo = override[1:].split("=")[0]
    with pytest.raises(
        options.ConfigError, match=rf"unknown key\(s\) {re.escape(typo)} \(did you mean {re.escape(suggestion)}\?\)"
    ):
        if runner == options.VERL:
            from recipe.gepo.verl_engine.launch_plan import validate

            validate(cfg)
        else:
            from recipe.gepo.embedded.engine_config import EngineConfig

            EngineConfig.from_omegaconf(cfg)


@pytest.mark.parametrize(
    "override",
    [
        "+actor_rollout_ref.actor.policy_loss.m2po_threshold=0.04",  # a field of the loss config's dataclass
        "+actor_rollout_ref.model.override_config.attention_dropout=0.0",  # free-form: empty in the defaults
        "+ray_kwargs.ray_init.num_gpus=0",  # free-form: ray.init's keyword arguments
    ],
)
def test_keys_verl_knows_are_not_unknown(defaults, override):
    assert options.unknown_verl_keys(compose_cfg(override), defaults) == []


# ------------------------------------------------------------------------ one line on the command line


@pytest.mark.slow
def test_a_refusal_is_one_line_without_traceback(tmp_path):
    """The real command line (a subprocess: half a minute of imports): one line on stderr."""
    plain = subprocess.run(
        [sys.executable, "-m", "recipe.gepo.main_gepo", "+trainer.total_training_step=3", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != DEBUG_ENV},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plain.returncode == 1
    lines = [line for line in plain.stderr.splitlines() if line.strip()]
    assert lines == [
        "error: unknown key(s) trainer.total_training_step (did you mean trainer.total_training_steps?): "
        + lines[0].split("?): ", 1)[1]
    ]


def test_the_debug_switch_lets_the_refusal_through_with_its_traceback(monkeypatch):
    cfg = compose_cfg("+trainer.total_training_step=3")
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    with pytest.raises(SystemExit, match=r"^error: unknown key\(s\) trainer.total_training_step"):
        run_command(cfg)
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(options.ConfigError, match="trainer.total_training_step"):
        run_command(cfg)


# ------------------------------------------------------------------------ behaviour: each honoured option changes a run

TIMING = ("perf/", "hetero/wait_s")  # wall-clock metrics: the only ones two runs of one config may differ in
BASE = (
    "task.name=toy_addition",
    "task.digits=1",
    "task.eval_size=16",
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "data.max_response_length=4",
    "trainer.logger=[]",
    "trainer.resume_mode=disable",
    "hetero.mode=replay",
    "trainer.total_training_steps=2",
    "trainer.test_freq=0",
    "trainer.save_freq=0",
    "hetero.export_hf=none",
)
"""The tiny replay run every behaviour case starts from (with the tiny model's path and a run dir)."""


@dataclasses.dataclass(frozen=True)
class Case:
    """``change`` (overrides that set the option, and a value it requires with it) against the
    control ``BASE + setup`` (``setup``: what makes the option read, e.g. the loss that reads it).
    ``{data}`` in an override is a folder of input files shared by the runs."""

    change: tuple[str, ...]
    setup: tuple[str, ...] = ()


def _c(*change: str, setup: tuple[str, ...] = ()) -> Case:
    return Case(tuple(change), tuple(setup))


A, PL, RC = "actor_rollout_ref.actor", "actor_rollout_ref.actor.policy_loss", "algorithm.rollout_correction"
FILE_LOGGER = ("trainer.logger=[file]",)  # verl's file backend writes ./<project_name>/<experiment_name>.jsonl
DELAYS = ("trainer.total_training_steps=6", "hetero.delay.low=0.1")  # staleness that can vary
CASES_REPLAY: dict[str, Case] = {
    # hetero:
    "hetero.delay.dist": _c("hetero.delay.dist=none"),
    "hetero.delay.low": _c("hetero.delay.low=0.01"),
    "hetero.delay.high": _c("hetero.delay.high=30.0", setup=DELAYS),
    "hetero.delay.integer": _c(
        "hetero.delay.integer=true", setup=("hetero.delay.dist=uniform", "hetero.delay.low=0", "hetero.delay.high=1.9")
    ),
    "hetero.delay.confidence": _c("hetero.delay.confidence=0.2", setup=DELAYS),
    "hetero.delay.offset": _c("hetero.delay.offset=5.0", setup=DELAYS),
    "hetero.delay.value": _c("hetero.delay.value=1", setup=("hetero.delay.dist=constant",)),
    "hetero.delay.trace_path": _c(
        "hetero.delay.trace_path={data}/ones.txt",
        setup=("hetero.delay.dist=trace", "hetero.delay.trace_path={data}/zeros.txt"),
    ),
    "hetero.delay.trace_column": _c(
        "hetero.delay.trace_column=b",
        setup=("hetero.delay.dist=trace", "hetero.delay.trace_path={data}/delays.csv", "hetero.delay.trace_column=a"),
    ),
    "hetero.max_delay": _c("hetero.max_delay=0"),
    "hetero.max_nonfinite_steps": _c("hetero.max_nonfinite_steps=1", setup=(f"{A}.optim.lr=1e30",)),
    "hetero.learner_precision": _c("hetero.learner_precision=bf16"),
    "hetero.sampler_precision": _c("hetero.sampler_precision=bf16"),
    "hetero.dry_run": _c("hetero.dry_run=true"),
    "hetero.export_hf": _c("hetero.export_hf=final"),
    "hetero.seed": _c("hetero.seed=1"),
    # task:
    "task.digits": _c("task.digits=2"),
    "task.answer_format": _c("task.answer_format=scratchpad"),
    "task.diagnostics_every": _c("task.diagnostics_every=1", setup=("task.diagnostics_samples=2",)),
    "task.diagnostics_samples": _c(
        "task.diagnostics_samples=3", setup=("task.diagnostics_every=1", "task.diagnostics_samples=2")
    ),
    "task.eval_size": _c("task.eval_size=5"),
    "task.eval_temperature": _c("task.eval_temperature=0.3"),
    "task.warm_start_steps": _c(
        "task.warm_start_steps=4",
        setup=("actor_rollout_ref.model.path=", "task.cache_dir={data}/cache", "task.warm_start_steps=3"),
    ),
    "task.cache_dir": _c(
        "task.cache_dir={sandbox}/cache_b",
        setup=("actor_rollout_ref.model.path=", "task.cache_dir={sandbox}/cache_a", "task.warm_start_steps=3"),
    ),
    # verl's keys the embedded engine acts on
    "actor_rollout_ref.model.path": _c("actor_rollout_ref.model.path={other_model}"),
    "data.train_batch_size": _c("data.train_batch_size=3"),
    "data.max_response_length": _c("data.max_response_length=3"),
    "actor_rollout_ref.rollout.n": _c("actor_rollout_ref.rollout.n=3"),
    "actor_rollout_ref.rollout.temperature": _c("actor_rollout_ref.rollout.temperature=0.5"),
    "trainer.total_training_steps": _c("trainer.total_training_steps=3"),
    "trainer.default_local_dir": _c("trainer.default_local_dir={sandbox}/elsewhere"),
    "trainer.save_freq": _c("trainer.save_freq=1"),
    "trainer.test_freq": _c("trainer.test_freq=1"),
    "trainer.resume_mode": _c("trainer.resume_mode=auto", setup=("trainer.default_local_dir={data}/resumable",)),
    "trainer.logger": _c("trainer.logger=[tensorboard]"),
    "trainer.project_name": _c("trainer.project_name=other", setup=FILE_LOGGER),
    "trainer.experiment_name": _c("trainer.experiment_name=other", setup=FILE_LOGGER),
    f"{PL}.loss_mode": _c(f"{PL}.loss_mode=vanilla"),
    f"{PL}.clip_cov_ratio": _c(f"{PL}.clip_cov_ratio=0.5", setup=(f"{PL}.loss_mode=clip_cov",)),
    f"{PL}.clip_cov_lb": _c(f"{PL}.clip_cov_lb=-5.0", setup=(f"{PL}.loss_mode=clip_cov", f"{PL}.clip_cov_ratio=0.5")),
    f"{PL}.clip_cov_ub": _c(f"{PL}.clip_cov_ub=0.0", setup=(f"{PL}.loss_mode=clip_cov", f"{PL}.clip_cov_ratio=0.5")),
    f"{PL}.kl_cov_ratio": _c(f"{PL}.kl_cov_ratio=0.5", setup=(f"{PL}.loss_mode=kl_cov",)),
    f"{PL}.ppo_kl_coef": _c(f"{PL}.ppo_kl_coef=5.0", setup=(f"{PL}.loss_mode=kl_cov", f"{PL}.kl_cov_ratio=0.5")),
    f"{PL}.dro_beta": _c(f"{PL}.dro_beta=5.0", setup=(f"{PL}.loss_mode=dro", f"{PL}.dro_beta=0.1")),
    f"{PL}.seq_reduction": _c(f"{PL}.seq_reduction=sum"),
    f"{PL}.adaptive_kl_threshold": _c(f"{PL}.adaptive_kl_threshold=1.0", setup=(f"{PL}.loss_mode=gepo_adaptive",)),
    f"{PL}.delta_l_alpha": _c(f"{PL}.delta_l_alpha=0.1", setup=(f"{PL}.loss_mode=delta_l",)),
    f"{PL}.topr_reduction": _c(f"{PL}.topr_reduction=mean", setup=(f"{PL}.loss_mode=topr",)),
    f"{PL}.m2po_threshold": _c(f"+{PL}.m2po_threshold=1e-6", setup=(f"{PL}.loss_mode=m2po",)),
    f"{PL}.vespo_k_pos": _c(f"+{PL}.vespo_k_pos=0.5", setup=(f"{PL}.loss_mode=vespo",)),
    f"{PL}.vespo_lambda_pos": _c(f"+{PL}.vespo_lambda_pos=0.5", setup=(f"{PL}.loss_mode=vespo",)),
    f"{PL}.vespo_k_neg": _c(f"+{PL}.vespo_k_neg=0.5", setup=(f"{PL}.loss_mode=vespo",)),
    f"{PL}.vespo_lambda_neg": _c(f"+{PL}.vespo_lambda_neg=0.5", setup=(f"{PL}.loss_mode=vespo",)),
    f"{PL}.tc_ess_bound": _c(f"+{PL}.tc_ess_bound=true", setup=(f"{PL}.loss_mode=gepo_tc",)),
    f"{PL}.sampler_kl_coef": _c(f"{PL}.sampler_kl_coef=1.0"),
    f"{A}.clip_ratio": _c(f"{A}.clip_ratio=0.01", setup=(f"{A}.clip_ratio_low=null", f"{A}.clip_ratio_high=null")),
    f"{A}.clip_ratio_low": _c(f"{A}.clip_ratio_low=0.01"),
    f"{A}.clip_ratio_high": _c(f"{A}.clip_ratio_high=0.01"),
    f"{A}.clip_ratio_c": _c(f"{A}.clip_ratio_c=1.01", setup=(f"{PL}.loss_mode=vanilla",)),
    f"{A}.loss_agg_mode": _c(f"{A}.loss_agg_mode=token-mean"),
    f"{A}.loss_scale_factor": _c(f"{A}.loss_scale_factor=1", setup=(f"{A}.loss_agg_mode=seq-mean-token-sum-norm",)),
    f"{A}.entropy_coeff": _c(f"{A}.entropy_coeff=0.5"),
    f"{A}.use_kl_loss": _c(f"{A}.use_kl_loss=true"),
    f"{A}.kl_loss_coef": _c(f"{A}.kl_loss_coef=5.0", setup=(f"{A}.use_kl_loss=true",)),
    f"{A}.kl_loss_type": _c(f"{A}.kl_loss_type=mse", setup=(f"{A}.use_kl_loss=true",)),
    f"{A}.grad_clip": _c(f"{A}.grad_clip=0.001"),
    f"{A}.optim.lr": _c(f"{A}.optim.lr=1e-2"),
    f"{A}.optim.betas": _c(f"{A}.optim.betas=[0.5,0.6]"),
    f"{A}.optim.weight_decay": _c(f"{A}.optim.weight_decay=50.0"),
    "algorithm.adv_estimator": _c("algorithm.adv_estimator=bnpo"),
    "algorithm.norm_adv_by_std_in_grpo": _c("algorithm.norm_adv_by_std_in_grpo=true"),
    f"{RC}.rollout_is": _c(f"{RC}.rollout_is=token"),
    f"{RC}.rollout_is_threshold": _c(f"{RC}.rollout_is_threshold=1.001", setup=(f"{RC}.rollout_is=token",)),
    f"{RC}.rollout_is_batch_normalize": _c(f"{RC}.rollout_is_batch_normalize=true", setup=(f"{RC}.rollout_is=token",)),
    f"{RC}.rollout_rs": _c(f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=0.999_1.001"),
    f"{RC}.rollout_rs_threshold": _c(
        f"{RC}.rollout_rs_threshold=0.999_1.001",
        setup=(f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=0.01_100.0"),
    ),
}
"""Every (option, replay) pair declared honoured, but the ones in OBSERVED_ELSEWHERE and the runner
selectors: how to see it change a tiny replay run."""

OBSERVED_ELSEWHERE = {
    "hetero.device": "tests/recipe/embedded/test_device.py::test_every_tensor_of_a_step_is_on_the_configured_device",
    "hetero.learner_cpus": "tests/recipe/embedded/test_pinning.py::test_pinned_moves_the_process_and_restores_it",
    "hetero.sampler_cpus": "tests/recipe/embedded/test_pinning.py::test_replay_generates_on_the_sampler_cores_and_gives_the_same_run",
    "task.name": "tests/recipe/test_options.py::test_a_math_task_option_changes_the_prompts",
    "task.model": "tests/data/test_smollm2.py",
    "task.dataset": "tests/recipe/test_options.py::test_a_math_task_option_changes_the_prompts",
    "task.dataset_options": "tests/recipe/test_options.py::test_a_math_task_option_changes_the_prompts",
    "task.dataset_path": "tests/recipe/embedded/test_option_behaviour.py::test_math_task_reads_its_dataset_path_and_eval_dataset",
    "task.eval_dataset": "tests/recipe/test_options.py::test_a_math_task_option_changes_the_prompts",
    "task.eval_dataset_options": "tests/recipe/test_options.py::test_a_math_task_option_changes_the_prompts",
    "task.template": "tests/recipe/test_options.py::test_a_math_task_option_changes_the_prompts",
    f"{PL}.compile": "tests/algos/test_compiled_losses.py",
}
"""Honoured (option, replay) pairs a tiny toy replay run cannot show (a GPU, the process's cores, the
math task, a compiled graph with the same numbers): the test that shows each."""
SELECTORS = ("hetero.engine", "hetero.mode")
"""They choose the runner itself."""
FAST = ("hetero.max_delay", f"{PL}.loss_mode", f"{A}.optim.lr", f"{RC}.rollout_is")
"""The representative subset of CASES_REPLAY run by default (the rest: ``-m slow``)."""


_DEFAULTS: list = []


def _defaults():
    if not _DEFAULTS:
        _DEFAULTS.append(compose_cfg())
    return _DEFAULTS[0]


def honoured_replay_keys() -> set[str]:
    """Every option the contract declares honoured in replay mode: the fields of the project's
    sections and the verl keys (gepo_trainer.yaml's and the loss config's fields) it acts on."""
    keys = {
        key
        for prefix, cls in SECTIONS
        for key, field, _ in options.option_fields(cls, prefix)
        if options.REPLAY in options.honoured_by(field)
    }
    from verl_ext.algos.config import HeteroPolicyLossConfig

    composed = OmegaConf.to_container(_defaults(), resolve=False)
    verl = {
        k
        for k, _ in config_leaves(composed, skip=options.NOT_OPTIONS)
        if k.split(".")[0] not in options.PROJECT_SECTIONS
    }
    verl |= {f"{PL}.{f.name}" for f in dataclasses.fields(HeteroPolicyLossConfig)}
    verl = {k for k in verl if not k.split(".")[-1].startswith("_")}  # _target_: which dataclass, not an option
    return keys | {k for k in verl if options.embedded_honours(k)}


def test_every_honoured_replay_option_has_a_behaviour_case():
    covered = set(CASES_REPLAY) | set(OBSERVED_ELSEWHERE) | set(SELECTORS)
    honoured = honoured_replay_keys()
    assert honoured - covered == set(), "declared honoured in replay mode with no behaviour case"
    assert covered - honoured == set(), "a behaviour case for an option replay mode does not honour"
    check_pointers(OBSERVED_ELSEWHERE)


def check_pointers(pointers: dict[str, str]) -> None:
    """Each option's pointer (``"tests/path.py"`` or ``"tests/path.py::test_name"``) names a test
    file that exists, and a test function defined in it."""
    for key, where in pointers.items():
        path, _, name = where.partition("::")
        assert (ROOT / path).is_file(), f"{key}: {path}"
        assert not name or re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), f"{key}: {where}"


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The embedded tests' tiny warm start (1 digit, 50 steps), cached across sessions."""
    from verl_ext.data.toy.checkpoints import warm_start

    cache = Path(os.environ.get("HETERORL_TEST_CACHE", Path(tempfile.gettempdir()) / "heterorl-test-cache"))
    return str(warm_start(cache, digits=1, steps=50, n_eval=32, batch_size=32, warmup_steps=5))


def write_case_data(folder: Path) -> Path:
    """The small files behaviour cases point options at: two toy datasets and a delay trace."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "zeros.txt").write_text("0\n" * 8)
    (folder / "ones.txt").write_text("1\n" * 8)
    (folder / "delays.csv").write_text("a,b\n" + "0,1\n" * 8)
    return folder


def declare_honoured(monkeypatch, section: type, name: str, runner: str) -> None:
    """Plant a false declaration the option checks must catch: ``options.honoured_by`` says the
    field ``name`` of ``section`` is honoured by ``runner`` too (for this test only)."""
    planted = next(f for f in dataclasses.fields(section) if f.name == name)
    declared = options.honoured_by
    monkeypatch.setattr(
        options, "honoured_by", lambda field: (*declared(field), runner) if field is planted else declared(field)
    )


class BehaviourHarness:
    """One runner's behaviour check: a run under each setup (its control, observed once) against
    the run with one option changed. A runner's subclass defines ``observe`` (overrides ->
    ``{"error": ..., ...}``), how messages name it (``runner``) and which errors a changed run may
    end in (``check_error``)."""

    runner = ""

    def __init__(self, root: Path, model: str):
        self.root, self.model = root, model
        self.controls: dict[tuple[str, ...], dict] = {}
        self._n = 0

    def observe(self, overrides: tuple[str, ...]) -> dict:
        raise NotImplementedError

    def check_error(self, key: str, case: Case, changed: dict) -> None:
        """A changed run's error is an observation like any other (the replay runner's rule)."""

    def control(self, setup: tuple[str, ...]) -> dict:
        if setup not in self.controls:
            self.controls[setup] = self.observe(setup)
        return self.controls[setup]

    def check(self, key: str, case: Case) -> None:
        """AssertionError when changing ``key`` (``case``) leaves the run's observation unchanged,
        when the runner refuses it, or when it fails other than ``check_error`` allows."""
        control = self.control(case.setup)
        assert control["error"] is None, f"{key}: the control run failed: {control['error']}"
        try:
            changed = self.observe(case.setup + case.change)
        except options.OptionNotHonoured as err:
            raise AssertionError(f"{key}: declared honoured {self.runner}, but refused: {err}") from None
        self.check_error(key, case, changed)
        assert changed != control, f"{key}: declared honoured {self.runner}, but {case.change} changed nothing"


class Harness(BehaviourHarness):
    """Tiny replay runs through the entry's ``run_local``, each in its own sandbox folder (the
    working directory: tracking backends write there), observed as (metrics without wall-clock
    ones, the sandbox's files, the error)."""

    runner = "in replay mode"

    def __init__(self, root: Path, model: str, other_model: str):
        super().__init__(root, model)
        self.other_model = other_model
        self.data = write_case_data(root / "data")

    def observe(self, overrides: tuple[str, ...]) -> dict:
        self._n += 1
        sandbox = self.root / f"run{self._n}"
        sandbox.mkdir()
        fill = {"data": self.data, "sandbox": sandbox, "other_model": self.other_model}
        items = [
            o.format(**fill)
            for o in (
                *BASE,
                f"actor_rollout_ref.model.path={self.model}",
                f"trainer.default_local_dir={sandbox / 'run'}",
                *overrides,
            )
        ]
        if any("trainer.default_local_dir={data}/resumable" in o for o in overrides):
            self._resumable(items, sandbox)
        error = None
        cwd = os.getcwd()
        os.chdir(sandbox)
        try:
            run_local(compose_cfg(*items))
        except Exception as err:  # noqa: BLE001 -- an error is an observation
            error = f"{type(err).__name__}: {err}".replace(str(sandbox), "<sandbox>")
        finally:
            os.chdir(cwd)
        metrics = []
        for path in sorted(sandbox.rglob("metrics.jsonl")):
            metrics += [
                {k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)}
                for line in path.read_text().splitlines()
                if line.strip()
            ]
        files = sorted(
            re.sub(r"\.\d{9,}", ".<time>", re.sub(r"tfevents\..*", "tfevents", str(p.relative_to(sandbox))))
            for p in sandbox.rglob("*")
            if p.is_file()
        )
        return {"metrics": metrics, "files": files, "error": error}

    def _resumable(self, items: list[str], sandbox: Path) -> None:
        """A run dir holding a finished 1-step run (checkpoint included), made once; copied into
        the sandbox of each run that starts in it."""
        folder = self.data / "resumable"
        if not folder.exists():
            first = [
                o for o in items if not o.startswith(("trainer.default_local_dir=", "trainer.total_training_steps="))
            ]
            run_local(compose_cfg(*first, f"trainer.default_local_dir={folder}", "trainer.total_training_steps=1"))
        index = items.index(f"trainer.default_local_dir={folder}")
        copy_to = sandbox / "resumable"
        shutil.copytree(folder, copy_to)
        items[index] = f"trainer.default_local_dir={copy_to}"


@pytest.fixture(scope="module")
def harness(tmp_path_factory, tiny_model) -> Harness:
    from verl_ext.data.toy.checkpoints import warm_start

    root = tmp_path_factory.mktemp("behaviour")
    other = warm_start(root / "models", digits=1, steps=5, n_eval=8, batch_size=8, warmup_steps=1)
    return Harness(root, tiny_model, str(other))


def test_the_control_pair_is_identical(harness):
    """The same config twice: the same observation, so a difference below is the option's."""
    first = harness.control(())
    assert first["error"] is None and len(first["metrics"]) == 3  # step 0 evaluation + 2 steps
    assert harness.observe(()) == first


@pytest.mark.parametrize("key", FAST)
def test_a_representative_option_changes_the_run(harness, key):
    harness.check(key, CASES_REPLAY[key])


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(set(CASES_REPLAY) - set(FAST)))
def test_every_honoured_option_changes_the_run(harness, key):
    harness.check(key, CASES_REPLAY[key])


def test_the_harness_catches_an_option_declared_honoured_that_is_not_read(harness, monkeypatch):
    """Plant a verl key the embedded engine does not read (top_p: its sampler draws from the full
    softmax) among the honoured ones: the coverage check and the behaviour check both fail."""
    planted = "actor_rollout_ref.rollout.top_p"
    monkeypatch.setattr(options, "EMBEDDED_VERL_KEYS", (*options.EMBEDDED_VERL_KEYS, planted))
    with pytest.raises(AssertionError, match="no behaviour case"):
        test_every_honoured_replay_option_has_a_behaviour_case()
    with pytest.raises(AssertionError, match=re.escape(f"{planted}: declared honoured in replay mode, but")):
        harness.check(planted, _c(f"{planted}=0.5"))


@pytest.mark.parametrize(
    "key, base, change",
    [
        ("task.name", dict(name="toy_addition"), dict(name="math", template="plain")),
        ("task.dataset", dict(), dict(dataset="gsm8k")),
        (
            "task.dataset_options",
            dict(dataset="math_train"),
            dict(dataset="math_train", dataset_options={"levels": [1]}),
        ),
        ("task.eval_dataset", dict(), dict(eval_dataset="gsm8k")),
        (
            "task.eval_dataset_options",
            dict(eval_dataset="math_train"),
            dict(eval_dataset="math_train", eval_dataset_options={"levels": [1]}),
        ),
        ("task.template", dict(), dict(template="qwen3_think")),
    ],
)
def test_a_math_task_option_changes_the_prompts(key, base, change):
    """The math task's options, at the task (a math run needs a math model): the prompts change."""
    from recipe.gepo.embedded.tasks import Task

    def prompts(**fields):
        fields = {"eval_size": 4, **fields}
        if fields.get("name", "math") == "math":
            fields = {"name": "math", "template": "plain", **fields}
        task = Task(TaskConfig(**fields), seed=0)
        return [it["prompt"] for it in task.train_items(4, stream=1, index=0)] + [
            it["prompt"] for it in task.eval_items
        ]

    assert prompts(**base) != prompts(**change), f"{key}: {change} changed no prompt"
