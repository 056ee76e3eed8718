"""HeteroRL's one entry point: ``python -m recipe.gepo.main_gepo key=value ...``.

The config is ``config/gepo_trainer.yaml``: verl's ``ppo_trainer`` defaults, an algorithm preset
(``algorithm_preset=gepo|grpo|...``), a ``hetero:`` section and a ``task:`` section.
``hetero.engine=embedded`` runs the embedded engine (replay or async mode); ``hetero.engine=verl``
hands over to verl's trainer on a GPU cluster.

A config the project refuses (:class:`~recipe.gepo.options.ConfigError`: an unknown key, a bad
value, an option the chosen engine would ignore, a missing model folder, a run directory holding
another config's run) ends the command with one line naming the key and the value, hydra's own
refusals (a key typed without ``+``) too; ``HETERORL_DEBUG=1`` shows the traceback instead. A
finished run is not trained again; a run that trained ends with a few summary lines.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from .options import (
    ConfigError,
    check_known_keys,
    check_value_types,
    default_config,
    unknown_override_error,
    verl_config_searchpath,
)
from .sections import ENGINE_ALIASES, HeteroConfig, TaskConfig

CHECKED_SECTIONS = {"hetero": HeteroConfig, "task": TaskConfig}
"""The config sections whose values' types are checked at start (:func:`.options.check_value_types`)."""

# the verl engine's cluster presets (``--config-dir configs +verl_preset=<name>``)
VERL_PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "verl_preset"


def run_local(cfg: DictConfig) -> dict[str, Any]:
    """The embedded engine: validate everything (:meth:`EngineConfig.from_omegaconf`), then train
    in the mode ``hetero.mode`` names; returns the final metrics. Scripts call this with a config
    composed by hydra's compose API."""
    from .embedded.engine_config import EngineConfig, render_plan
    from .embedded.replay import run_replay
    from .embedded.run_log import MetricLogger
    from .embedded.supervisor import run_async
    from .embedded.tasks import resolve_model_path
    from .lifecycle import NOTHING_TO_TRAIN, check_resume, finished_line, print_notes, run_directory
    from verl_ext.hetero.seeding import seed_process
    from verl_ext.rundir import latest_checkpoint_step, set_aside_latest_checkpoint, set_aside_metrics
    from verl_ext.torch_threads import set_torch_threads

    check_value_types(cfg, CHECKED_SECTIONS)  # hetero.max_delay=abc: named, not a TypeError from a comparison
    engine = EngineConfig.from_omegaconf(cfg)  # every check, before the warm start or any other work
    print_notes(engine.notes)
    if engine.hetero.dry_run:
        print(render_plan(engine))
        return {}
    settings = engine.settings
    done = latest_checkpoint_step(settings.run_dir) if settings.resume_mode == "auto" else 0
    resuming = done > 0
    if resuming:
        check_resume(settings.run_dir, cfg)  # another config's run: refused in one line
        if done >= settings.total_steps:  # nothing to train: say so instead of "resuming" to the end
            print(finished_line(settings.run_dir, done, settings.total_steps))
            return {NOTHING_TO_TRAIN: done}
        print(f"resuming the run at {settings.run_dir} from step {done} of {settings.total_steps}")
    check_model_path(settings.model_path)
    if not resuming:  # a fresh run never appends to another run's metrics or resumes another run's checkpoint
        set_aside_metrics(settings.run_dir)
        set_aside_latest_checkpoint(settings.run_dir)
    seed_process(engine.hetero.seed)
    set_torch_threads(2)  # min(2, cores), unless the user set OMP_NUM_THREADS
    run_mode = {"replay": run_replay, "async": run_async}[engine.hetero.mode]
    with run_directory(settings.run_dir, cfg, engine.notes, resuming):
        model_path = resolve_model_path(settings.model_path, engine.task, engine.hetero.seed)
        print(f"[heterorl] model: {model_path}", flush=True)
        logger = MetricLogger(settings.run_dir, settings, cfg)
        try:
            final = run_mode(engine, model_path, logger)
        finally:
            logger.close()
    from .export import export_at_end

    for line in export_at_end(Path(settings.run_dir), engine.hetero.export_hf):
        print(line, flush=True)
    return final


class ModelPathError(ConfigError, FileNotFoundError):
    """``actor_rollout_ref.model.path`` names no local HF model folder (a FileNotFoundError too)."""


def check_model_path(model_path: str, hub_ids: bool = False) -> None:
    """A given ``actor_rollout_ref.model.path`` must be a local HF model folder (``hub_ids``: an
    ``org/name`` id that is no local path is the verl engine's workers' to load); else
    :class:`ModelPathError` naming it, before the run directory is touched. Empty: the task's model."""
    if not model_path:
        return
    if hub_ids:
        from .verl_engine.launch_plan import is_hub_id

        if is_hub_id(model_path):
            return
    path = Path(model_path).expanduser()
    if not path.is_dir():
        raise ModelPathError(
            f"actor_rollout_ref.model.path={model_path!r}: no such folder here (give a local HF model folder, "
            "or leave it empty for the task's own model)"
        )
    if not (path / "config.json").is_file():
        raise ModelPathError(
            f"actor_rollout_ref.model.path={model_path!r}: not an HF model folder (no config.json); "
            f"a run directory's checkpoints become one with `python -m {__package__}.export RUN_DIR`"
        )


class MissingValueError(ConfigError):
    """A mandatory (``???``) value is still missing in the composed config; the message names
    every such key and how to set it."""


def missing_values(cfg: DictConfig) -> list[str]:
    """Mandatory (``???``) values still missing in the composed ``cfg``, sorted. A key under a
    section switched off with ``enable: false`` is left out: nothing reads it (verl's
    ``reward.reward_model.rollout.name`` while ``reward.reward_model.enable=false``)."""
    missing = []
    for key in OmegaConf.missing_keys(cfg):
        parts = key.split(".")
        parents = (".".join(parts[:i] + ["enable"]) for i in range(1, len(parts)))
        if not any(OmegaConf.select(cfg, p, default=None) is False for p in parents):
            missing.append(key)
    return sorted(missing)


def check_no_missing_values(cfg: DictConfig) -> None:
    """``hetero.engine=verl``: fail before any work, naming every mandatory value still missing
    (verl's ``ppo_trainer`` leaves e.g. ``actor_rollout_ref.rollout.name`` to a cluster preset),
    instead of omegaconf's ``MissingMandatoryValue`` traceback from deep inside validation."""
    missing = missing_values(cfg)
    if not missing:
        return
    presets = sorted(p.stem for p in VERL_PRESET_DIR.glob("*.yaml")) or ["<name>"]
    example = "qwen3_1p7b_fsdp" if "qwen3_1p7b_fsdp" in presets else presets[0]
    raise MissingValueError(
        f"hetero.engine=verl: mandatory value(s) missing ('???') in the composed config: {', '.join(missing)}. "
        "verl's ppo_trainer defaults leave them to a cluster preset: from the repository root pick one "
        f"with `--config-dir configs +verl_preset=<name>` (<name>: {', '.join(presets)}; files in "
        f"configs/verl_preset/), e.g. `python -m {__package__}.main_gepo --config-dir configs "
        f"+verl_preset={example} hetero.engine=verl hetero.dry_run=true`, or set each key on the command "
        f"line ({missing[0]}=...)."
    )


def check_before_imports(cfg: DictConfig) -> None:
    """The checks that need neither torch nor verl, run before either is imported (~10 s here), so
    a typo or a bad value of the project's sections is refused in a few seconds: unknown keys,
    value types, and the ``hetero:`` and ``task:`` sections' own validation."""
    check_known_keys(cfg, default_config())
    check_value_types(cfg, CHECKED_SECTIONS)
    try:
        HeteroConfig.from_omegaconf(cfg.hetero)
        TaskConfig.from_omegaconf(cfg.task)
    except ValueError as err:  # ConfigError is one; the sections' validators raise plain ValueErrors
        raise err if isinstance(err, ConfigError) else ConfigError(str(err)) from err


def run(cfg: DictConfig) -> dict[str, Any]:
    """Dispatch on ``hetero.engine``: the embedded engine, or (after checking that no mandatory
    value is missing) the verl engine."""
    check_before_imports(cfg)
    engine_name = ENGINE_ALIASES.get(cfg.hetero.engine, cfg.hetero.engine)
    if engine_name == "embedded":
        return run_local(cfg)
    if engine_name == "verl":
        check_no_missing_values(cfg)
        check_value_types(cfg, CHECKED_SECTIONS)
        if not cfg.hetero.dry_run:  # a dry run plans for a cluster whose files are not here
            check_model_path(str(cfg.actor_rollout_ref.model.path or ""), hub_ids=True)
        from .verl_engine.runner import run as run_verl

        return run_verl(cfg)
    raise ConfigError(f"hetero.engine={engine_name!r}; expected 'embedded' (alias 'local') or 'verl'")


DEBUG_ENV = "HETERORL_DEBUG"
"""Set to 1 to see the traceback of a refused config (the command line shows one line)."""


def refusal(err: ConfigError) -> str:
    """The command line's text for a refused config: ``error: <message>``."""
    return f"error: {err}"


def run_command(cfg: DictConfig) -> None:
    """:func:`run` for the command line: a refused config exits with one line (:func:`refusal`),
    or, under ``HETERORL_DEBUG=1``, raises with its traceback; a run that trained ends with its
    summary (:func:`~recipe.gepo.run_report.closing_summary`; its wall time counts from the
    command's start when :func:`cli` ran it, imports and composition included)."""
    start = _STARTED if _STARTED is not None else time.monotonic()
    try:
        result = run(cfg)
    except ConfigError as err:  # the key and the value on one line, not a traceback
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        raise SystemExit(refusal(err)) from None
    from .lifecycle import NOTHING_TO_TRAIN
    from .run_report import closing_summary

    if cfg.hetero.dry_run or NOTHING_TO_TRAIN in (result or {}):
        return

    run_dir = Path(str((result or {}).get("run_dir") or cfg.trainer.default_local_dir))
    print("\n".join(closing_summary(run_dir, cfg.trainer.total_training_steps, time.monotonic() - start)))


_STARTED: float | None = None
"""When :func:`cli` started (``time.monotonic()``); None outside the command line."""

HYDRA_FULL_ERROR = "HYDRA_FULL_ERROR"
_RAISE_HYDRA_ERRORS = False
"""True while :func:`cli` has hydra raise its own errors (composition) instead of printing them."""


@hydra.main(config_path=str(Path(__file__).resolve().parent / "config"), config_name="gepo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    if _RAISE_HYDRA_ERRORS:  # composed: errors from here on are the run's, reported as hydra always did
        os.environ.pop(HYDRA_FULL_ERROR, None)
    run_command(cfg)


def _argument(key: str, argv: list[str]) -> str:
    """The override in ``argv`` that set ``key`` (``key=value``, ``+key=value``, ...), or ``key``."""
    for arg in argv:
        if arg.lstrip("+~").split("=", 1)[0] == key:
            return arg.lstrip("+~")
    return key


def hydra_refusal(err: Exception, argv: list[str] | None = None, defaults: Any = None) -> ConfigError:
    """One line for an override hydra refuses before the run starts: an unknown key typed without
    ``+`` gets the closest known key, as with ``+`` (:func:`~recipe.gepo.options.unknown_override_error`);
    an unknown config group option lists the available ones; any other is hydra's text on one line.
    ``argv``: the command line's overrides (default ``sys.argv[1:]``); ``defaults``: a callable giving
    the command's composed defaults (default: ``gepo_trainer``'s)."""
    from hydra.errors import OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    text = str(err)
    if isinstance(err, OverrideParseException):
        reason = next((ln.strip() for ln in err.message.splitlines() if ln.strip() and "^" not in ln), "")
        reason = reason.removeprefix(f"Error parsing override '{err.override}'").strip() or reason
        return ConfigError(
            f"{err.override}: hydra cannot parse this override ({reason}); quote a value with brackets, "
            "commas or spaces, e.g. 'key=[1,2]' (https://hydra.cc/docs/advanced/override_grammar/basic)"
        )
    unknown = re.search(r"Could not override '([^']+)'", text)
    if unknown and isinstance(err.__cause__, (ConfigAttributeError, ConfigKeyError)):
        try:
            from .options import default_config

            return unknown_override_error(unknown.group(1), (defaults or default_config)())
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 -- no defaults to compare with: hydra's own words, on one line
            pass
    group = re.search(r"Could not find '([^'/]+)/([^']+)'", text)
    if group:
        options = re.findall(r"^\t(\S+)$", text, flags=re.M)
        known = f" (available: {', '.join(options)})" if options else ""
        return ConfigError(
            f"{group.group(1)}={group.group(2)}: there is no {group.group(1)}/{group.group(2)}.yaml in the config "
            f"search path{known}"
        )
    present = re.search(r"An item is already at '([^']+)'", text)
    if present:
        key = present.group(1)
        given = _argument(key, sys.argv[1:] if argv is None else argv)
        return ConfigError(f"+{given}: {key} exists already; set it without the +: {given}")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if isinstance(err.__cause__, Exception) and str(err.__cause__).strip():
        lines += [line.strip() for line in str(err.__cause__).splitlines()[:1] if line.strip()]
    return ConfigError(" ".join(lines))


def cli() -> None:
    """``python -m recipe.gepo.main_gepo``: :func:`main`, with hydra's refusals of the command line
    (an unknown key without ``+``, an unknown preset, an override it cannot parse) as one ``error:``
    line like the project's own; ``HETERORL_DEBUG=1`` shows hydra's traceback instead."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    global _RAISE_HYDRA_ERRORS, _STARTED
    _STARTED = time.monotonic()
    _RAISE_HYDRA_ERRORS = HYDRA_FULL_ERROR not in os.environ
    if _RAISE_HYDRA_ERRORS:
        os.environ[HYDRA_FULL_ERROR] = "1"  # hydra raises what it would print; popped once composed
    if not any(arg.lstrip("+").startswith("hydra.searchpath=") for arg in sys.argv[1:]):
        sys.argv.append(f"hydra.searchpath=[{verl_config_searchpath()}]")  # verl's configs, verl not imported
    try:
        main()
    except (HydraException, OmegaConfBaseException) as err:
        if not _RAISE_HYDRA_ERRORS or os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        raise SystemExit(refusal(hydra_refusal(err))) from None
    finally:
        if _RAISE_HYDRA_ERRORS:
            os.environ.pop(HYDRA_FULL_ERROR, None)


if __name__ == "__main__":
    cli()
