"""How many torch intra-op threads a HeteroRL process uses: one rule for every entry point.

The user's ``OMP_NUM_THREADS`` wins: when it is set, torch already reads it at start-up and
nothing here changes it. Only when it is not set does the caller's small default apply, capped at
the machine's cores (on this project's shared 2-core machine more threads ran slower, OpenMP
threads waiting for each other). Used by ``recipe.gepo.main_gepo`` (default 2), the async
engine's Ray actors (1), the toy warm start (1) and the delay sweep's workers
(``research/study/run.py``, 1).
"""

from __future__ import annotations

import os


def user_sets_threads() -> bool:
    """True when ``OMP_NUM_THREADS`` is set (non-empty) in the environment."""
    return bool(os.environ.get("OMP_NUM_THREADS", "").strip())


def default_threads(default: int) -> int:
    """``min(default, os.cpu_count())``, at least 1."""
    return max(1, min(int(default), os.cpu_count() or 1))


def set_torch_threads(default: int) -> int:
    """Apply the rule: leave torch alone when ``OMP_NUM_THREADS`` is set, else set its intra-op
    threads to :func:`default_threads` ``(default)``. Returns the threads torch now uses."""
    import torch

    if not user_sets_threads():
        torch.set_num_threads(default_threads(default))
    return torch.get_num_threads()
