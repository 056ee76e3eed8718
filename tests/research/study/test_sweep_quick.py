"""``delay_sweep.py --quick`` end to end (tables and figures); slow: about a minute on an idle machine."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_quick_sweep_writes_tables_and_figures(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "research.study.delay_sweep",
            "--quick",
            "--out",
            str(tmp_path),
            "--workers",
            "2",
            "--steps",
            "8",
            "--algos",
            "gepo",
            "grpo_tis",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for task in ("short", "long"):
        table = (tmp_path / f"table_{task}.md").read_text()
        for algo in ("gepo", "grpo_tis"):
            for delay in (0, 64):
                assert f"| {algo} | {delay} | 1 |" in table
        figs = tmp_path / f"figures_{task}"
        assert (figs / "acc_vs_delay.png").is_file() and (figs / "curves.png").is_file()
        assert (figs / "diag_correlations.csv").is_file()
    assert not list(tmp_path.glob("runs/*/*/*/*/FAILED"))
    assert len(list(tmp_path.glob("runs/*/*/*/*/DONE"))) == 8
