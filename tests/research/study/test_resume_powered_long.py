"""scripts/dev/resume_powered_long.sh: it passes shellcheck, and what it refuses it refuses before
touching the committed rows (its set-up and run paths make a worktree and a venv: run by hand,
study_data/README.md)."""

import os
import subprocess
from pathlib import Path

import pytest

from tests.slurm.test_slurm_scripts import assert_shellcheck_clean

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "dev" / "resume_powered_long.sh"
DOC_ROWS = ROOT / "docs" / "study_data" / "rows_powered.csv"


def _run(*args: str, rows: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "FRONTIER_ROWS": str(rows)}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", sorted((ROOT / "scripts" / "dev").glob("*.sh")), ids=lambda p: p.name)
def test_dev_scripts_pass_shellcheck(script):
    assert_shellcheck_clean(script)


def test_an_unknown_mode_is_refused_naming_it(tmp_path):
    result = _run("--collec", rows=tmp_path / "rows.csv")
    assert result.returncode == 2
    assert "--collec" in result.stderr and "--collect" in result.stderr


def test_collect_refuses_rows_that_do_not_extend_the_committed_ones(tmp_path):
    before = DOC_ROWS.read_bytes()
    header = before.splitlines(keepends=True)[0]
    other = tmp_path / "rows.csv"  # another start's file: the header, then a row the docs do not have first
    other.write_bytes(header + b"long,gepo,5e-05,fix256,9,other,other\n" + before[len(header) :])
    result = _run("--collect", rows=other)
    assert result.returncode == 1
    assert "does not extend" in result.stderr and str(other) in result.stderr
    assert DOC_ROWS.read_bytes() == before


def test_collect_without_a_rows_file_says_so(tmp_path):
    result = _run("--collect", rows=tmp_path / "missing.csv")
    assert result.returncode == 1
    assert "no rows file" in result.stderr
