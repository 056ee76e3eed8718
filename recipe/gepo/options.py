"""The option contract: which engine and mode honours each option, and the one check that
refuses every non-default value the chosen engine/mode would not honour.

A run executes on one of three *runners*: the embedded engine in replay mode (``replay``) or in
async mode (``async``), or the verl engine (``verl``). HeteroRL's own options are dataclass fields
(``hetero:``, ``task:``, ``verl_engine:``: :mod:`recipe.gepo.sections`), each declared with
:func:`option`, which records the runners that honour it and what the others do instead. verl's own
keys are all honoured by the verl engine; the embedded engine honours :data:`EMBEDDED_VERL_KEYS` and
refuses any other whose value differs from the composed defaults (``gepo_trainer.yaml``).
:func:`check_section` and :func:`check_verl_keys` run once, at start, in both engines' validated
constructors, naming the key, its value, the runner that would ignore it and those that honour it.
A field that only one setting of its section reads (a delay distribution's parameter, a task's
data field) is refused under the others by the section's own validation. docs/architecture.md,
"One contract per option".
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
from typing import Any, Callable, Iterable, Optional

from verl_ext.option_fields import (  # noqa: F401 - the declaration's names, used with the contract's
    ASYNC,
    EMBEDDED,
    EVERYWHERE,
    REPLAY,
    RUNNER_NAMES,
    RUNNERS,
    VERL,
    _instead,
    field_default,
    honoured_by,
    option,
    option_fields,
    runner_of,
)
from verl_ext.rundir import config_leaves


class ConfigError(ValueError):
    """A config the project refuses at start: one line naming the key and the value. The entry
    point (``recipe.gepo.main_gepo``) prints it without a traceback unless ``HETERORL_DEBUG=1``."""


class OptionNotHonoured(ConfigError):
    """A non-default option value that the chosen runner would silently ignore."""


def unknown_key_error(prefix: str, unknown: Iterable[str], known: Iterable[str]) -> ConfigError:
    """The refusal of keys ``unknown`` under ``prefix`` (a dotted section, "" for the top level),
    naming each and the closest known key (``difflib``)."""
    known = sorted(known)
    parts = []
    for name in sorted(unknown):
        key = f"{prefix}.{name}" if prefix else name
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        parts.append(f"{key}" + (f" (did you mean {prefix + '.' if prefix else ''}{close[0]}?)" if close else ""))
    where = f"under {prefix}" if prefix else "at the top level"
    return ConfigError(
        f"unknown key(s) {', '.join(parts)}: not an option {where} "
        f"(known: {', '.join(known[:40])}{', ...' if len(known) > 40 else ''})"
    )


def _refusal(key: str, value: Any, default: Any, runner: str, honoured: Iterable[str], instead: str) -> str:
    where = " or ".join(RUNNER_NAMES[r] for r in honoured) or "no runner"
    why = f" ({instead})" if instead else ""
    return (
        f"{key}={value!r} is not honoured by {RUNNER_NAMES[runner]}{why}; it is honoured by {where}. "
        f"Leave it at its default {default!r} or switch the engine/mode."
    )


POOL_KEYS = frozenset(
    {
        "hetero.transport",
        "hetero.transport_url",
        "hetero.order",
        "hetero.keep_weight_versions",
        "hetero.weights_bf16",
        "hetero.weight_sync",
        "hetero.max_delta_chain",
        "hetero.sampler_skip_stale",
        "hetero.max_queued_groups",
        "hetero.max_buffered_per_sampler",
        "hetero.wait_timeout_s",
        "hetero.trust.sign_records",
        "hetero.trust.enrolment_file",
        "hetero.trust.check_rewards",
        "hetero.trust.verify_fraction",
        "hetero.trust.probation_groups",
        "hetero.trust.hold_unchecked",
        "hetero.trust.logprob_tolerance",
        "hetero.trust.trust_penalty",
        "hetero.trust.trust_recovery",
        "hetero.trust.quarantine_below",
    }
)
"""Async-mode keys the verl engine also honours when remote sampler pools feed it
(``hetero.transport=fs``: recipe/gepo/verl_engine/pool_ingress.py publishes the weights and
admits the groups with them)."""


def check_section(section: Any, prefix: str, runner: str, also_honoured: frozenset[str] = frozenset()) -> None:
    """Refuse (:class:`OptionNotHonoured`) the first field of the config dataclass ``section``
    (``prefix``: its dotted key, e.g. ``hetero``) set to a non-default value that ``runner``
    does not honour; ``also_honoured``: dotted keys ``runner`` honours in this run
    (:data:`POOL_KEYS`)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner={runner!r}; expected one of {RUNNERS}")
    defaults = type(section)()
    for f in dataclasses.fields(section):
        key, value, default = f"{prefix}.{f.name}", getattr(section, f.name), getattr(defaults, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_section(value, key, runner, also_honoured)
            continue
        runners = honoured_by(f)
        if key in also_honoured:
            continue
        if runner not in runners and value != default:
            raise OptionNotHonoured(_refusal(key, value, default, runner, runners, _instead(f, runner)))


# ------------------------------------------------------------------------------ verl's own keys

EMBEDDED_VERL_KEYS = (
    # the model and the batch (recipe/gepo/embedded/run_log.py RunSettings)
    "actor_rollout_ref.model.path",
    "data.train_batch_size",
    "data.max_response_length",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature",
    # the run (RunSettings)
    "trainer.total_training_steps",
    "trainer.default_local_dir",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.resume_mode",
    "trainer.logger",
    "trainer.project_name",
    "trainer.experiment_name",
    # the actor objective: verl's registered losses read the whole actor config, the learner
    # (recipe/gepo/embedded/learner.py) its optimiser keys, verl_ext.algos.objective the rest
    "actor_rollout_ref.actor.policy_loss.*",
    "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high",
    "actor_rollout_ref.actor.clip_ratio_c",
    "actor_rollout_ref.actor.loss_agg_mode",
    "actor_rollout_ref.actor.loss_scale_factor",
    "actor_rollout_ref.actor.entropy_coeff",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type",
    "actor_rollout_ref.actor.grad_clip",
    "actor_rollout_ref.actor.optim.lr",
    "actor_rollout_ref.actor.optim.betas",
    "actor_rollout_ref.actor.optim.weight_decay",
    # advantages (recipe/gepo/embedded/rollout_groups.py) and the decoupled truncated IS
    # (verl_ext.algos.objective.rollout_correction_settings refuses the values it cannot do)
    "algorithm.adv_estimator",
    "algorithm.norm_adv_by_std_in_grpo",
    "algorithm.rollout_correction.*",
)
"""The verl keys the embedded engine acts on (``fnmatch`` patterns over dotted keys). Every other
verl key set away from the composed default is refused by the embedded engine: e.g.
``actor_rollout_ref.rollout.top_p`` / ``top_k`` (its sampler draws from the full softmax at the
temperature, and q is that distribution's), ``actor.ppo_epochs`` / ``ppo_mini_batch_size`` /
``ppo_micro_batch_size_per_gpu`` (one full-batch update per step), ``data.max_prompt_length``,
``data.train_files`` (its data come from the ``task:`` section), the optimiser's schedule."""

PROJECT_SECTIONS = ("hetero", "task", "verl_engine")
"""Top-level sections that are HeteroRL's own dataclasses (checked field by field instead)."""
NOT_OPTIONS = ("hydra", "_target_", "defaults")


def changed_verl_keys(cfg: Any, defaults: Any) -> list[tuple[str, Any, Any]]:
    """``(key, value, default)`` of every verl leaf key of the composed ``cfg`` whose unresolved
    value differs from ``defaults`` (``gepo_trainer.yaml`` composed without overrides). Values
    are compared unresolved, so a key that only follows another by interpolation
    (``rollout.response_length: ${data.max_response_length}``) counts as unchanged."""
    from omegaconf import OmegaConf

    mine = OmegaConf.to_container(cfg, resolve=False)
    base = dict(config_leaves(OmegaConf.to_container(defaults, resolve=False), skip=NOT_OPTIONS))
    changed = []
    for key, value in config_leaves(mine, skip=NOT_OPTIONS):
        if key.split(".")[0] in PROJECT_SECTIONS:
            continue
        default = base.get(key, "<not set>")
        if value != default:
            changed.append((key, value, default))
    return changed


EMBEDDED_NOT_HONOURED = {
    "actor_rollout_ref.actor.policy_loss.group_size": "the embedded engine passes each batch's prompt groups to the loss itself; group_size only forms "
    "groups where none reach the loss (it follows actor_rollout_ref.rollout.n)",
    "algorithm.rollout_correction.loss_type": "it is read only by verl's bypass mode, which the embedded engine "
    "does not run",
    "actor_rollout_ref.actor.policy_loss.rollout_correction": "verl's bypass mode fills it in; the embedded engine "
    "reads algorithm.rollout_correction",
    "algorithm.rollout_correction.bypass_mode": "the embedded engine runs verl's decoupled mode only; without "
    "rollout correction its losses already use the sampler's q",
}
"""verl keys under a pattern of :data:`EMBEDDED_VERL_KEYS` that the embedded engine nevertheless
does not read, each with what it does instead (quoted in the refusal)."""


def embedded_honours(key: str) -> bool:
    """Whether the embedded engine acts on the verl key ``key``."""
    if key in EMBEDDED_NOT_HONOURED:
        return False
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in EMBEDDED_VERL_KEYS)


def check_verl_keys(cfg: Any, defaults: Any, runner: str) -> None:
    """Every runner: refuse a verl key that verl does not know (:func:`check_known_keys`). The
    embedded engine (``runner`` replay or async): refuse every verl key changed from the defaults
    that it does not act on, naming all of them. The verl engine honours its own keys."""
    check_known_keys(cfg, defaults)
    if runner == VERL:
        return
    refused = [(k, v, d) for k, v, d in changed_verl_keys(cfg, defaults) if not embedded_honours(k)]
    if len(refused) == 1 and refused[0][0] in EMBEDDED_NOT_HONOURED:
        key, value, default = refused[0]
        raise OptionNotHonoured(_refusal(key, value, default, runner, (VERL,), EMBEDDED_NOT_HONOURED[key]))
    if refused:
        listed = "; ".join(f"{k}={v!r} (default {d!r})" for k, v, d in refused[:8])
        more = f" and {len(refused) - 8} more" if len(refused) > 8 else ""
        raise OptionNotHonoured(
            f"verl key(s) not honoured by {RUNNER_NAMES[runner]}: {listed}{more}. The embedded engine acts on the "
            f"verl keys listed in recipe/gepo/options.py EMBEDDED_VERL_KEYS; these are honoured by "
            f"{RUNNER_NAMES[VERL]}. Leave them at their defaults or use the verl engine."
        )


# ------------------------------------------------------------------------------ unknown keys


def _schema_fields(node: dict) -> set[str]:
    """The field names of the verl (or project) dataclass a config node's ``_target_`` names."""
    import importlib

    target = node.get("_target_")
    if not isinstance(target, str) or "." not in target:
        return set()
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return set()
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


FREE_FORM_SECTIONS = ("ray_kwargs", "reward.custom_reward_function")
"""verl sections whose keys are passed on as keyword arguments (``ray.init``, a custom reward
function's ``reward_kwargs``): any key is accepted there, as in the sections empty in the defaults."""


def unknown_verl_keys(cfg: Any, defaults: Any) -> list[tuple[str, str, set[str]]]:
    """``(key, section, known names there)`` for every verl leaf key of ``cfg`` that verl does
    not know: a key added (``+section.key=...``) under a section of the composed defaults
    (``defaults``: ``gepo_trainer.yaml`` composed without overrides) that does not have it, and
    whose dataclass (the section's ``_target_``, in the defaults or as composed: a preset may
    switch it, e.g. to Megatron's) has no such field either. Free-form sections take any key:
    those empty or null in the defaults (``model.override_config``, ``engine_kwargs.vllm``, ...)
    and :data:`FREE_FORM_SECTIONS`."""
    from omegaconf import OmegaConf

    base = OmegaConf.to_container(defaults, resolve=False)
    mine = OmegaConf.to_container(cfg, resolve=False)
    unknown = []
    for key, _ in config_leaves(mine, skip=NOT_OPTIONS):
        parts = key.split(".")
        if parts[0] in PROJECT_SECTIONS:
            continue
        node: Any = base
        for depth, part in enumerate(parts):
            if isinstance(node, dict) and part in node:
                node = node[part]
                continue
            section = ".".join(parts[:depth])
            free = any(section == f or section.startswith(f + ".") for f in FREE_FORM_SECTIONS)
            if isinstance(node, dict) and node and not free:
                composed = OmegaConf.select(cfg, section, default=None) if section else None
                composed = OmegaConf.to_container(composed, resolve=False) if OmegaConf.is_dict(composed) else {}
                names = {k for k in node if k not in NOT_OPTIONS} | _schema_fields(node) | _schema_fields(composed)
                if part not in names:
                    unknown.append((key, section, names))
            break
    return unknown


def check_known_keys(cfg: Any, defaults: Any) -> None:
    """Refuse (:class:`ConfigError`) verl keys verl does not know (:func:`unknown_verl_keys`),
    naming each and the closest known key."""
    unknown = unknown_verl_keys(cfg, defaults)
    if unknown:
        key, section, names = unknown[0]
        name = key[len(section) + 1 :] if section else key
        raise unknown_key_error(section, [name.split(".")[0]], names)


def unknown_override_error(key: str, defaults: Any) -> ConfigError:
    """The refusal of ``key`` (dotted), set on the command line without ``+`` where the composed
    ``defaults`` have no such key (hydra refuses it before the run starts): the same words as
    :func:`check_known_keys` gives the ``+`` form, naming the closest known key of the deepest
    section that exists (its YAML keys and its dataclass's fields)."""
    from omegaconf import OmegaConf

    node: Any = OmegaConf.to_container(defaults, resolve=False)
    parts = key.split(".")
    depth = 0
    while depth < len(parts) - 1 and isinstance(node, dict) and isinstance(node.get(parts[depth]), dict):
        node = node[parts[depth]]
        depth += 1
    names = {k for k in node if k not in NOT_OPTIONS} | _schema_fields(node)
    if parts[depth] in names:  # a key below a value: hetero.max_delay.x
        leaf = ".".join(parts[: depth + 1])
        return ConfigError(f"{key}: unknown key, {leaf} is a value, not a section")
    return unknown_key_error(".".join(parts[:depth]), [parts[depth]], names)


# ------------------------------------------------------------------------------ value types

VERL_INT_KEYS = (
    "trainer.total_training_steps",
    "trainer.save_freq",
    "trainer.test_freq",
    "data.train_batch_size",
    "data.max_response_length",
    "actor_rollout_ref.rollout.n",
)
"""verl keys both engines read as integers (``trainer.total_training_steps`` may be null: verl's
trainer then counts epochs): another type is refused at start, not met deep inside training."""


def _type_error(key: str, value: Any, hint: Any) -> Optional[str]:
    """Why ``value`` does not fit the type hint ``hint`` (int, float, bool, str or Optional of one),
    or None when it fits or the hint is another type (not checked here)."""
    import types
    import typing

    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }.get(hint)
    if ok is None or ok(value):
        return None
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "text"}[hint]
    return f"{key}={value!r}: expected {expected}"


def check_value_types(cfg: Any, sections: dict[str, type]) -> None:
    """Refuse (:class:`ConfigError`, naming the key and the value) a value of the wrong type: in the
    ``sections`` (name -> config dataclass, e.g. ``{"hetero": HeteroConfig}``: their field types,
    nested sections included) and in :data:`VERL_INT_KEYS` (``trainer.total_training_steps=abc``),
    before anything else reads it."""
    import typing

    from omegaconf import OmegaConf

    def walk(cls: Any, node: Any, prefix: str) -> None:
        if not isinstance(node, dict):
            return
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in node:
                continue
            value, hint = node[f.name], hints.get(f.name)
            if dataclasses.is_dataclass(hint):
                walk(hint, value, f"{prefix}.{f.name}")
                continue
            why = _type_error(f"{prefix}.{f.name}", value, hint)
            if why:
                raise ConfigError(why)

    for name, cls in sections.items():
        node = OmegaConf.select(cfg, name, default=None)
        if node is not None:
            walk(cls, OmegaConf.to_container(node, resolve=True), name)
    for key in VERL_INT_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None or key != "trainer.total_training_steps":
            why = _type_error(key, value, int)
            if why:
                raise ConfigError(why)


# ------------------------------------------------------------------------------ dependent options


@dataclasses.dataclass(frozen=True)
class Dependency:
    """An option read only in some settings of another key: ``key`` set away from its default is
    refused (or, with ``report``, reported) while ``inert(get)`` is true, where ``get(dotted key)``
    returns the composed config's resolved value (``get(key, resolve=False)``: as written)."""

    key: str
    on: str
    """The key whose value decides whether ``key`` is read (named in the refusal with its value)."""
    inert: Callable[[Callable[..., Any]], bool]
    why: str
    """What leaves ``key`` without effect (quoted in the refusal)."""
    runners: tuple[str, ...] = RUNNERS
    report: str = ""
    """Why the study keeps it (an algorithm preset, a script that passes it to every run): then it is
    reported in one line at start and in report.md instead of refused."""


_ACTOR = "actor_rollout_ref.actor"
_LOSS_MODE = f"{_ACTOR}.policy_loss.loss_mode"
_RC = "algorithm.rollout_correction"
# the loss modes that read the clip range (verl's core_algos, verl_ext.algos.registry)
_CLIP_READERS = (
    "vanilla",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "clip_cov",
    "geo_mean",
    "cispo",
    "gepo",
    "gepo_adaptive",
    "gepo_tr",
    "gepo_tc",
    "eqp",
    "delta_l",
)
_DUAL_CLIP_READERS = ("vanilla", "dppo_tv", "dppo_kl")


def _loss_reads(*modes: str) -> Callable[[Callable[[str], Any]], bool]:
    return lambda get: get(_LOSS_MODE) not in modes


def _shipped_warm_start(get: Callable[[str], Any]) -> bool:
    """The toy task's model is a warm start shipped with the package (``task.cache_dir`` unread)."""
    if get("task.name") != "toy_addition" or get("actor_rollout_ref.model.path"):
        return False
    from verl_ext.data.toy.checkpoints import PINNED_WARM_STARTS, WARM_START_INFO, warm_start_folder

    folder = warm_start_folder(
        ".",
        digits=int(get("task.digits")),
        steps=get("task.warm_start_steps"),
        seed=int(get("hetero.seed")),
        answer_format=str(get("task.answer_format")),
    )
    return (PINNED_WARM_STARTS / folder.name / WARM_START_INFO).is_file()


def _project_name_unread(get: Callable[..., Any]) -> bool:
    """No tracking backend of the embedded engine is told ``trainer.project_name``: console prints
    no names and TensorBoard writes to ``$TENSORBOARD_DIR`` (default ``<run dir>/tensorboard``,
    ``recipe.gepo.embedded.run_log.MetricLogger``); nor does the run dir interpolate it."""
    backends = get("trainer.logger") or []
    backends = [backends] if isinstance(backends, str) else list(backends)
    return all(b in ("console", "tensorboard") for b in backends) and "project_name" not in str(
        get("trainer.default_local_dir", resolve=False)
    )


DEPENDENCIES: tuple[Dependency, ...] = (
    Dependency(
        f"{_ACTOR}.clip_ratio",
        f"{_ACTOR}.clip_ratio_low",
        lambda get: (
            (get(f"{_ACTOR}.clip_ratio_low") is not None and get(f"{_ACTOR}.clip_ratio_high") is not None)
            or get(_LOSS_MODE) not in _CLIP_READERS
        ),
        "clip_ratio is only the fallback of clip_ratio_low / clip_ratio_high, and both are set "
        "(or the loss reads no clip range)",
        report="the algorithm presets gmpo and gspo set it",
    ),
    Dependency(f"{_ACTOR}.clip_ratio_low", _LOSS_MODE, _loss_reads(*_CLIP_READERS), "this loss reads no clip range"),
    Dependency(f"{_ACTOR}.clip_ratio_high", _LOSS_MODE, _loss_reads(*_CLIP_READERS), "this loss reads no clip range"),
    Dependency(
        f"{_ACTOR}.clip_ratio_c",
        _LOSS_MODE,
        _loss_reads(*_DUAL_CLIP_READERS),
        f"the dual clip is read only by loss_mode {' / '.join(_DUAL_CLIP_READERS)}",
    ),
    *(
        Dependency(
            f"{_ACTOR}.policy_loss.{name}", _LOSS_MODE, _loss_reads("clip_cov"), "read only by loss_mode clip_cov"
        )
        for name in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")
    ),
    *(
        Dependency(f"{_ACTOR}.policy_loss.{name}", _LOSS_MODE, _loss_reads("kl_cov"), "read only by loss_mode kl_cov")
        for name in ("kl_cov_ratio", "ppo_kl_coef")
    ),
    Dependency(f"{_ACTOR}.policy_loss.dro_beta", _LOSS_MODE, _loss_reads("dro"), "read only by loss_mode dro"),
    *(
        Dependency(f"{_ACTOR}.{name}", _LOSS_MODE, _loss_reads("sapo"), "read only by loss_mode sapo")
        for name in ("tau_pos", "tau_neg")
    ),
    Dependency(
        f"{_ACTOR}.loss_scale_factor",
        f"{_ACTOR}.loss_agg_mode",
        lambda get: get(f"{_ACTOR}.loss_agg_mode") != "seq-mean-token-sum-norm" and get(_LOSS_MODE) != "delta_l",
        "read only by loss_agg_mode=seq-mean-token-sum-norm and loss_mode delta_l",
    ),
    *(
        Dependency(
            f"{_ACTOR}.{name}",
            f"{_ACTOR}.use_kl_loss",
            lambda get: not get(f"{_ACTOR}.use_kl_loss"),
            "the KL-to-reference term is off",
        )
        for name in ("kl_loss_coef", "kl_loss_type")
    ),
    *(
        Dependency(
            f"{_RC}.{name}",
            f"{_RC}.rollout_is",
            lambda get: get(f"{_RC}.rollout_is") in (None, "", "null"),
            "no IS weight is computed",
        )
        for name in ("rollout_is_threshold", "rollout_is_batch_normalize")
    ),
    Dependency(
        f"{_RC}.rollout_rs_threshold",
        f"{_RC}.rollout_rs",
        lambda get: get(f"{_RC}.rollout_rs") in (None, "", "null"),
        "no rejection sampling",
    ),
    Dependency(
        "trainer.project_name",
        "trainer.logger",
        _project_name_unread,
        "only a tracking backend other than console and tensorboard (file, wandb, mlflow, ...) is told the "
        "project name",
        runners=EMBEDDED,
    ),
    Dependency(
        "task.cache_dir",
        "task.warm_start_steps",
        _shipped_warm_start,
        "the toy model is the warm start shipped with the package (task.digits, answer_format, "
        "warm_start_steps and hetero.seed at the shipped settings), read from the package",
        runners=EMBEDDED,
        report="the study's scripts pass it to every run, shipped warm start or not",
    ),
    Dependency(
        "hetero.max_delta_chain",
        "hetero.weight_sync",
        lambda get: get("hetero.weight_sync") != "delta",
        "samplers apply deltas only under weight_sync=delta",
    ),
    Dependency(
        "hetero.trust.divergence_window",
        "hetero.trust.max_divergence",
        lambda get: not get("hetero.trust.max_divergence"),
        "the divergence bound is off",
    ),
    Dependency(
        "hetero.trust.checkable_sampling",
        "hetero.trust.verify_fraction",
        lambda get: not get("hetero.trust.verify_fraction"),
        "no group is re-scored, so no token is checked",
    ),
)
"""Every option read only in some settings of another key, in one place (checked by
:func:`check_dependencies`). The project's own loss options are checked by their config
(``verl_ext.algos.config.LOSS_SPECIFIC_OPTIONS``), a delay model's and a task's fields by their
section (``recipe.gepo.sections``)."""


def inert_options(cfg: Any, defaults: Any, runner: str) -> list[tuple[Dependency, Any, Any, Any]]:
    """``(dependency, value, default, value of dependency.on)`` for every option of
    :data:`DEPENDENCIES` that ``runner`` would read, set away from its default in ``cfg`` while the
    key it depends on leaves it without effect."""
    from omegaconf import OmegaConf

    def getter(config: Any) -> Callable[..., Any]:
        def get(key: str, resolve: bool = True) -> Any:
            if resolve:
                return OmegaConf.select(config, key, default=None)
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(config, parent, default=None) if parent else config
            return node._get_node(leaf)._value() if OmegaConf.is_dict(node) and leaf in node else None

        return get

    get, get_default = getter(cfg), getter(defaults)
    found = []
    for dep in DEPENDENCIES:
        if runner not in dep.runners:
            continue
        value, default = get(dep.key), get_default(dep.key)
        if value != default and dep.inert(get):
            found.append((dep, value, default, get(dep.on)))
    return found


def _inert_text(dep: Dependency, value: Any, default: Any, on_value: Any) -> str:
    return f"{dep.key}={value!r} has no effect with {dep.on}={on_value!r} ({dep.why}); its default is {default!r}"


def check_dependencies(cfg: Any, defaults: Any, runner: str) -> list[str]:
    """Refuse (:class:`ConfigError`, naming both keys) the first option of :data:`DEPENDENCIES` set
    away from its default while the key it depends on leaves it without effect; returns one line
    for each such option the study's presets keep (``report``), for the run to print and report."""
    notes = []
    for dep, value, default, on_value in inert_options(cfg, defaults, runner):
        if not dep.report:
            raise ConfigError(
                _inert_text(dep, value, default, on_value) + f": leave it at its default or change {dep.on}"
            )
        notes.append(_inert_text(dep, value, default, on_value) + f" (not refused: {dep.report})")
    return notes


def default_config(config_dir: Optional[str] = None) -> Any:
    """``gepo_trainer.yaml`` composed with no overrides: the defaults verl keys are compared with.
    Inside a running hydra app its own search path is used (``--config-dir`` included); outside one
    the composition is made once per folder and shared, read-only (composing takes ~0.5 s)."""
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose(config_name="gepo_trainer", overrides=[f"hydra.searchpath=[{verl_config_searchpath()}]"])
    from pathlib import Path

    return _composed_defaults(config_dir or str(Path(__file__).resolve().parent / "config"))


def verl_config_searchpath() -> str:
    """verl's packaged config folder as a ``hydra.searchpath`` entry (``file://``), found without
    importing verl: ``pkg://verl.trainer.config`` imports verl (~10 s of torch and tensordict here),
    so every check of a command line would wait for it."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return "pkg://verl.trainer.config"
    return f"file://{Path(list(spec.submodule_search_locations)[0]) / 'trainer' / 'config'}"


@functools.lru_cache(maxsize=4)
def _composed_defaults(folder: str) -> Any:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=folder, version_base=None):
        defaults = compose(config_name="gepo_trainer", overrides=[f"hydra.searchpath=[{verl_config_searchpath()}]"])
    OmegaConf.set_readonly(defaults, True)  # shared by every caller: comparing only
    return defaults
