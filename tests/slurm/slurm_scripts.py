"""Load ``research/testbeds/slurm_cluster.py`` as a module (run as a file, as root), and bring a
real cluster up and down for the slow tests (:func:`running_cluster`)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "research" / "testbeds" / "slurm_cluster.py"


def load_slurm_cluster():
    name = "heterorl_slurm_cluster"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``python research/testbeds/slurm_cluster.py <args>``."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def skip_reason() -> str | None:
    """Why a real cluster cannot be made here, or None."""
    lc = load_slurm_cluster()
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "needs root (namespaces, veths, munged as user munge, slurmd as root)"
    problems = lc.missing_requirements(lc.link.effective_caps())
    return "needs " + "; ".join(problems) if problems else None


def our_netns(cfg) -> list[str]:
    return [ns for ns in load_slurm_cluster().netns_list() if ns.startswith(cfg.netns_prefix)]


@contextmanager
def running_cluster(nodes: int, rate_mbit: float = 100) -> Iterator[tuple[object, dict, dict]]:
    """Up ``nodes`` rate-limited nodes (skipping the test where that cannot be done), yield
    ``(config, env with SLURM_CONF, the state recorded at up)``; on exit ``down`` twice and assert
    nothing is left: no namespace, veth, bridge or state dir of the cluster."""
    lc = load_slurm_cluster()
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    cfg = lc.ClusterConfig()
    if cfg.state_file.exists() or our_netns(cfg) or lc.link_exists(cfg.bridge):
        pytest.skip(f"{cfg.state_dir} or the {cfg.netns_prefix}* namespaces exist: another run owns the cluster")
    try:
        lc.ensure_slurm_installed()
    except (lc.CommandError, subprocess.TimeoutExpired, OSError) as err:
        pytest.skip(f"Slurm packages cannot be installed here: {err}")
    state: dict = {}
    try:
        t0 = time.monotonic()
        proc = cli("up", "--nodes", str(nodes), "--rate-mbit", str(rate_mbit), "--timeout", "60")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.strip().splitlines()[-1] == f"SLURM_CONF={cfg.conf_path}"
        print(f"up in {time.monotonic() - t0:.1f} s")
        state = lc.read_state(cfg.state_dir)
        yield cfg, dict(os.environ, SLURM_CONF=str(cfg.conf_path)), state
    finally:
        t0 = time.monotonic()
        first, second = cli("down", timeout=120), cli("down", timeout=120)
        print(f"down in {time.monotonic() - t0:.1f} s (twice)")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert our_netns(cfg) == []
    assert not lc.link_exists(cfg.bridge)
    assert not any(lc.link_exists(cfg.host_if(f"n{i}")) for i in range(1, nodes + 1))
    assert not Path(cfg.state_dir).exists()


def wait_for(predicate, what: str, timeout: float) -> None:
    """Poll ``predicate`` each second; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(1.0)
