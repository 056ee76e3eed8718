"""Fixes to verl 0.9.1 that every device needs (GPU machines too), each naming the verl file:line
it works around. The CPU-only changes live in :mod:`verl_ext.cpu.patches`."""

from __future__ import annotations

import logging
from typing import Any

from verl_ext.import_hooks import after_import


class _FlushTolerantLogger(logging.LoggerAdapter):
    """Drops the ``flush=`` keyword that print-style calls pass to a stdlib logger."""

    def process(self, msg, kwargs):
        kwargs.pop("flush", None)
        return msg, kwargs


def _patch_separate_async_logger(module: Any) -> None:
    """``verl/trainer/ppo/v1/trainer_separate_async.py:181-185`` calls ``logger.info(..., flush=True)``
    on a stdlib ``logging.Logger``: ``TypeError: Logger._log() got an unexpected keyword argument
    'flush'`` whenever ``actor_rollout_ref.hybrid_engine=false``. A verl bug on every device (see
    docs/scale-out.md, "Upstream report"); :func:`fix_separate_async_logger` applies this on GPUs too."""
    if not isinstance(module.logger, _FlushTolerantLogger):
        module.logger = _FlushTolerantLogger(module.logger, {})


def fix_separate_async_logger() -> None:
    """The ``flush=`` fix, for every device (the verl engine's trainer calls it)."""
    after_import("verl.trainer.ppo.v1.trainer_separate_async", _patch_separate_async_logger)
