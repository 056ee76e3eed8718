"""A small, reusable pool of math_verify worker processes with a hard per-call timeout.

Why not math_verify's own timeout: it uses ``signal.alarm``, which only works in the main thread
(verl calls reward functions from executor threads). Why not ``multiprocessing``: spawn and
forkserver re-import the parent's ``__main__`` and daemonic processes (Ray, ``multiprocessing.Pool``
workers) may not have children. The workers here are plain subprocesses
(``sys.executable`` running ``_verify_worker.py``); a call that exceeds its timeout kills its
worker (SIGKILL, so even a sympy computation stuck in C stops) and a fresh one replaces it.

The pool is thread-safe: each call checks out one idle worker, so up to ``num_workers`` calls run
in parallel and further calls wait for a free worker. Fork safety: :func:`get_pool` makes a new
pool in a forked child instead of sharing the parent's pipes.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["VerifyPool", "get_pool", "default_num_workers", "WorkerError"]

_HEADER = struct.Struct(">I")
_WORKER_FILE = Path(__file__).with_name("_verify_worker.py")
# Run the worker file without putting its folder on sys.path (python -c puts "" instead).
_BOOT = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


class WorkerError(RuntimeError):
    """A verification worker died or could not start (not a timeout)."""


class _Timeout(Exception):
    pass


def default_num_workers() -> int:
    """Pool size: env ``HETERORL_REWARD_WORKERS`` if set, else min(2, number of CPUs)."""
    env = os.environ.get("HETERORL_REWARD_WORKERS")
    if env is not None:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"HETERORL_REWARD_WORKERS must be a positive integer, got {env!r}") from None
        if value < 1:
            raise ValueError(f"HETERORL_REWARD_WORKERS must be a positive integer, got {env!r}")
        return value
    return max(1, min(2, os.cpu_count() or 1))


class _Worker:
    def __init__(self) -> None:
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(_WORKER_FILE)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,
                close_fds=True,
            )
        except OSError as exc:
            raise WorkerError(f"cannot start a math_verify worker with {sys.executable!r}: {exc}") from exc
        self.ready = False

    def _read_exact(self, n: int, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        chunks = []
        while n > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Timeout()
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                raise _Timeout()
            chunk = os.read(fd, n)
            if not chunk:
                code = self.proc.poll()
                raise WorkerError(f"math_verify worker pid {self.proc.pid} exited (return code {code})")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def _recv(self, deadline: float):
        size = _HEADER.unpack(self._read_exact(_HEADER.size, deadline))[0]
        return pickle.loads(self._read_exact(size, deadline))

    def wait_ready(self, startup_timeout: float) -> None:
        if self.ready:
            return
        try:
            msg = self._recv(time.monotonic() + startup_timeout)
        except _Timeout:
            raise WorkerError(
                f"math_verify worker pid {self.proc.pid} did not start within {startup_timeout} s"
            ) from None
        if msg[0] != "ready":
            raise WorkerError(f"math_verify worker sent {msg!r} instead of 'ready'")
        self.ready = True

    def request(self, msg, timeout: float):
        body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.proc.stdin.write(_HEADER.pack(len(body)) + body)
        except (BrokenPipeError, OSError) as exc:
            raise WorkerError(f"math_verify worker pid {self.proc.pid} is gone: {exc}") from exc
        return self._recv(time.monotonic() + timeout)

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class VerifyPool:
    """Up to ``num_workers`` math_verify processes, started lazily and reused.

    Args:
        num_workers: maximum number of worker processes (each ~100 MB, ~1 s to start).
        startup_timeout: seconds a new worker may take to import math_verify and report ready;
            not counted against a call's timeout.
    """

    def __init__(self, num_workers: int = 2, startup_timeout: float = 120.0) -> None:
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        if not startup_timeout > 0:
            raise ValueError(f"startup_timeout must be > 0 seconds, got {startup_timeout!r}")
        self.num_workers = num_workers
        self.startup_timeout = float(startup_timeout)
        self.pid = os.getpid()
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        self._lock = threading.Lock()
        self._all: set[_Worker] = set()
        self._closed = False
        #: counters since creation: calls, timeouts, worker_errors, workers_started
        self.stats = {"calls": 0, "timeouts": 0, "worker_errors": 0, "workers_started": 0}

    def _checkout(self) -> _Worker:
        while True:
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                if self._closed:
                    raise WorkerError("the VerifyPool is closed")
                if len(self._all) < self.num_workers:
                    worker = _Worker()
                    self._all.add(worker)
                    self.stats["workers_started"] += 1
                    return worker
            try:
                return self._idle.get(timeout=1.0)
            except queue.Empty:
                continue  # re-check: a killed worker may have freed a slot

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            self._all.discard(worker)
        worker.kill()

    def check(self, golds: list[str], pred: str, timeout: float, float_rounding: int = 6) -> dict:
        """Verify ``pred`` (a boxed answer's content) against any of ``golds``.

        Args:
            golds: candidate gold answers (LaTeX or plain strings); any match counts.
            pred: the content of the response's last ``\\boxed{}``.
            timeout: wall-clock seconds for parsing both sides and verifying (> 0).
            float_rounding: decimal places math_verify rounds floats to before comparing.

        Returns:
            ``{"status": "ok" | "gold_unparsable" | "pred_unparsable" | "timeout", "correct": bool}``.

        Raises:
            WorkerError: if a worker crashes twice in a row on this call or cannot start.
        """
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        msg = ("check", list(golds), pred, int(float_rounding))
        with self._lock:
            self.stats["calls"] += 1
        last_error: Exception | None = None
        for _attempt in range(2):
            worker = self._checkout()
            try:
                worker.wait_ready(self.startup_timeout)
                reply = worker.request(msg, timeout)
            except _Timeout:
                self._discard(worker)
                with self._lock:
                    self.stats["timeouts"] += 1
                return {"status": "timeout", "correct": False}
            except WorkerError as exc:
                self._discard(worker)
                with self._lock:
                    self.stats["worker_errors"] += 1
                last_error = exc
                continue
            except BaseException:
                self._discard(worker)  # e.g. KeyboardInterrupt mid-call: the worker state is unknown
                raise
            self._idle.put(worker)
            if reply[0] == "exc":
                raise WorkerError(f"math_verify raised on gold={golds!r} pred={pred!r:.200}: {reply[1]}")
            return reply[1]
        raise WorkerError(f"math_verify workers failed twice on pred={pred!r:.200}: {last_error}")

    def close(self) -> None:
        """Kill every worker; later calls raise WorkerError."""
        with self._lock:
            self._closed = True
            workers = list(self._all)
            self._all.clear()
        for worker in workers:
            worker.kill()

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (for tests and diagnostics)."""
        with self._lock:
            return sorted(w.proc.pid for w in self._all)


_POOL: VerifyPool | None = None
_POOL_LOCK = threading.Lock()


def get_pool(num_workers: int | None = None) -> VerifyPool:
    """The process-wide shared pool, created on first use (and again after a fork).

    ``num_workers`` (None: :func:`default_num_workers`) can only grow the pool's size.
    """
    global _POOL
    wanted = default_num_workers() if num_workers is None else num_workers
    if not isinstance(wanted, int) or wanted < 1:
        raise ValueError(f"num_workers must be a positive int, got {wanted!r}")
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid() or _POOL._closed:
            _POOL = VerifyPool(num_workers=wanted)
        elif wanted > _POOL.num_workers:
            _POOL.num_workers = wanted
        return _POOL


@atexit.register
def _close_shared_pool() -> None:
    pool = _POOL
    if pool is not None and pool.pid == os.getpid():
        pool.close()
