"""Validate a composed config for the verl engine and describe what it would run, on any CPU machine.

:func:`build_plan` reads the config, builds verl's config dataclasses (``omega_conf_to_dataclass``
of actor, rollout, algorithm), runs verl's ``validate_config``, checks what verl's separate_async
trainer would only assert after reserving GPUs, applies the bypass guard and resolves the presets;
:func:`dry_run` prints the plan. The optional ``verl_engine:`` section
(:class:`~recipe.gepo.sections.VerlEngineConfig`) holds the few settings only this engine has; the
rest comes from verl's own keys and ``hetero:``. Topology: learners on verl's trainer pool
(``trainer.nnodes`` x ``n_gpus_per_node``), samplers on its standalone rollout pool
(``actor_rollout_ref.rollout.nnodes`` x ``n_gpus_per_node``, ``hybrid_engine=false``): a star. The
bypass guard: verl 0.9.1's async trainers and ``RayPPOTrainer`` call ``apply_bypass_mode`` whenever
``rollout_correction.bypass_mode`` is true, silently replacing ``policy_loss.loss_mode``, so
:func:`check_no_forced_bypass` refuses another loss with ``bypass_mode=true`` at start (the engine's
``old_log_prob=sampler`` is what bypass mode is for), and the trainer re-checks before every update.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from ..sections import HeteroConfig, TaskConfig, VerlEngineConfig, changed_fields
from ..export import plan_line as export_plan_line
from ..options import POOL_KEYS, VERL, ConfigError, check_dependencies, check_section, check_verl_keys, default_config
from .batch_rules import verl_threshold

# ---------------------------------------------------------------------------- names in verl's registries

RECIPE_PACKAGE = __package__.rpartition(".")[0]
"""This recipe's package: ``recipe.gepo``, or a copy's own name (``recipe.mygepo``)."""

TRAINER_NAME = (
    "hetero_separate_async"
    if RECIPE_PACKAGE == "recipe.gepo"
    else f"hetero_separate_async_{RECIPE_PACKAGE.replace('.', '_')}"
)
"""Name under which this recipe's ``verl_engine/trainer.py`` registers its trainer with verl's v1
trainer registry; ``run`` sets ``trainer.v1.trainer_mode`` to it. verl's registry is one per
process and refuses a second class under a taken name, so a copied recipe registers under a name
of its own (``hetero_separate_async_recipe_mygepo``): both recipes can be imported in one process,
and each run names the trainer of the recipe it was started from."""

VERL_MODE_SECTION = "separate_async"
"""verl's ``trainer.v1.<section>`` whose settings the trainer inherits (it extends verl's
separate_async trainer: learners and samplers on separate GPU pools, the star topology)."""


# ---------------------------------------------------------------------------- the bypass guard


class ForcedLossModeError(ValueError):
    """The config would let verl replace the configured policy loss."""


def requested_loss_mode(cfg: Any) -> str:
    return str(cfg.actor_rollout_ref.actor.policy_loss.get("loss_mode", "vanilla"))


def check_no_forced_bypass(cfg: Any) -> None:
    """Raise :class:`ForcedLossModeError` if verl could force ``loss_mode=bypass_mode`` on this run.

    Fires when ``algorithm.rollout_correction.bypass_mode`` is true and the requested loss is not
    ``bypass_mode`` itself, and when the legacy trainer (``trainer.use_v1=false``) is selected.
    """
    loss_mode = requested_loss_mode(cfg)
    rollout_corr = cfg.algorithm.get("rollout_correction", None)
    bypass = bool(rollout_corr is not None and rollout_corr.get("bypass_mode", False))
    if bypass and loss_mode != "bypass_mode":
        raise ForcedLossModeError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r} with "
            "algorithm.rollout_correction.bypass_mode=true: verl's async trainers replace the loss "
            "with 'bypass_mode' (apply_bypass_mode), so this run would not train with "
            f"{loss_mode!r}. Set algorithm.rollout_correction.bypass_mode=false; to train on the "
            "sampler's log-probs use verl_engine.old_log_prob=sampler (the default)."
        )
    if not cfg.trainer.get("use_v1", True):
        raise ForcedLossModeError(
            "trainer.use_v1=false selects verl's legacy RayPPOTrainer, which the verl engine does not "
            "extend (it would not carry GEPO's group denominators); set trainer.use_v1=true."
        )


def check_loss_mode_unchanged(expected: str, actor_cfg: Any) -> None:
    """Runtime half of the guard: the loss mode in the live config is still the one asked for."""
    current = str(actor_cfg.policy_loss.get("loss_mode", "vanilla"))
    if current != expected:
        raise ForcedLossModeError(
            f"policy_loss.loss_mode changed from {expected!r} to {current!r} during the run "
            "(something called verl's apply_bypass_mode?); refusing to train with a loss that was not asked for"
        )


# ---------------------------------------------------------------------------- validation and plan

ROLLOUT_BACKENDS = ("vllm", "sglang", "hf_cpu")  # hf_cpu: verl_ext/cpu (CPU machines)


class VerlEngineConfigError(ConfigError):
    """The composed config cannot run on the verl engine; the message names the key."""


@dataclass
class Validated:
    """What :func:`validate` resolved from the config."""

    cfg: DictConfig
    hetero: HeteroConfig
    engine: VerlEngineConfig
    actor: Any  # verl ActorConfig
    rollout: Any  # verl RolloutConfig
    algorithm: Any  # verl AlgoConfig
    use_reference_policy: bool
    use_critic: bool
    notes: list[str] = field(default_factory=list)
    """Options without effect that are reported, not refused (:func:`recipe.gepo.options.check_dependencies`)."""


def _fail(message: str) -> None:
    raise VerlEngineConfigError(message)


def _learner_parallelism(cfg: DictConfig) -> dict[str, int | str]:
    actor = cfg.actor_rollout_ref.actor
    n_gpus = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    if actor.strategy == "megatron":
        mc = actor.megatron
        tp, pp, cp = (
            int(mc.tensor_model_parallel_size),
            int(mc.pipeline_model_parallel_size),
            int(mc.context_parallel_size),
        )
        if n_gpus % (tp * pp * cp):
            _fail(
                f"learner GPUs trainer.nnodes x trainer.n_gpus_per_node = {n_gpus} not divisible by "
                f"megatron TP x PP x CP = {tp} x {pp} x {cp}"
            )
        return {"backend": "megatron", "gpus": n_gpus, "tp": tp, "pp": pp, "cp": cp, "dp": n_gpus // (tp * pp * cp)}
    fsdp_size = int(actor.get("fsdp_config", {}).get("fsdp_size", -1) or -1)
    return {
        "backend": str(actor.strategy),
        "gpus": n_gpus,
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "dp": n_gpus,
        "fsdp_size": fsdp_size,
    }


def _sampler_parallelism(cfg: DictConfig) -> dict[str, int]:
    r = cfg.actor_rollout_ref.rollout
    n_gpus = int(r.nnodes) * int(r.n_gpus_per_node)
    tp, dp, pp = int(r.tensor_model_parallel_size), int(r.data_parallel_size), int(r.pipeline_model_parallel_size)
    per_replica = tp * dp * pp
    if n_gpus % per_replica:
        _fail(
            f"sampler GPUs actor_rollout_ref.rollout.nnodes x n_gpus_per_node = {n_gpus} not divisible by "
            f"rollout TP x DP x PP = {tp} x {dp} x {pp}"
        )
    return {"gpus": n_gpus, "tp": tp, "dp": dp, "pp": pp, "replicas": n_gpus // per_replica}


def check_task_data(cfg: DictConfig, task) -> None:
    """``data.train_files`` / ``val_files``: both empty (written from the ``task:`` section) or both
    given (then the section's data fields, :attr:`TaskConfig.DATA_FIELDS`, would be ignored: refused)."""
    train, val = cfg.data.get("train_files", None), cfg.data.get("val_files", None)
    if bool(train) != bool(val):
        given, missing = ("data.train_files", "data.val_files") if train else ("data.val_files", "data.train_files")
        _fail(
            f"{given} is given but {missing} is empty: give both, or neither (then both are written "
            f"from the task: section and a given one would be overwritten)"
        )
    if train:
        for key, value, default in changed_fields(task, task.DATA_FIELDS):
            _fail(
                f"task.{key}={value!r} shapes the data written from the task: section, but data.train_files "
                f"and data.val_files are given and used as they are: leave task.{key} at its default "
                f"{default!r} (a verl_preset may have set it) or the data files empty"
            )


def check_data_files(cfg: DictConfig) -> None:
    """Before training (not in a dry run: a cluster's files are not on the laptop that plans it):
    every local ``data.train_files`` / ``data.val_files`` entry must be a readable file, else
    :class:`VerlEngineConfigError` naming the key and the path (instead of a ``datasets``
    traceback from inside verl's workers). Remote URLs (``hdfs://``, ``s3://``, ...) are verl's
    to read."""
    import os
    from pathlib import Path

    for key in ("train_files", "val_files"):
        value = cfg.data.get(key, None)
        paths = [value] if isinstance(value, str) else list(value or [])
        if not paths or paths == [""]:
            _fail(f"data.{key} is empty: name the parquet file(s) to train / validate on")
        for path in map(str, paths):
            if "://" in path:
                continue
            local = Path(os.path.expanduser(path))
            if not local.is_file() or not os.access(local, os.R_OK):
                _fail(f"data.{key}={path!r}: no readable file at {local.resolve()}")


def check_megatron_stack(cfg: DictConfig) -> None:
    """Before training with Megatron learners (not in a dry run: the cluster's packages are not the
    planning laptop's): the settings the installed megatron-core / bridge can run, else
    :class:`VerlEngineConfigError` naming the key, instead of a failure inside verl's workers.

    - ``vanilla_mbridge=false`` makes verl import megatron-bridge (Python >= 3.12, megatron-core
      >= 0.17); the project's ``megatron`` extra installs mbridge instead.
    - ``use_distributed_optimizer=false`` fails in ``verl/utils/megatron_utils.py:827`` with
      megatron-core 0.16.1 (``param_data`` is None; seen here in bf16 and float32 -- the code path
      is not device-specific).
    """
    import importlib.util

    from verl_ext.cpu.megatron import installed_versions

    for section in ("actor", "ref"):
        if cfg.actor_rollout_ref[section].get("strategy", None) != "megatron":
            continue
        key = f"actor_rollout_ref.{section}.megatron"
        mc = cfg.actor_rollout_ref[section].megatron
        if not mc.get("vanilla_mbridge", False) and importlib.util.find_spec("megatron.bridge") is None:
            _fail(
                f"{key}.vanilla_mbridge=false needs megatron-bridge (Python >= 3.12), which is not installed; "
                f"the project's megatron extra installs mbridge: set {key}.vanilla_mbridge=true"
            )
        core = installed_versions()["megatron-core"]
        if core is None:
            _fail(f"{key}: the Megatron engine needs megatron-core (`make install` installs the megatron extra)")
        if section == "actor" and not mc.get("use_distributed_optimizer", True) and core == "0.16.1":
            _fail(
                f"{key}.use_distributed_optimizer=false fails in verl 0.9.1 with megatron-core {core} "
                "(verl/utils/megatron_utils.py:827); keep the distributed optimizer"
            )


def validate(cfg: DictConfig) -> Validated:
    """Check everything the verl engine needs; raise :class:`~recipe.gepo.options.ConfigError`
    (:class:`VerlEngineConfigError`, or the sections' and verl's own ValueError as one) naming the
    first bad key: an unknown key (``+trainer.total_training_step``) before verl's dataclasses see it."""
    defaults = default_config()
    check_verl_keys(cfg, defaults, VERL)  # unknown keys
    try:
        validated = _validate(cfg)
    except ConfigError:
        raise
    except ValueError as err:
        raise ConfigError(str(err)) from err
    validated.notes = check_dependencies(cfg, defaults, VERL)
    return validated


def _validate(cfg: DictConfig) -> Validated:
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    hetero = HeteroConfig.from_omegaconf(cfg.hetero)
    engine = VerlEngineConfig.from_config(cfg)
    if hetero.engine != "verl":
        _fail(f"hetero.engine={hetero.engine!r}: the verl engine's plan needs hetero.engine=verl")
    if hetero.mode != "async":
        _fail(
            f"hetero.mode={hetero.mode!r}: the verl engine runs real samplers (vLLM) asynchronously; "
            "replay emulation is the local engine's (hetero.engine=embedded)"
        )
    check_no_forced_bypass(cfg)
    check_section(hetero, "hetero", VERL, POOL_KEYS if hetero.transport == "fs" else frozenset())
    if hetero.transport == "fs":
        _check_pools(cfg, hetero)
    task = TaskConfig.from_omegaconf(cfg.task)
    check_section(task, "task", VERL)
    task.check_files()  # a math task's task.dataset_path is read when data.train_files is empty
    check_task_data(cfg, task)
    check_derived_keys(cfg, hetero)

    r = cfg.actor_rollout_ref.rollout
    if r.name not in ROLLOUT_BACKENDS:
        _fail(f"actor_rollout_ref.rollout.name={r.name!r}; the verl engine's samplers need one of {ROLLOUT_BACKENDS}")
    if engine.old_log_prob == "sampler" and not r.calculate_log_probs:
        _fail(
            "verl_engine.old_log_prob=sampler needs the samplers' log-probs: set "
            "actor_rollout_ref.rollout.calculate_log_probs=true"
        )
    rc = cfg.algorithm.get("rollout_correction", None)
    for key in ("rollout_is", "rollout_rs"):
        if engine.old_log_prob == "sampler" and rc is not None and rc.get(key, None) not in (None, "", "null"):
            # verl's correction weights and rejection use exp(old_log_probs - rollout_log_probs): with q
            # as old_log_probs they are all 1 and the option would do nothing
            _fail(
                f"algorithm.rollout_correction.{key}={rc.get(key)!r} corrects between the learner's old "
                "log-probs and the sampler's; with verl_engine.old_log_prob=sampler they are the same numbers. "
                f"Set verl_engine.old_log_prob=recompute, or algorithm.rollout_correction.{key}=null"
            )
    if int(r.nnodes) < 1 or int(r.n_gpus_per_node) < 1:
        _fail(
            f"actor_rollout_ref.rollout.nnodes={r.nnodes}, n_gpus_per_node={r.n_gpus_per_node}: the sampler "
            "pool (standalone rollout) needs at least one node and one GPU"
        )
    if cfg.actor_rollout_ref.get("hybrid_engine", True):
        _fail(
            "actor_rollout_ref.hybrid_engine=true would also serve rollouts from the learners' GPUs with "
            "undelayed weights; the verl engine needs hybrid_engine=false (samplers only on the rollout pool)"
        )
    if r.checkpoint_engine.backend == "naive":
        _fail(
            "actor_rollout_ref.rollout.checkpoint_engine.backend=naive cannot reach a separate sampler pool; "
            "use nccl (or nixl, mooncake; ray_mailbox on a CPU machine)"
        )
    mode = cfg.trainer.v1.get(VERL_MODE_SECTION, {})
    sync_step = int(mode.get("parameter_sync_step", 1))
    mini = int(cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
    if int(cfg.data.train_batch_size) != sync_step * mini:
        _fail(
            f"data.train_batch_size={cfg.data.train_batch_size} must equal "
            f"trainer.v1.{VERL_MODE_SECTION}.parameter_sync_step ({sync_step}) x "
            f"actor_rollout_ref.actor.ppo_mini_batch_size ({mini})"
        )
    if mode.get("hybrid_rollout", {}).get("enable_switch", False):
        _fail(f"trainer.v1.{VERL_MODE_SECTION}.hybrid_rollout.enable_switch=true: needs hybrid_engine; set it false")
    _learner_parallelism(cfg)
    _sampler_parallelism(cfg)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    algorithm = omega_conf_to_dataclass(cfg.algorithm)
    with warnings.catch_warnings():  # verl warns that GRPO-style estimators run without a critic: the plan says so
        warnings.filterwarnings("ignore", message="Disabled critic")
        use_ref, use_critic = need_reference_policy(cfg), need_critic(cfg)
    validate_config(cfg, use_reference_policy=use_ref, use_critic=use_critic)

    return Validated(cfg, hetero, engine, actor, rollout, algorithm, use_ref, use_critic)


POOL_MANAGER = "verl_engine.pool_ingress.PoolAgentLoopManager"
"""The agent loop manager of a run fed by remote pools, below this recipe's package."""


def _check_pools(cfg: DictConfig, hetero: HeteroConfig) -> None:
    """What a learner fed by remote sampler pools (``hetero.transport=fs``) needs at start."""
    trust = hetero.trust
    if trust.sign_records and not trust.enrolment_file:
        _fail(
            "hetero.transport=fs with hetero.trust.sign_records=true needs hetero.trust.enrolment_file: the "
            "public keys of the pools (python -m verl_ext.trust.signing keygen / enrol; README, "
            '"Samplers in another data centre")'
        )
    if trust.enrolment_file and not Path(trust.enrolment_file).is_file():
        _fail(f"hetero.trust.enrolment_file={trust.enrolment_file!r}: no such file")
    dtype = str(cfg.actor_rollout_ref.rollout.dtype)
    if trust.verify_fraction > 0 and dtype in ("bfloat16", "bf16"):
        # a bf16 pool's q against the ingress's fp32 re-score needs bounds measured on the run's own
        # model (issue 48: no table for every model), which the verl engine cannot calibrate yet
        _fail(
            f"actor_rollout_ref.rollout.dtype={dtype} with hetero.trust.verify_fraction={trust.verify_fraction}: "
            "re-scoring bf16 pools needs bf16 bounds calibrated on the run's model, not built for the verl "
            "engine yet; run the pools in float32, or set hetero.trust.verify_fraction=0 (signatures, replays "
            "and rewards are still checked)"
        )
    manager = OmegaConf.select(cfg, "actor_rollout_ref.rollout.agent.agent_loop_manager_class")
    if manager and not str(manager).endswith(POOL_MANAGER):
        _fail(
            f"actor_rollout_ref.rollout.agent.agent_loop_manager_class={manager!r}: with hetero.transport=fs the "
            "verl engine fills its training batches from the pools itself; leave it unset"
        )


def _preset_name(cfg: DictConfig) -> str:
    name = cfg.get("verl_engine", {}).get("preset", "") if cfg.get("verl_engine", None) is not None else ""
    return str(name) or "(none: gepo_trainer.yaml + overrides)"


def delay_unit(hetero: HeteroConfig) -> str:
    """Unit of ``hetero.delay``: seconds in async mode (the only mode of the verl engine), steps in replay."""
    return "seconds" if hetero.mode == "async" else "steps"


def render(v: Validated) -> str:
    """The plan as text."""
    cfg, hetero, engine = v.cfg, v.hetero, v.engine
    actor_cfg, rollout_cfg = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    learner, sampler = _learner_parallelism(cfg), _sampler_parallelism(cfg)
    pl = actor_cfg.policy_loss
    n = int(rollout_cfg.n)
    if learner["backend"] == "megatron":
        learner_par = f"Megatron TP={learner['tp']} PP={learner['pp']} CP={learner['cp']} DP={learner['dp']}"
    else:
        learner_par = f"{learner['backend'].upper()} (data parallel {learner['dp']}, TP=1 PP=1)"
    ref = "reference model on the learner GPUs" if v.use_reference_policy else "no reference model (KL-to-ref off)"
    lines = [
        "HeteroRL verl engine plan (dry run: nothing started, no GPU touched)",
        f"  preset:          {_preset_name(cfg)}",
        f"  model:           {_model_where(str(cfg.actor_rollout_ref.model.path or ''))}",
        f"  trainer:         verl v1 trainer_mode={TRAINER_NAME} (extends {VERL_MODE_SECTION})",
        "  roles:",
        f"    learner:       {cfg.trainer.nnodes} node(s) x {cfg.trainer.n_gpus_per_node} GPU = {learner['gpus']} GPUs, "
        f"{learner_par}",
        f"    samplers:      {rollout_cfg.nnodes} node(s) x {rollout_cfg.n_gpus_per_node} GPU = {sampler['gpus']} GPUs, "
        f"{rollout_cfg.name} TP={sampler['tp']} DP={sampler['dp']} PP={sampler['pp']}, {sampler['replicas']} replicas",
        f"    reference:     {ref}",
        "    critic:        "
        + ("a value model (GAE)" if v.use_critic else f"none ({cfg.algorithm.adv_estimator} needs no value model)"),
        f"    topology:      star: learners <-> {sampler['replicas']} sampler replicas "
        f"(weights: checkpoint engine {rollout_cfg.checkpoint_engine.backend})",
        "    placement:     "
        + (
            "learner ranks only on Ray nodes offering heterorl_learner_node, samplers only on nodes offering "
            "heterorl_sampler_node (verl_engine.node_resources)"
            if v.engine.node_resources
            else "wherever each pool's GPUs fit (verl_engine.node_resources=false)"
        ),
        f"  batch:           {cfg.data.train_batch_size} prompts x G={n} = {int(cfg.data.train_batch_size) * n} "
        f"responses/step, mini-batch {actor_cfg.ppo_mini_batch_size} prompts, lr {actor_cfg.optim.lr}, "
        f"T={rollout_cfg.temperature}, prompt <= {cfg.data.max_prompt_length}, "
        f"response <= {cfg.data.max_response_length} tokens",
        f"  loss:            loss_mode={requested_loss_mode(cfg)}, agg={actor_cfg.loss_agg_mode}, "
        f"clip=[{actor_cfg.clip_ratio_low}, {actor_cfg.clip_ratio_high}], "
        f"adv={cfg.algorithm.adv_estimator} (std-normalised: {cfg.algorithm.get('norm_adv_by_std_in_grpo', True)}), "
        f"sampler-KL coef {pl.get('sampler_kl_coef', 0.0)}",
        f"  q (old_log_prob): {engine.old_log_prob}"
        + (" (vLLM's rollout_log_probs)" if engine.old_log_prob == "sampler" else " (learner recomputes)"),
        f"  GEPO denominator: driver-side over whole uid groups, seq_reduction={pl.get('seq_reduction', 'mean')}",
        f"  delay (weights): {hetero.delay.describe(delay_unit(hetero), hetero.seed)}",
        f"  staleness bound: {hetero.max_delay} versions, exact over generating weight versions, "
        f"stale_policy={hetero.stale_policy} (verl max_off_policy_threshold={verl_threshold(hetero.max_delay)})",
        f"  weight snapshots: up to {hetero.keep_weight_versions} delayed versions on the learners' CPU memory",
        f"  bypass guard:    algorithm.rollout_correction.bypass_mode="
        f"{bool(cfg.algorithm.rollout_correction.get('bypass_mode', False))} (ok)",
        f"  data:            train {_where(cfg.data.train_files)}, validation {_where(cfg.data.val_files)}",
        f"  steps:           {cfg.trainer.total_training_steps or f'{cfg.trainer.total_epochs} epoch(s)'}, "
        f"checkpoint every {cfg.trainer.save_freq}, validation every {cfg.trainer.test_freq} (<= 0: none)",
        f"  run directory:   {cfg.trainer.default_local_dir}; at the end "
        + (
            export_plan_line(hetero.export_hf)
            if int(cfg.trainer.save_freq) > 0 or hetero.export_hf == "none"
            else "no checkpoint to export (trainer.save_freq <= 0)"
        ),
    ]
    if hetero.transport == "fs":
        trust = hetero.trust
        checks = ["signatures of enrolled keys" if trust.sign_records else "unsigned records", "replays"]
        checks += ["rewards against the learner's answers"] if trust.check_rewards else []
        rescore = "q is not re-scored (hetero.trust.verify_fraction=0)"
        if trust.verify_fraction > 0:
            rescore = (
                f"q re-scored in fp32 on each pool's first {trust.probation_groups} groups, then {trust.verify_fraction:g} "
                f"of them (the ingress's own model copy){'; unchecked groups held for a later check' if trust.hold_unchecked else ''}"
            )
        lines += [
            f"  sampler pools:   training groups from remote pools through {hetero.transport_url or '<run dir>/exchange'} "
            "(python -m recipe.gepo.pool); the local replica serves validation only",
            f"    checks:        {', '.join(checks)}; {rescore}",
            f"    flow:          per-pool quota {hetero.max_buffered_per_sampler or (hetero.max_delay + 1) * int(cfg.data.train_batch_size)} "
            f"groups; pools wait at {hetero.max_queued_groups or 'no'} queued groups"
            f"{' and past the bound' if hetero.sampler_skip_stale else ''}",
            f"    weights out:   every version, {'bf16' if hetero.weights_bf16 else 'as trained'}"
            f"{', XOR deltas' if hetero.weight_sync == 'delta' else ''}, SHA-256, from the actor's rank 0 in the background",
        ]
    return "\n".join(lines)


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(model_path: str) -> bool:
    """A model path that is no local file or folder but reads as a model hub id (``org/name``, e.g.
    the GPU presets' ``Qwen/Qwen3-1.7B``): verl's workers load it from the hub themselves."""
    return bool(HUB_ID.fullmatch(model_path)) and not Path(model_path).exists()


def _where(paths: Any) -> str:
    """Paths as the plan shows them: a local path missing on this machine is marked (a dry run
    plans for a cluster, whose files need not be here)."""
    from omegaconf import ListConfig

    items = list(paths) if isinstance(paths, (list, tuple, ListConfig)) else [paths]
    shown = []
    for item in map(str, items):
        if not item:
            shown.append("the task's own (task: section; written under task.cache_dir at start)")
        elif "://" in item or Path(item).expanduser().exists():
            shown.append(item)
        else:
            shown.append(f"{item} (not found here; fine if the cluster has it)")
    return ", ".join(shown)


def _model_where(model_path: str) -> str:
    return model_path if is_hub_id(model_path) else _where(model_path)


def build_plan(cfg: DictConfig) -> str:
    """Validate ``cfg`` (the full composed config) and return the plan text."""
    return render(validate(cfg))


def derived_keys(hetero: HeteroConfig) -> dict[str, Any]:
    """verl's keys that :func:`engine_settings` sets from ``hetero:`` (and their values)."""
    keys = {
        "trainer.v1.trainer_mode": TRAINER_NAME,
        "trainer.v1.sampler.max_off_policy_threshold": verl_threshold(hetero.max_delay),
        "trainer.v1.sampler.max_off_policy_strategy": hetero.stale_policy,
    }
    if hetero.transport == "fs":  # remote pools fill the training batches
        keys["actor_rollout_ref.rollout.agent.agent_loop_manager_class"] = f"{_recipe_package()}.{POOL_MANAGER}"
    return keys


def _recipe_package() -> str:
    """This recipe's package (``recipe.gepo``, or a copy's): the manager is looked up by name."""
    return __package__.rsplit(".", 1)[0]


def check_derived_keys(cfg: DictConfig, hetero: HeteroConfig) -> None:
    """A derived key (:func:`derived_keys`) left at its composed default or set to the derived value
    passes; any other value would be overwritten by :func:`engine_settings`: refused, naming the
    ``hetero`` key that sets it."""
    from ..options import default_config

    defaults = default_config()
    source = {
        "trainer.v1.trainer_mode": "the verl engine's own trainer",
        "trainer.v1.sampler.max_off_policy_threshold": f"hetero.max_delay={hetero.max_delay}",
        "trainer.v1.sampler.max_off_policy_strategy": f"hetero.stale_policy={hetero.stale_policy}",
        "actor_rollout_ref.rollout.agent.agent_loop_manager_class": "hetero.transport=fs",
    }
    for key, derived in derived_keys(hetero).items():
        value = OmegaConf.select(cfg, key)
        if value not in (derived, OmegaConf.select(defaults, key)):
            _fail(
                f"{key}={value!r}: the verl engine sets it to {derived!r} from {source[key]}; "
                f"leave it unset and set the hetero key instead"
            )


def dry_run(cfg: DictConfig) -> None:
    """Validate ``cfg``, print the plan and return. Touches no GPU, starts nothing."""
    print(build_plan(cfg))


def engine_settings(cfg: DictConfig, ray_address: str | None = None) -> DictConfig:
    """A copy of ``cfg`` with the verl keys the engine derives from ``hetero:`` set:
    the trainer mode, and verl's submission-step threshold implied by the exact bound.

    ``ray_address`` (``RAY_ADDRESS``: verl's ``ray.init()`` joins a running cluster, as
    ``scripts/slurm/verl_star.sbatch`` makes it): the cluster's resources are the nodes', so the
    local-start sizes ``ray_kwargs.ray_init.num_cpus`` / ``num_gpus`` (the CPU presets' logical
    GPUs) are dropped -- Ray refuses them when joining."""
    hetero = HeteroConfig.from_omegaconf(cfg.hetero)
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    with open_dict(out):
        for key, value in derived_keys(hetero).items():
            OmegaConf.update(out, key, value, force_add=True)
        ray_init = out.get("ray_kwargs", {}).get("ray_init", None)
        if ray_address and ray_init is not None:
            for key in ("num_cpus", "num_gpus"):
                ray_init.pop(key, None)
    return out
