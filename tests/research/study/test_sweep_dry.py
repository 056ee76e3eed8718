"""``delay_sweep.py --design dry`` end to end, shrunk: stage 1 (rates), stage 2 (conditions x seeds),
rows with the warm start's hash, study_<task>.md, and a second invocation that runs nothing."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_dry_design_runs_rows_tables_and_resumes(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "research.study.delay_sweep",
        "--design",
        "dry",
        "--out",
        str(tmp_path),
        "--workers",
        "2",
        "--steps",
        "4",
        "--seeds",
        "0",
        "1",
        "--delays",
        "0",
        "fix2",
        "--algos",
        "gepo",
        "grpo_paper",
        "--lr-grid",
        "1e-4",
        "--no-figures",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "rows.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 8  # stage 1: 2 (seed 0 on-policy); stage 2: 2 x 2 x 2 minus those 2
    plan = json.loads((tmp_path / "plan.json").read_text())
    from research.study.run import warm_start_path
    from verl_ext.data.toy.checkpoints import weights_sha256

    # the folder the sweep ran from (the package's shipped copy, else its build in the default cache)
    ws = warm_start_path("long", str(REPO / ".cache" / "heterorl"), plan["warm_start_steps"])
    assert f"warm start long: {ws} " in proc.stdout
    sha = weights_sha256(ws)
    assert {r["ws_sha256"] for r in rows} == {sha} and {r["design_id"] for r in rows} == {plan["design_id"]}
    stale = [r for r in rows if r["delay"] == "fix2"]
    assert stale and all(float(r["staleness_max"]) == 2.0 for r in stale)
    assert all(float(r["staleness"]) == 0.0 for r in rows if r["delay"] == "0")
    md = (tmp_path / "study_long.md").read_text()
    assert "**Paired differences, gepo minus each baseline**" in md and "| fix2 |" in md and sha in md
    assert {json.loads(p.read_text())["ws_sha256"] for p in tmp_path.glob("runs/*/*/*/*/DONE")} == {sha}
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "stage 1: 0 runs" in again.stdout and "stage 2: 0 runs" in again.stdout
    with open(tmp_path / "rows.csv", newline="") as fh:
        assert len(list(csv.DictReader(fh))) == 8
