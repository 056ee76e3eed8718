"""What every embedded-engine run shares: the run directory, metric logging, checkpoints, settings
read from verl's config keys. The files' format is :mod:`verl_ext.rundir`'s.

Metrics go to ``<run_dir>/metrics.jsonl`` always (one JSON object per line, with ``step``) and
to verl's ``Tracking`` backends listed in ``trainer.logger`` (console, tensorboard, wandb, ...);
TensorBoard events go to ``<run_dir>/tensorboard/`` unless ``TENSORBOARD_DIR`` is set.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

# the run directory's format has one owner; the drivers import these names from here
from verl_ext.rundir import MetricsWriter, load_latest_checkpoint, save_checkpoint, truncate_metrics

__all__ = ["RunSettings", "MetricLogger", "save_checkpoint", "load_latest_checkpoint", "truncate_metrics"]


@dataclass
class RunSettings:
    """The verl keys the embedded engine reads (same meaning as in verl's PPO trainer)."""

    model_path: str
    """``actor_rollout_ref.model.path``: a local HF folder (the toy task warm-starts one if empty)."""
    prompts_per_step: int
    """``data.train_batch_size``: prompts (groups) per learner step."""
    total_steps: int
    """``trainer.total_training_steps``."""
    group_size: int
    """``actor_rollout_ref.rollout.n``."""
    temperature: float
    """``actor_rollout_ref.rollout.temperature``."""
    max_new_tokens: int
    """``data.max_response_length``."""
    run_dir: Path
    """``trainer.default_local_dir``: metrics, checkpoints, report."""
    save_freq: int
    """``trainer.save_freq``: checkpoint every k steps (<= 0: only at the end)."""
    test_freq: int
    """``trainer.test_freq``: evaluate every k steps (<= 0: only before and after training)."""
    resume_mode: str
    """``trainer.resume_mode``: auto (continue from the run dir's latest checkpoint) | disable."""
    loggers: list[str]
    """``trainer.logger``: verl Tracking backends."""
    project_name: str
    experiment_name: str

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "RunSettings":
        total = cfg.trainer.total_training_steps
        if total is None or as_int("trainer.total_training_steps", total) < 1:
            raise ValueError(f"trainer.total_training_steps={total!r}: the embedded engine needs a positive step count")
        trainer, rollout = cfg.trainer, cfg.actor_rollout_ref.rollout
        settings = cls(
            model_path=str(cfg.actor_rollout_ref.model.path or ""),
            prompts_per_step=as_int("data.train_batch_size", cfg.data.train_batch_size),
            total_steps=as_int("trainer.total_training_steps", total),
            group_size=as_int("actor_rollout_ref.rollout.n", rollout.n),
            temperature=as_float("actor_rollout_ref.rollout.temperature", rollout.temperature),
            max_new_tokens=as_int("data.max_response_length", cfg.data.max_response_length),
            run_dir=Path(str(trainer.default_local_dir)),
            save_freq=as_int("trainer.save_freq", trainer.save_freq),
            test_freq=as_int("trainer.test_freq", trainer.test_freq),
            resume_mode=str(trainer.resume_mode),
            loggers=list(trainer.logger or []),
            project_name=str(trainer.project_name),
            experiment_name=str(trainer.experiment_name),
        )
        if settings.prompts_per_step < 1:
            raise ValueError(f"data.train_batch_size={settings.prompts_per_step} must be >= 1")
        if settings.temperature <= 0:
            raise ValueError(f"actor_rollout_ref.rollout.temperature={settings.temperature} must be > 0")
        if settings.max_new_tokens < 1:
            raise ValueError(f"data.max_response_length={settings.max_new_tokens} must be >= 1")
        if settings.resume_mode not in ("auto", "disable"):
            raise ValueError(
                f"trainer.resume_mode={settings.resume_mode!r}: the embedded engine supports auto | disable"
            )
        return settings


def as_int(key: str, value: Any) -> int:
    """``value`` of ``key`` as an int: an integer, or a float or text holding one; else ValueError
    naming the key and the value (not Python's "invalid literal for int()")."""
    if not isinstance(value, bool):
        try:
            number = float(value) if isinstance(value, str) else value
            if isinstance(number, int) or (isinstance(number, float) and number.is_integer()):
                return int(number)
        except ValueError:
            pass
    raise ValueError(f"{key}={value!r}: expected an integer")


def as_float(key: str, value: Any) -> float:
    """``value`` of ``key`` as a float (a number or text holding one); else ValueError naming both."""
    if not isinstance(value, bool):
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise ValueError(f"{key}={value!r}: expected a number")


@contextlib.contextmanager
def _env_default(name: str, value: str):
    """Inside the block, ``os.environ[name]`` is ``value`` unless the user set it; restored after."""
    if name in os.environ:
        yield
        return
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


class MetricLogger:
    """Appends metrics to ``metrics.jsonl`` (:class:`verl_ext.rundir.MetricsWriter`) and forwards
    them to verl's Tracking backends.

    verl's TensorBoard backend writes to ``$TENSORBOARD_DIR``, by default ``tensorboard_log/`` in
    the working directory; here the default is ``<run_dir>/tensorboard/``, beside the metrics."""

    def __init__(self, run_dir: Path, settings: RunSettings, config: Optional[DictConfig] = None):
        self._writer = MetricsWriter(run_dir)
        self.path = self._writer.path
        self._tracking = None
        if settings.loggers:
            from verl.utils.tracking import Tracking

            with _env_default("TENSORBOARD_DIR", str(run_dir / "tensorboard")):  # read when Tracking starts
                self._tracking = Tracking(
                    project_name=settings.project_name,
                    experiment_name=settings.experiment_name,
                    default_backend=settings.loggers,
                    config=OmegaConf.to_container(config, resolve=True) if config is not None else None,
                )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        clean = self._writer.write(metrics, step)
        if self._tracking is not None:
            self._tracking.log(data=clean, step=step)

    def close(self) -> None:
        self._writer.close()
        if self._tracking is not None:
            self._tracking.finish()
