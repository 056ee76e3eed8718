"""``research/soak/__main__.py`` refuses what it cannot run, clearly and before touching anything: ``--wan``
without the network privileges the real link needs (run as an unprivileged user
via setpriv), an unbounded link cut, a run without checkpoints."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to drop to an unprivileged user",
)
def test_soak_wan_refuses_without_cap_net_admin():
    proc = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            sys.executable,
            "-m",
            "research.soak",
            "--wan",
            "--minutes",
            "0.1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "CAP_NET_ADMIN" in proc.stderr and "nothing was changed" in proc.stderr
    assert "soak:" not in proc.stdout  # no soak ran


def test_soak_wan_cut_must_be_bounded():
    proc = subprocess.run(
        [sys.executable, "-m", "research.soak", "--wan", "--wan-cut-s", "1000"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2 and "--wan-cut-s=1000.0 must be in (0, 120]" in proc.stderr


def test_soak_needs_checkpoints_to_account_for_groups():
    """Without checkpoints the learner deletes consumed groups at once and the soak has no ledger
    to account from after its time limit: refused at start, naming the flag."""
    proc = subprocess.run(
        [sys.executable, "-m", "research.soak", "--save-freq", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 2 and "--save-freq=0 must be >= 1" in proc.stderr
    assert "soak:" not in proc.stdout
