"""Every preset in configs/ composes on gepo_trainer.yaml, validates against verl's config
dataclasses and verl's own validate_config, and dry-runs to a plan; bad configs fail early,
naming the key."""

import copy
import re
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import ActorConfig, RolloutConfig

from recipe.gepo.verl_engine.launch_plan import build_plan, dry_run
from recipe.gepo.verl_engine.runner import run
from recipe.gepo.options import ConfigError
from recipe.gepo.options import OptionNotHonoured
from recipe.gepo.verl_engine.launch_plan import VerlEngineConfigError, engine_settings, validate
from recipe.gepo.verl_engine.runner import NoGPUError
from verl_ext.algos.config import HeteroPolicyLossConfig


ROOT = Path(__file__).resolve().parents[3]
# the GPU cluster presets; cpu_* presets run verl on this machine (tested below and in tests/cpu/)
PRESETS = sorted(p.stem for p in (ROOT / "configs" / "verl_preset").glob("*.yaml") if not p.stem.startswith("cpu_"))


def compose_config(*overrides):
    searchpath = f"hydra.searchpath=[pkg://verl.trainer.config,file://{ROOT / 'configs'}]"
    with initialize_config_dir(config_dir=str(ROOT / "recipe" / "gepo" / "config"), version_base=None):
        return compose(config_name="gepo_trainer", overrides=[searchpath, *overrides])


# preset -> (model, learner backend, learner GPUs, TP, PP, sampler GPUs, sampler TP)
EXPECTED = {
    "qwen3_1p7b_fsdp": ("Qwen/Qwen3-1.7B", "fsdp2", 8, 1, 1, 8, 1),
    "qwen3_1p7b_megatron": ("Qwen/Qwen3-1.7B", "megatron", 8, 2, 1, 8, 1),
    "qwen3_8b_fsdp": ("Qwen/Qwen3-8B", "fsdp2", 16, 1, 1, 16, 2),
    "qwen3_8b_megatron": ("Qwen/Qwen3-8B", "megatron", 16, 4, 2, 16, 2),
}


_CACHE: dict = {}


def preset_cfg(preset, *overrides):
    """Composed preset (cached per module: hydra composition is the slow part), then ``key=value``
    overrides applied to a copy -- for validation tests that do not exercise group switching."""
    if preset not in _CACHE:
        _CACHE[preset] = compose_config(f"+verl_preset={preset}")
    cfg = copy.deepcopy(_CACHE[preset])
    with open_dict(cfg):
        for item in overrides:
            key, value = item.lstrip("+").split("=", 1)
            OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=True)
    return cfg


def test_the_issue_presets_exist():
    assert set(EXPECTED) == set(PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_validates_and_dry_runs(preset, capsys):
    cfg = preset_cfg(preset)
    model, backend, learner_gpus, tp, pp, sampler_gpus, sampler_tp = EXPECTED[preset]
    v = validate(cfg)
    assert isinstance(v.actor, ActorConfig) and isinstance(v.rollout, RolloutConfig)
    assert isinstance(v.actor.policy_loss, HeteroPolicyLossConfig)
    assert type(v.algorithm).__name__ == "AlgoConfig"
    # the paper's online hyper-parameters
    assert cfg.data.train_batch_size == 32 and v.rollout.n == 8
    assert v.actor.optim.lr == pytest.approx(1e-6) and v.rollout.temperature == pytest.approx(0.6)
    assert cfg.data.max_prompt_length == 768 and cfg.data.max_response_length == 4096
    assert v.actor.policy_loss.loss_mode == "gepo" and v.actor.policy_loss.group_size == 8
    assert v.rollout.name == "vllm" and v.rollout.calculate_log_probs
    # hardware
    assert cfg.actor_rollout_ref.model.path == model and v.actor.strategy == backend
    assert cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node == learner_gpus
    assert v.rollout.nnodes * v.rollout.n_gpus_per_node == sampler_gpus
    assert v.rollout.tensor_model_parallel_size == sampler_tp
    if backend == "megatron":
        assert (v.actor.megatron.tensor_model_parallel_size, v.actor.megatron.pipeline_model_parallel_size) == (tp, pp)
    assert v.hetero.engine == "verl" and v.hetero.max_delay == 8
    # the project's math rewards: verl's default scorer knows no math_train, math500 or amc23
    assert cfg.reward.custom_reward_function.path == "pkg://verl_ext.rewards.dispatch"

    dry_run(cfg)
    out = capsys.readouterr().out
    assert f"preset:          {preset}" in out
    assert f"= {learner_gpus} GPUs" in out and f"= {sampler_gpus} GPUs, vllm TP={sampler_tp}" in out
    if backend == "megatron":
        assert f"Megatron TP={tp} PP={pp}" in out
    else:
        assert "FSDP2" in out
    assert "loss_mode=gepo" in out and "32 prompts x G=8 = 256" in out
    assert "staleness bound: 8 versions" in out and "lognormal(" in out and "in seconds" in out


@pytest.mark.parametrize(
    "delay, staleness, expect",
    [
        ("lognormal_1800s", "max64", ["high=1800", "staleness bound: 64 versions", "max 1800.0"]),
        ("none", "max8", ["delay (weights): none"]),
    ],
)
def test_delay_and_staleness_groups_switch_with_one_override(delay, staleness, expect):
    cfg = compose_config("+verl_preset=qwen3_1p7b_fsdp", f"hetero_delay={delay}", f"hetero_staleness={staleness}")
    plan = build_plan(cfg)
    for text in expect:
        assert text in plan, (text, plan)


def test_algorithm_preset_switches_on_top_of_a_verl_preset():
    plan = build_plan(compose_config("+verl_preset=qwen3_8b_fsdp", "algorithm_preset=grpo"))
    assert "loss_mode=vanilla" in plan and "std-normalised: True" in plan


def test_run_with_dry_run_returns_the_plan_and_without_gpus_fails_clearly(capsys):
    cfg = compose_config("+verl_preset=qwen3_1p7b_fsdp", "hetero.dry_run=true")
    result = run(cfg)
    assert "HeteroRL verl engine plan" in result["plan"]
    assert result["plan"] in capsys.readouterr().out
    with pytest.raises(NoGPUError, match="needs GPUs .*this machine has none.*verl_preset=cpu_toy"):
        run(preset_cfg("qwen3_1p7b_fsdp"))


def test_a_finished_run_is_not_started_again_and_the_command_says_how_to_go_on(tmp_path, capsys):
    """The same command on a run whose checkpoint is at its last step: one line, no Ray, no verl workers."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "latest_checkpointed_iteration.txt").write_text("2")
    cfg = compose_config("+verl_preset=cpu_toy", "hetero.engine=verl", f"trainer.default_local_dir={run_dir}")
    result = run(cfg)
    assert result["nothing_to_train"] == 2
    out = capsys.readouterr().out
    assert (
        f"the run at {run_dir} finished at step 2 of 2" in out and "trainer.total_training_steps=<more than 2>" in out
    )
    assert sorted(p.name for p in run_dir.iterdir()) == ["latest_checkpointed_iteration.txt"]  # nothing written


def test_engine_settings_set_the_trainer_and_verl_threshold():
    cfg = preset_cfg("qwen3_1p7b_fsdp", "hetero.max_delay=64", "hetero.stale_policy=wait")
    out = engine_settings(cfg)
    assert out.trainer.v1.trainer_mode == "hetero_separate_async"
    assert out.trainer.v1.sampler.max_off_policy_threshold == 65
    assert out.trainer.v1.sampler.max_off_policy_strategy == "wait"
    assert cfg.trainer.v1.sampler.max_off_policy_threshold == 8  # the input is not modified


def test_joining_a_running_ray_cluster_drops_the_local_start_sizes():
    """verl_star.sbatch sets RAY_ADDRESS: Ray refuses num_cpus/num_gpus when joining a cluster."""
    cfg = compose_config("+verl_preset=cpu_toy", "hetero.engine=verl")
    assert engine_settings(cfg).ray_kwargs.ray_init.num_gpus == 4  # a local start: the preset's logical GPUs
    joined = engine_settings(cfg, ray_address="10.214.0.11:6379").ray_kwargs.ray_init
    assert "num_cpus" not in joined and "num_gpus" not in joined


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        # verl would replace the loss: refused as a one-line ConfigError (ForcedLossModeError's message)
        (["algorithm.rollout_correction.bypass_mode=true"], ConfigError, "bypass_mode=true"),
        (["trainer.use_v1=false"], ConfigError, "trainer.use_v1=false"),
        (["actor_rollout_ref.hybrid_engine=true"], VerlEngineConfigError, "hybrid_engine"),
        (["actor_rollout_ref.rollout.name=hf"], VerlEngineConfigError, "rollout.name='hf'"),
        (["actor_rollout_ref.rollout.calculate_log_probs=false"], VerlEngineConfigError, "calculate_log_probs"),
        (["algorithm.rollout_correction.rollout_is=token"], VerlEngineConfigError, "old_log_prob=recompute"),
        (
            [
                "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
                "algorithm.rollout_correction.rollout_rs_threshold=0.9_1.1",
            ],
            VerlEngineConfigError,
            "rollout_rs='seq_mean_k1'",
        ),
        (["actor_rollout_ref.rollout.tensor_model_parallel_size=3"], VerlEngineConfigError, "TP x DP x PP = 3"),
        (["actor_rollout_ref.rollout.checkpoint_engine.backend=naive"], VerlEngineConfigError, "backend=naive"),
        (["actor_rollout_ref.rollout.nnodes=0"], VerlEngineConfigError, "rollout.nnodes=0"),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=16"], VerlEngineConfigError, "parameter_sync_step"),
        (["hetero.mode=replay"], VerlEngineConfigError, "hetero.mode='replay'"),
        (["hetero.transport=fs"], VerlEngineConfigError, "hetero.transport=fs .* needs hetero.trust.enrolment_file"),
        (["hetero.engine=embedded"], VerlEngineConfigError, "hetero.engine='embedded'"),
        (["verl_engine.old_log_prob=learner"], ValueError, "verl_engine.old_log_prob='learner'"),
        (["+verl_engine.placment=x"], ValueError, "placment"),
        (["hetero.max_delay=-1"], ValueError, "hetero.max_delay"),
    ],
)
def test_bad_configs_fail_before_anything_runs_naming_the_key(overrides, error, match):
    cfg = preset_cfg("qwen3_1p7b_fsdp", *overrides)
    with pytest.raises(error, match=match):
        build_plan(cfg)


@pytest.mark.parametrize("preset", ["decoupled_ppo", "grpo_icepop", "grpo_seq_mis"])
def test_rollout_correction_presets_need_the_recomputed_old_policy_on_the_verl_engine(preset):
    cfg = compose_config("+verl_preset=qwen3_1p7b_fsdp", f"algorithm_preset={preset}")
    with pytest.raises(VerlEngineConfigError, match="verl_engine.old_log_prob=recompute"):
        build_plan(cfg)
    build_plan(
        compose_config(
            "+verl_preset=qwen3_1p7b_fsdp", f"algorithm_preset={preset}", "verl_engine.old_log_prob=recompute"
        )
    )


@pytest.mark.parametrize(
    "override",
    [
        "hetero.num_samplers=4",
        "hetero.learner_cpus=[0]",
        "hetero.max_queued_groups=8",
        "hetero.sampler_speed_factors=[2.0,3.0]",
        "hetero.wait_timeout_s=5",
        "hetero.weight_sync=delta",
        "hetero.max_delta_chain=2",
        "hetero.system_cpus=[0]",
        "hetero.weights_bf16=true",
    ],
)
def test_embedded_engine_options_are_refused_not_ignored(override):
    cfg = preset_cfg("qwen3_1p7b_fsdp", override)
    key = override.split("=")[0]
    with pytest.raises(
        OptionNotHonoured, match=f"{key}=.* is not honoured by hetero.engine=verl .*honoured by hetero.engine=embedded"
    ):
        build_plan(cfg)


def test_megatron_parallel_sizes_must_divide_the_learner_gpus():
    cfg = preset_cfg("qwen3_8b_megatron", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3")
    with pytest.raises((AssertionError, VerlEngineConfigError), match="divisible"):
        build_plan(cfg)


@pytest.mark.parametrize("preset", ["qwen3_1p7b_megatron", "qwen3_8b_megatron", "cpu_toy_megatron"])
def test_megatron_presets_carry_what_the_cpu_run_taught(preset):
    """Every Megatron preset names the installed bridge (mbridge, ``vanilla_mbridge``) and keeps the
    distributed optimizer; both pass the pre-training check against this machine's packages."""
    from recipe.gepo.verl_engine.launch_plan import check_megatron_stack

    cfg = preset_cfg(preset)
    mc = cfg.actor_rollout_ref.actor.megatron
    assert mc.vanilla_mbridge is True and mc.use_distributed_optimizer is True
    assert cfg.actor_rollout_ref.ref.megatron.vanilla_mbridge is True  # the reference model follows the actor
    check_megatron_stack(cfg)


@pytest.mark.parametrize(
    "override, named",
    [
        ("actor_rollout_ref.actor.megatron.vanilla_mbridge=false", "=false needs megatron-bridge"),
        ("actor_rollout_ref.actor.megatron.use_distributed_optimizer=false", "megatron_utils.py:827"),
    ],
)
def test_megatron_settings_this_stack_cannot_run_fail_before_training(override, named):
    from recipe.gepo.verl_engine.launch_plan import check_megatron_stack

    with pytest.raises(VerlEngineConfigError, match=re.escape(override.split("=")[0]) + ".*" + re.escape(named)):
        check_megatron_stack(preset_cfg("qwen3_1p7b_megatron", override))


def test_verl_dataclasses_reject_a_bad_loss_option_in_a_preset():
    cfg = preset_cfg("qwen3_1p7b_fsdp", "actor_rollout_ref.actor.policy_loss.seq_reduction=median")
    with pytest.raises(Exception, match="seq_reduction"):
        build_plan(cfg)


def test_gepo_trainer_alone_with_engine_verl_needs_the_cluster_keys():
    """Without a preset, verl's defaults (colocated hybrid engine, no sampler pool) are refused."""
    cfg = compose_config("hetero.engine=verl", "actor_rollout_ref.rollout.name=vllm")
    with open_dict(cfg):
        cfg.actor_rollout_ref.rollout.nnodes = 1
    with pytest.raises(VerlEngineConfigError, match="hybrid_engine"):
        build_plan(cfg)
    assert omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout).nnodes == 1


def test_cpu_toy_preset_validates_for_the_verl_engine(capsys):
    """The CPU preset passes the verl engine's validation as written (the documented command)."""
    cfg = compose_config("+verl_preset=cpu_toy", "hetero.engine=verl", "hetero.dry_run=true")
    v = validate(cfg)
    assert v.rollout.name == "hf_cpu"
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "ray_mailbox"
    assert cfg.actor_rollout_ref.hybrid_engine is False
    assert cfg.trainer.device == "cpu"


@pytest.mark.parametrize(
    "overrides, parallel",
    [
        ([], "Megatron TP=2 PP=1 CP=1 DP=1"),
        (
            [
                "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
            ],
            "Megatron TP=1 PP=2 CP=1 DP=1",
        ),
    ],
)
def test_cpu_toy_megatron_preset_validates_and_dry_runs(overrides, parallel, capsys):
    """The Megatron CPU preset (TP=2; PP=2 by the documented override) passes the verl engine's
    validation and its plan names the learners' parallelism."""
    cfg = compose_config("+verl_preset=cpu_toy_megatron", "hetero.engine=verl", "hetero.dry_run=true", *overrides)
    v = validate(cfg)
    assert v.actor.strategy == "megatron" and v.rollout.name == "hf_cpu"
    assert v.actor.megatron.vanilla_mbridge and not v.actor.megatron.sequence_parallel
    assert cfg.actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend == "local"
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.backend == "ray_mailbox"
    assert cfg.actor_rollout_ref.hybrid_engine is False and cfg.trainer.device == "cpu"
    plan = run(cfg)["plan"]  # hetero.dry_run=true: main_gepo's path, prints the plan and returns it
    assert plan in capsys.readouterr().out
    assert "preset:          cpu_toy_megatron" in plan and f"= 2 GPUs, {parallel}" in plan


def test_both_engines_train_the_same_pinned_warm_start(tmp_path):
    """task.warm_start_steps reaches the verl engine's model resolution as it does the embedded
    engine's: one rule (verl_ext.data.task_model.resolve_task_model), the same cached folder."""
    from pathlib import Path

    from recipe.gepo.embedded.tasks import resolve_model_path
    from recipe.gepo.sections import TaskConfig
    from recipe.gepo.verl_engine.runner import resolve_task_files

    cfg = compose_config(
        "+verl_preset=cpu_toy",
        "hetero.engine=verl",
        "task.warm_start_steps=3",
        f"task.cache_dir={tmp_path}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    )
    verl_model = Path(resolve_task_files(cfg).actor_rollout_ref.model.path)
    local_model = Path(resolve_model_path("", TaskConfig.from_omegaconf(cfg.task), seed=int(cfg.hetero.seed)))
    assert verl_model == local_model.resolve() and verl_model.is_relative_to(tmp_path)
    assert '"steps": 3' in (verl_model / "warm_start.json").read_text().replace("'", '"')


@pytest.mark.parametrize("key", ["train_files", "val_files"])
def test_a_missing_data_file_fails_at_start_naming_the_key_and_the_path(tmp_path, key):
    """As a new user would: a wrong parquet path stops the run before verl starts any worker, with
    one line naming the key and the path (not a `datasets` traceback from inside a worker)."""
    good = tmp_path / "good.parquet"
    good.write_bytes(b"PAR1")
    missing = tmp_path / "typo.parquet"
    files = {"train_files": str(good), "val_files": str(good), key: str(missing)}
    cfg = compose_config(
        "+verl_preset=cpu_toy",
        "hetero.engine=verl",
        f"actor_rollout_ref.model.path={tmp_path}",
        f"data.train_files={files['train_files']}",
        f"data.val_files={files['val_files']}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    )
    with pytest.raises(VerlEngineConfigError, match=rf"data.{key}=.*{re.escape(str(missing))}"):
        run(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["data.train_files=/d/train.parquet"], "data.train_files is given but data.val_files is empty"),
        (["data.val_files=/d/val.parquet"], "data.val_files is given but data.train_files is empty"),
        (
            ["data.train_files=/d/train.parquet", "data.val_files=/d/val.parquet", "task.eval_size=64"],
            "task.eval_size=64 shapes the data written from the task: section, but data.train_files",
        ),
        (
            ["data.train_files=/d/train.parquet", "data.val_files=/d/val.parquet", "task.digits=4"],
            "task.digits=4 shapes",
        ),
    ],
)
def test_data_files_come_as_a_pair_and_make_the_task_data_fields_unused(overrides, match):
    """The verl engine writes both data files from the task: section unless both are given: one given
    file would be overwritten, and given files leave the section's data fields unread."""
    with pytest.raises(VerlEngineConfigError, match=match):
        validate(preset_cfg("cpu_toy", "hetero.engine=verl", *overrides))  # cpu_toy: both files "" (from task:)
    validate(
        preset_cfg("cpu_toy", "hetero.engine=verl", "data.train_files=/d/t.parquet", "data.val_files=/d/v.parquet")
    )


@pytest.mark.parametrize(
    "key, value, source",
    [
        ("trainer.v1.sampler.max_off_policy_threshold", 12, "hetero.max_delay=8"),
        ("trainer.v1.sampler.max_off_policy_strategy", "wait", "hetero.stale_policy=drop"),
        ("trainer.v1.trainer_mode", "separate_async", "the verl engine's own trainer"),
    ],
)
def test_a_verl_key_the_engine_derives_is_refused_unless_it_agrees(key, value, source):
    """engine_settings sets these three from hetero:; another value would be overwritten silently."""
    with pytest.raises(
        VerlEngineConfigError,
        match=rf"{re.escape(key)}={value!r}: the verl engine sets it to .* from {re.escape(source)}",
    ):
        validate(preset_cfg("qwen3_1p7b_fsdp", f"{key}={value}"))
    # the value the engine derives passes, and so does the untouched default
    validate(preset_cfg("qwen3_1p7b_fsdp", "hetero.max_delay=11", "trainer.v1.sampler.max_off_policy_threshold=12"))
    validate(preset_cfg("qwen3_1p7b_fsdp"))


def test_a_hub_model_id_reaches_verl_as_it_is(tmp_path):
    """The GPU presets name hub models (Qwen/Qwen3-1.7B): verl's workers load them; a local folder
    is resolved to its absolute path, and the toy task, whose data files are written with the
    model's tokenizer here, needs a local one."""
    from recipe.gepo.verl_engine.runner import resolve_task_files

    files = [f"data.train_files={tmp_path / 't.parquet'}", f"data.val_files={tmp_path / 'v.parquet'}"]
    cfg = preset_cfg("qwen3_1p7b_fsdp", *files, f"trainer.default_local_dir={tmp_path / 'run'}")
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen3-1.7B"
    assert resolve_task_files(cfg).actor_rollout_ref.model.path == "Qwen/Qwen3-1.7B"
    with pytest.raises(ValueError, match="'Qwen/Qwen3-1.7B' is a hub id, not a local folder: the toy task's data"):
        resolve_task_files(preset_cfg("qwen3_1p7b_fsdp", "data.train_files=", "data.val_files="))
    (tmp_path / "Qwen" / "Qwen3-1.7B").mkdir(parents=True)  # a local folder of that name wins
    local = preset_cfg("qwen3_1p7b_fsdp", *files, "actor_rollout_ref.model.path=Qwen/Qwen3-1.7B")
    import os

    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert resolve_task_files(local).actor_rollout_ref.model.path == str(tmp_path / "Qwen" / "Qwen3-1.7B")
    finally:
        os.chdir(here)
