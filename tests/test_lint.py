"""Static checks every file of the repository passes: pyflakes' rules (undefined names, unused
imports and variables, redefinitions) and syntax errors, as ruff implements them (ruff honours the
``# noqa`` of the side-effect imports that register verl plugins)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = "F,E9"


def _ruff(*paths: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--select", RULES, "--no-cache", *paths],
                          cwd=cwd, capture_output=True, text=True, timeout=120)  # fmt: skip


def test_the_check_can_fail(tmp_path):
    (tmp_path / "bad.py").write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    out = _ruff("bad.py", cwd=tmp_path)
    assert out.returncode == 1 and "F401" in out.stdout and "F821" in out.stdout


def test_every_python_file_passes_pyflakes_rules():
    out = _ruff("verl_ext", "recipe", "scripts", "tests")
    assert out.returncode == 0, out.stdout + out.stderr
