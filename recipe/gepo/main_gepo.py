"""HeteroRL's one entry point: ``python -m recipe.gepo.main_gepo key=value ...``.

The config is ``config/gepo_trainer.yaml``: verl's ``ppo_trainer`` defaults, an algorithm preset
(``algorithm_preset=gepo|grpo|...``), a ``hetero:`` section and a ``task:`` section.
``hetero.engine=embedded`` runs the embedded engine (replay or async mode); ``hetero.engine=verl``
hands over to verl's trainer on a GPU cluster.

A config the project refuses (:class:`~recipe.gepo.options.ConfigError`: an unknown key, a bad
value, an option the chosen engine would ignore) ends the command with one line naming the key and
the value; ``HETERORL_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from .options import ConfigError
from .sections import ENGINE_ALIASES

# the verl engine's cluster presets (``--config-dir configs +verl_preset=<name>``)
VERL_PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "verl_preset"


def run_local(cfg: DictConfig) -> dict[str, Any]:
    """The embedded engine: validate everything (:meth:`EngineConfig.from_omegaconf`), then train
    in the mode ``hetero.mode`` names; returns the final metrics. Scripts call this with a config
    composed by hydra's compose API."""
    from .embedded.engine_config import EngineConfig
    from .embedded.replay import run_replay
    from .embedded.run_log import MetricLogger
    from .embedded.supervisor import run_async
    from .embedded.tasks import resolve_model_path
    from .lifecycle import print_notes, run_directory
    from verl_ext.hetero.seeding import seed_process
    from verl_ext.rundir import latest_checkpoint_step, set_aside_latest_checkpoint, set_aside_metrics
    from verl_ext.torch_threads import set_torch_threads

    engine = EngineConfig.from_omegaconf(cfg)  # every check, before the warm start or any other work
    print_notes(engine.notes)
    if engine.hetero.dry_run:
        print(OmegaConf.to_yaml(cfg.hetero))
        return {}
    settings = engine.settings
    resuming = settings.resume_mode == "auto" and latest_checkpoint_step(settings.run_dir) > 0
    if not resuming:  # a fresh run never appends to another run's metrics or resumes another run's checkpoint
        set_aside_metrics(settings.run_dir)
        set_aside_latest_checkpoint(settings.run_dir)
    seed_process(engine.hetero.seed)
    set_torch_threads(2)  # min(2, cores), unless the user set OMP_NUM_THREADS
    run_mode = {"replay": run_replay, "async": run_async}[engine.hetero.mode]
    with run_directory(settings.run_dir, cfg, engine.notes, resuming):
        model_path = resolve_model_path(settings.model_path, engine.task, engine.hetero.seed)
        logger = MetricLogger(settings.run_dir, settings, cfg)
        try:
            return run_mode(engine, model_path, logger)
        finally:
            logger.close()


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


def run(cfg: DictConfig) -> dict[str, Any]:
    """Dispatch on ``hetero.engine``: the embedded engine, or (after checking that no mandatory
    value is missing) the verl engine."""
    engine_name = ENGINE_ALIASES.get(cfg.hetero.engine, cfg.hetero.engine)
    if engine_name == "embedded":
        return run_local(cfg)
    if engine_name == "verl":
        check_no_missing_values(cfg)
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
    or, under ``HETERORL_DEBUG=1``, raises with its traceback."""
    try:
        run(cfg)
    except ConfigError as err:  # the key and the value on one line, not a traceback
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        raise SystemExit(refusal(err)) from None


@hydra.main(config_path="config", config_name="gepo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    run_command(cfg)


if __name__ == "__main__":
    main()
