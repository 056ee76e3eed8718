"""CPU pinning: make one machine behave like a learner node and a sampler node.

``hetero.learner_cpus`` / ``hetero.sampler_cpus`` name core ids; the engine calls
:func:`pin_process` inside the learner and sampler processes. The affinity is set on every thread
the process has (Ray's and torch's included) and inherited by threads started later, and torch's
intra-op threads are set to the number of cores given (more threads than cores only makes OpenMP
threads wait for each other). Linux only (``os.sched_setaffinity``).
"""

from __future__ import annotations

import os
from typing import Sequence


def check_cpus(key: str, cpus: Sequence[int], available: Sequence[int] | None = None) -> list[int]:
    """Validate core ids for config key ``key``: unique non-negative ints, and (when
    ``available`` is given) each one of ``available``. Returns them as a list; raises
    ValueError naming the key and the bad ids."""
    cpus = list(cpus)
    bad = [c for c in cpus if isinstance(c, bool) or not isinstance(c, int) or c < 0]
    if bad:
        raise ValueError(f"{key}={cpus}: core ids must be non-negative integers, got {bad}")
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{key}={cpus}: core ids repeat")
    if available is not None:
        missing = sorted(set(cpus) - set(available))
        if missing:
            raise ValueError(f"{key}={cpus}: cores {missing} do not exist here (available: {sorted(available)})")
    return cpus


def machine_cpus() -> list[int]:
    """Core ids this machine has (``0 .. os.cpu_count()-1``)."""
    return list(range(os.cpu_count() or 1))


def pin_process(cpus: Sequence[int], key: str = "cpus", set_threads: bool = True) -> list[int]:
    """Pin every thread of this process to ``cpus`` (no-op when empty); with ``set_threads``,
    torch's intra-op threads = ``len(cpus)``. Raises ValueError naming ``key`` for ids this
    machine does not have. Returns the process's affinity afterwards."""
    if not cpus:
        return sorted(os.sched_getaffinity(0))
    cpus = check_cpus(key, cpus, machine_cpus())
    for tid in thread_ids():
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):
            pass  # the thread ended since listing (or is not ours to move)
    if set_threads:
        import torch

        torch.set_num_threads(len(cpus))
    return sorted(os.sched_getaffinity(0))


def thread_ids(pid: int | str = "self") -> list[int]:
    """The thread ids of process ``pid`` (this one by default), from procfs. Without procfs: for
    this process, ``[0]`` (the calling thread, to ``os.sched_setaffinity``); for another,
    FileNotFoundError."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        if pid != "self":
            raise
        return [0]


class Pinned:
    """Context manager: the whole process on ``cpus`` inside the block, back to its previous
    affinity (and torch thread count) after; replay mode trains on the learner cores and
    generates on the sampler cores. No-op when ``cpus`` is empty. ``threads``: torch's intra-op
    threads = ``len(cpus)`` inside the block."""

    def __init__(self, cpus: Sequence[int], key: str = "cpus", threads: bool = False):
        self.cpus, self.key, self.threads = list(cpus), key, threads
        self._previous: list[int] = []
        self._torch_threads = 0

    def __enter__(self) -> "Pinned":
        if self.cpus:
            import torch

            self._previous = sorted(os.sched_getaffinity(0))
            self._torch_threads = torch.get_num_threads()
            pin_process(self.cpus, self.key, set_threads=self.threads)
        return self

    def __exit__(self, *exc) -> None:
        if self.cpus:
            import torch

            pin_process(self._previous, self.key, set_threads=False)
            if self.threads:
                torch.set_num_threads(self._torch_threads)
