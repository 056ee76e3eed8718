"""Static checks every file of the repository passes: pyflakes' rules (undefined names, unused
imports and variables, redefinitions) and syntax errors, as ruff implements them (ruff honours the
``# noqa`` of the side-effect imports that register verl plugins), and ruff's formatter
(``ruff format``, 120 columns: pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = "F,E9"


def _ruff(*paths: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", RULES, "--no-cache", *paths],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_check_can_fail(tmp_path):
    (tmp_path / "bad.py").write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    out = _ruff("bad.py", cwd=tmp_path)
    assert out.returncode == 1 and "F401" in out.stdout and "F821" in out.stdout


def test_every_python_file_passes_pyflakes_rules():
    out = _ruff("verl_ext", "recipe", "scripts", "research", "tests")
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_format_check_can_fail(tmp_path):
    (tmp_path / "ugly.py").write_text("x = {  'a':1 }\n")
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "ugly.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1 and "ugly.py" in out.stdout


def test_every_python_file_is_formatted():
    """Run ``ruff format verl_ext recipe scripts research tests`` to fix a failure."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "format",
            "--check",
            "--no-cache",
            "verl_ext",
            "recipe",
            "scripts",
            "research",
            "tests",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
