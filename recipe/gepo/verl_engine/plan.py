"""Validate a composed config for the verl engine and describe what it would run.

Everything here runs on a CPU machine: it reads the config, builds verl's config dataclasses
(``omega_conf_to_dataclass`` of actor, rollout, algorithm), runs verl's own ``validate_config``,
checks what verl's separate_async trainer would only assert after reserving GPUs, applies the
bypass guard, and resolves the presets. :func:`dry_run` prints the plan; :func:`build_plan`
returns it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from recipe.gepo.hetero_config import HeteroConfig
from recipe.gepo.verl_engine.engine_config import TRAINER_NAME, VERL_MODE_SECTION, VerlEngineConfig
from recipe.gepo.verl_engine.guard import check_no_forced_bypass, requested_loss_mode
from recipe.gepo.verl_engine.staleness import verl_threshold

ROLLOUT_BACKENDS = ("vllm", "sglang", "hf_cpu")  # hf_cpu: verl_ext/cpu (CPU machines)


class VerlEngineConfigError(ValueError):
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


def _fail(message: str) -> None:
    raise VerlEngineConfigError(message)


def _learner_parallelism(cfg: DictConfig) -> dict[str, int | str]:
    actor = cfg.actor_rollout_ref.actor
    n_gpus = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    if actor.strategy == "megatron":
        mc = actor.megatron
        tp, pp, cp = int(mc.tensor_model_parallel_size), int(mc.pipeline_model_parallel_size), int(mc.context_parallel_size)
        if n_gpus % (tp * pp * cp):
            _fail(
                f"learner GPUs trainer.nnodes x trainer.n_gpus_per_node = {n_gpus} not divisible by "
                f"megatron TP x PP x CP = {tp} x {pp} x {cp}"
            )
        return {"backend": "megatron", "gpus": n_gpus, "tp": tp, "pp": pp, "cp": cp, "dp": n_gpus // (tp * pp * cp)}
    fsdp_size = int(actor.get("fsdp_config", {}).get("fsdp_size", -1) or -1)
    return {"backend": str(actor.strategy), "gpus": n_gpus, "tp": 1, "pp": 1, "cp": 1, "dp": n_gpus, "fsdp_size": fsdp_size}


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


# hetero: keys of the embedded engine that the verl engine has no counterpart for -> what to use
# instead. Set to anything but their default they are refused, not silently ignored.
EMBEDDED_ONLY_KEYS = {
    "num_samplers": "the sampler pool is actor_rollout_ref.rollout.nnodes x n_gpus_per_node (/ TP x DP x PP)",
    "wait_timeout_s": "verl's wait strategy has no timeout",
    "order": "verl's replay buffer decides the order",
    "transport_url": "weights and rollouts stay inside one Ray cluster",
    "sampler_speed_factors": "the rollout replicas receive each version together",
    "delay_rollouts": "only the weight path is delayed",
    "sampler_skip_stale": "verl's replicas always generate",
    "max_queued_groups": "verl's replay buffer bounds itself (trainer.v1.sampler)",
    "max_nonfinite_steps": "verl does not skip non-finite steps",
    "learner_cpus": "verl places workers through Ray resources",
    "sampler_cpus": "verl places workers through Ray resources",
    "system_cpus": "verl places workers through Ray resources",
    "weights_bf16": "verl's checkpoint engine decides the wire dtype",
    "ray_address": "set ray_kwargs.ray_init.address",
    "learner_ray_resources": "verl's resource pools place the workers",
    "sampler_ray_resources": "verl's resource pools place the workers",
    "weight_sync": "verl's checkpoint engine sends every version whole",
    "max_delta_chain": "verl's checkpoint engine sends every version whole",
}


def _check_embedded_only(hetero: HeteroConfig) -> None:
    default = HeteroConfig()
    for key, instead in EMBEDDED_ONLY_KEYS.items():
        value = getattr(hetero, key)
        if value != getattr(default, key):
            _fail(f"hetero.{key}={value!r} is an embedded-engine option (hetero.engine=local); with hetero.engine=verl {instead}")


def validate(cfg: DictConfig) -> Validated:
    """Check everything the verl engine needs; raise :class:`VerlEngineConfigError` (or verl's /
    HeteroConfig's own ValueError) naming the first bad key."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    hetero = HeteroConfig.from_omegaconf(cfg.hetero)
    engine = VerlEngineConfig.from_config(cfg)
    if hetero.engine != "verl":
        _fail(f"hetero.engine={hetero.engine!r}: the verl engine's plan needs hetero.engine=verl")
    if hetero.mode != "async":
        _fail(
            f"hetero.mode={hetero.mode!r}: the verl engine runs real samplers (vLLM) asynchronously; "
            "replay emulation is the local engine's (hetero.engine=local)"
        )
    if hetero.transport != "ray":
        _fail(
            f"hetero.transport={hetero.transport!r}: the verl engine moves weights with verl's checkpoint "
            "engine and rollouts through TransferQueue inside one Ray cluster; samplers in another cluster "
            "exchanging through an fsspec URL run with hetero.engine=local (docs/scale-out.md)"
        )
    check_no_forced_bypass(cfg)
    _check_embedded_only(hetero)

    r = cfg.actor_rollout_ref.rollout
    if r.name not in ROLLOUT_BACKENDS:
        _fail(f"actor_rollout_ref.rollout.name={r.name!r}; the verl engine's samplers need one of {ROLLOUT_BACKENDS}")
    if engine.old_log_prob == "sampler" and not r.calculate_log_probs:
        _fail(
            "verl_engine.old_log_prob=sampler needs the samplers' log-probs: set "
            "actor_rollout_ref.rollout.calculate_log_probs=true"
        )
    rc = cfg.algorithm.get("rollout_correction", None)
    if engine.old_log_prob == "sampler" and rc is not None and rc.get("rollout_is", None) not in (None, "", "null"):
        # verl's correction weights are exp(old_log_probs - rollout_log_probs): with q as old_log_probs
        # they are all 1 and the option would do nothing
        _fail(
            f"algorithm.rollout_correction.rollout_is={rc.rollout_is!r} corrects between the learner's old "
            "log-probs and the sampler's; with verl_engine.old_log_prob=sampler they are the same numbers. "
            "Set verl_engine.old_log_prob=recompute, or algorithm.rollout_correction.rollout_is=null"
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
    use_ref, use_critic = need_reference_policy(cfg), need_critic(cfg)
    validate_config(cfg, use_reference_policy=use_ref, use_critic=use_critic)

    return Validated(cfg, hetero, engine, actor, rollout, algorithm, use_ref, use_critic)


def _preset_name(cfg: DictConfig) -> str:
    name = cfg.get("verl_engine", {}).get("preset", "") if cfg.get("verl_engine", None) is not None else ""
    return str(name) or "(none: gepo_trainer.yaml + overrides)"


def delay_unit(hetero: HeteroConfig) -> str:
    """Unit of ``hetero.delay``: seconds in async mode (the only mode of the verl engine), steps in replay."""
    return "seconds" if hetero.mode == "async" else "steps"


def _delay_line(hetero: HeteroConfig) -> str:
    d = hetero.delay
    model = d.build()
    params = ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in model.params().items()
    ) or "-"
    if d.dist == "none":
        return "none (samplers get every version at the next step end)"
    s = model.summary(n_samples=20_000, seed=hetero.seed)
    return (
        f"{d.dist}({params}) in {delay_unit(hetero)}: median {s.median:.1f}, mean {s.mean:.1f}, p95 {s.p95:.1f}, "
        f"max {s.max:.1f}"
    )


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
        f"  model:           {cfg.actor_rollout_ref.model.path}",
        f"  trainer:         verl v1 trainer_mode={TRAINER_NAME} (extends {VERL_MODE_SECTION})",
        "  roles:",
        f"    learner:       {cfg.trainer.nnodes} node(s) x {cfg.trainer.n_gpus_per_node} GPU = {learner['gpus']} GPUs, "
        f"{learner_par}",
        f"    samplers:      {rollout_cfg.nnodes} node(s) x {rollout_cfg.n_gpus_per_node} GPU = {sampler['gpus']} GPUs, "
        f"{rollout_cfg.name} TP={sampler['tp']} DP={sampler['dp']} PP={sampler['pp']}, {sampler['replicas']} replicas",
        f"    reference:     {ref}",
        f"    topology:      star: learners <-> {sampler['replicas']} sampler replicas "
        f"(weights: checkpoint engine {rollout_cfg.checkpoint_engine.backend})",
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
        f"  delay (weights): {_delay_line(hetero)}",
        f"  staleness bound: {hetero.max_delay} versions, exact over generating weight versions, "
        f"stale_policy={hetero.stale_policy} (verl max_off_policy_threshold={verl_threshold(hetero.max_delay)})",
        f"  weight snapshots: up to {hetero.keep_weight_versions} delayed versions on the learners' CPU memory",
        f"  bypass guard:    algorithm.rollout_correction.bypass_mode="
        f"{bool(cfg.algorithm.rollout_correction.get('bypass_mode', False))} (ok)",
    ]
    return "\n".join(lines)


def build_plan(cfg: DictConfig) -> str:
    """Validate ``cfg`` (the full composed config) and return the plan text."""
    return render(validate(cfg))


def dry_run(cfg: DictConfig) -> None:
    """Validate ``cfg``, print the plan and return. Touches no GPU, starts nothing."""
    print(build_plan(cfg))


def engine_settings(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` with the verl keys the engine derives from ``hetero:`` set:
    the trainer mode, and verl's submission-step threshold implied by the exact bound."""
    hetero = HeteroConfig.from_omegaconf(cfg.hetero)
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
    with open_dict(out):
        out.trainer.v1.trainer_mode = TRAINER_NAME
        out.trainer.v1.sampler.max_off_policy_threshold = verl_threshold(hetero.max_delay)
        out.trainer.v1.sampler.max_off_policy_strategy = hetero.stale_policy
    return out
