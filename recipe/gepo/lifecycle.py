"""The run-directory lifecycle both engines share, written once.

A run (embedded or verl engine) prints its config notes, refuses to resume another run's
checkpoint, leaves ``config.yaml`` and the notes in its run directory, and writes ``report.md`` +
``curves.png`` after it ends -- after a failure too, from whatever it logged, without masking the
failure's own error.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from .options import ConfigError
from .run_report import METRICS_FILE, report_after_failure, write_config_notes, write_report


NOTHING_TO_TRAIN = "nothing_to_train"
"""Key of :func:`run_local`'s result when the run directory's run has already reached its last step."""


def finished_line(run_dir: Path, done: int, total: int) -> str:
    """The one line for a command whose run directory holds a run at step ``done`` >= ``total``."""
    where = f"finished at step {done} of {total}" if done == total else f"is at step {done}, past {total}"
    return (
        f"the run at {run_dir} {where} (trainer.total_training_steps={total}): nothing to train. To train it on, "
        f"repeat the command with trainer.total_training_steps=<more than {done}>; to start fresh, add "
        f"trainer.resume_mode=disable or another trainer.default_local_dir=<dir>. Report: {run_dir / 'report.md'}"
    )


def print_notes(notes: list[str]) -> None:
    """Options without effect that the study's configs keep: one line each on stderr."""
    for note in notes:
        print(f"note: {note}", file=sys.stderr)


def check_resume(run_dir: str | os.PathLike, cfg: Any) -> None:
    """Resuming ``run_dir``: its ``config.yaml`` must be ``cfg``'s, else :class:`ConfigError` in one
    line naming the directory, the keys that differ and how to continue it or start fresh."""
    from verl_ext.rundir import describe_changes, resume_config_changes

    changed = resume_config_changes(run_dir, cfg)
    if changed:
        raise ConfigError(
            f"trainer.default_local_dir={str(run_dir)!r} holds a run with another config "
            f"({describe_changes(changed)}). To continue that run, repeat its own command; to start fresh, "
            "pass another trainer.default_local_dir=<dir>, or trainer.resume_mode=disable to start over there "
            "(its metrics and checkpoint pointer are set aside, nothing is deleted)"
        )


@contextmanager
def run_directory(run_dir: str | os.PathLike, cfg: Any, notes: list[str], resuming: bool) -> Iterator[Path]:
    """Around one training run in ``run_dir`` (``cfg``: the composed OmegaConf config):

    - resuming, the directory's ``config.yaml`` must be this config's (else :func:`check_resume`'s
      ConfigError, before anything is written);
    - ``config.yaml`` and the config notes are written;
    - the body runs; when it raises, report.md is written from what was logged and the error goes on;
    - when it ends, report.md and curves.png are written next to ``metrics.jsonl``."""
    from verl_ext.rundir import write_run_config

    run_dir = Path(run_dir)
    if resuming:
        check_resume(run_dir, cfg)
    write_run_config(run_dir, cfg)
    write_config_notes(run_dir, notes)
    try:
        yield run_dir
    except BaseException:
        report_after_failure(run_dir)
        raise
    if (run_dir / METRICS_FILE).is_file():
        write_report(run_dir)
