"""The option contract: which engine and mode honours each option, and the one check that
refuses every non-default value the chosen engine/mode would not honour.

A run executes in one of three ways (a *runner*): the embedded engine in replay mode
(``replay``), the embedded engine in async mode (``async``) or the verl engine (``verl``).

- HeteroRL's own options are dataclass fields (``hetero:`` -> :class:`~recipe.gepo.sections.HeteroConfig`,
  ``task:`` -> :class:`~recipe.gepo.sections.TaskConfig`, ``verl_engine:`` ->
  :class:`~recipe.gepo.sections.VerlEngineConfig`). Each is declared with :func:`option`,
  which records, where the field is declared, the runners that honour it and what the others do
  instead.
- verl's own keys (``actor_rollout_ref``, ``data``, ``trainer``, ``algorithm``, ...) are all
  honoured by the verl engine; the embedded engine honours the ones in :data:`EMBEDDED_VERL_KEYS`.
  Any other verl key whose value differs from the composed defaults (``gepo_trainer.yaml``) is
  refused by the embedded engine.

:func:`check_section` (the project's sections) and :func:`check_verl_keys` (verl's keys) are called
once, at start, by both engines' validated constructors; they name the key, its value, the runner
that would ignore it and the runners that honour it. Within a section, a field that only one
setting reads (a delay distribution's parameter, a task's data field) is refused under the others
by the section's own validation (``recipe.gepo.sections``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Iterable, Iterator, Optional

from verl_ext.rundir import config_leaves

REPLAY, ASYNC, VERL = "replay", "async", "verl"
RUNNERS = (REPLAY, ASYNC, VERL)
EMBEDDED = (REPLAY, ASYNC)
EVERYWHERE = RUNNERS

RUNNER_NAMES = {
    REPLAY: "hetero.engine=local hetero.mode=replay",
    ASYNC: "hetero.engine=local hetero.mode=async",
    VERL: "hetero.engine=verl",
}


def runner_of(engine: str, mode: str) -> str:
    """The runner of ``hetero.engine`` / ``hetero.mode`` (the verl engine is always async)."""
    return VERL if engine == "verl" else mode


def option(
    default: Any = dataclasses.MISSING,
    *,
    honoured_by: Iterable[str],
    factory: Optional[Callable[[], Any]] = None,
    instead: str | dict[str, str] = "",
) -> Any:
    """A config dataclass field that declares which runners honour it.

    Args:
        default: the field's default (or ``factory`` for mutable defaults).
        honoured_by: the runners (:data:`REPLAY`, :data:`ASYNC`, :data:`VERL`) that act on it.
        instead: what the other runners do instead (one text, or one per runner), quoted in the
            error that refuses a non-default value there.
    """
    runners = tuple(honoured_by)
    unknown = [r for r in runners if r not in RUNNERS]
    if unknown or not runners:
        raise ValueError(f"option honoured_by={runners!r}: expected a non-empty subset of {RUNNERS}")
    metadata = {"honoured_by": runners, "instead": instead}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def honoured_by(field: dataclasses.Field) -> tuple[str, ...]:
    """The runners that honour ``field`` (every runner for a field declared without :func:`option`)."""
    return tuple(field.metadata.get("honoured_by", RUNNERS))


def _instead(field: dataclasses.Field, runner: str) -> str:
    instead = field.metadata.get("instead", "")
    return instead.get(runner, "") if isinstance(instead, dict) else instead


def field_default(field: dataclasses.Field) -> Any:
    """A dataclass field's default (its factory's product for a mutable one; MISSING if none)."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def option_fields(cls: type, prefix: str) -> Iterator[tuple[str, dataclasses.Field, type]]:
    """``(dotted key, field, owner class)`` for every field of the config dataclass ``cls`` and of
    the config dataclasses nested in it (``hetero.delay.*``)."""
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}"
        default = field_default(f)
        if dataclasses.is_dataclass(default) and not isinstance(default, type):
            yield from option_fields(type(default), key)
        else:
            yield key, f, cls


class OptionNotHonoured(ValueError):
    """A non-default option value that the chosen runner would silently ignore."""


def _refusal(key: str, value: Any, default: Any, runner: str, honoured: Iterable[str], instead: str) -> str:
    where = " or ".join(RUNNER_NAMES[r] for r in honoured) or "no runner"
    why = f" ({instead})" if instead else ""
    return (f"{key}={value!r} is not honoured by {RUNNER_NAMES[runner]}{why}; it is honoured by {where}. "
            f"Leave it at its default {default!r} or switch the engine/mode.")  # fmt: skip


def check_section(section: Any, prefix: str, runner: str) -> None:
    """Refuse (:class:`OptionNotHonoured`) the first field of the config dataclass ``section``
    (``prefix``: its dotted key, e.g. ``hetero``) set to a non-default value that ``runner``
    does not honour."""
    if runner not in RUNNERS:
        raise ValueError(f"runner={runner!r}; expected one of {RUNNERS}")
    defaults = type(section)()
    for f in dataclasses.fields(section):
        key, value, default = f"{prefix}.{f.name}", getattr(section, f.name), getattr(defaults, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_section(value, key, runner)
            continue
        runners = honoured_by(f)
        if runner not in runners and value != default:
            raise OptionNotHonoured(_refusal(key, value, default, runner, runners, _instead(f, runner)))


# ------------------------------------------------------------------------------ verl's own keys

EMBEDDED_VERL_KEYS = (
    # the model and the batch (recipe/gepo/embedded/run_utils.py RunSettings)
    "actor_rollout_ref.model.path",
    "data.train_batch_size",
    "data.max_response_length",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.temperature",
    # the run (RunSettings)
    "trainer.total_training_steps", "trainer.default_local_dir", "trainer.save_freq", "trainer.test_freq",
    "trainer.resume_mode", "trainer.logger", "trainer.project_name", "trainer.experiment_name",
    # the actor objective: verl's registered losses read the whole actor config, the learner
    # (recipe/gepo/embedded/learner.py) its optimiser keys, verl_ext.loss_bridge the rest
    "actor_rollout_ref.actor.policy_loss.*",
    "actor_rollout_ref.actor.clip_ratio", "actor_rollout_ref.actor.clip_ratio_low",
    "actor_rollout_ref.actor.clip_ratio_high", "actor_rollout_ref.actor.clip_ratio_c",
    "actor_rollout_ref.actor.loss_agg_mode", "actor_rollout_ref.actor.loss_scale_factor",
    "actor_rollout_ref.actor.entropy_coeff", "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef", "actor_rollout_ref.actor.kl_loss_type",
    "actor_rollout_ref.actor.grad_clip",
    "actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.optim.betas",
    "actor_rollout_ref.actor.optim.weight_decay",
    # advantages (recipe/gepo/embedded/rollout.py) and the decoupled truncated IS
    # (verl_ext.loss_bridge.rollout_correction_settings refuses the values it cannot do)
    "algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo",
    "algorithm.rollout_correction.*",
)  # fmt: skip
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


def embedded_honours(key: str) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in EMBEDDED_VERL_KEYS)


def check_verl_keys(cfg: Any, defaults: Any, runner: str) -> None:
    """The embedded engine (``runner`` replay or async): refuse every verl key changed from the
    defaults that it does not act on, naming all of them. The verl engine honours its own keys."""
    if runner == VERL:
        return
    refused = [(k, v, d) for k, v, d in changed_verl_keys(cfg, defaults) if not embedded_honours(k)]
    if refused:
        listed = "; ".join(f"{k}={v!r} (default {d!r})" for k, v, d in refused[:8])
        more = f" and {len(refused) - 8} more" if len(refused) > 8 else ""
        raise OptionNotHonoured(
            f"verl key(s) not honoured by {RUNNER_NAMES[runner]}: {listed}{more}. The embedded engine acts on the "
            f"verl keys listed in recipe/gepo/options.py EMBEDDED_VERL_KEYS; these are honoured by "
            f"{RUNNER_NAMES[VERL]}. Leave them at their defaults or use the verl engine."
        )


def default_config(config_dir: Optional[str] = None) -> Any:
    """``gepo_trainer.yaml`` composed with no overrides: the defaults verl keys are compared with.
    Inside a running hydra app its own search path is used (``--config-dir`` included)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose(config_name="gepo_trainer")
    from pathlib import Path

    folder = config_dir or str(Path(__file__).resolve().parent / "config")
    with initialize_config_dir(config_dir=folder, version_base=None):
        return compose(config_name="gepo_trainer")
