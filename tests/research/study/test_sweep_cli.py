"""``delay_sweep.py``'s flags: one that no run would read, or that another flag would override, is
refused at start naming the flag and the design; the ones that are read reach the plan."""

import json
import subprocess
import sys

import pytest


SCRIPT = ["-m", "research.study.delay_sweep"]  # from the repository root


def _sweep(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *SCRIPT, "--out", str(tmp_path / "o"), *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args, message",
    [
        # powered and dry choose each rate from their grid: --lr would be dropped
        (
            ["--design", "powered", "--lr", "3e-4"],
            "--lr 0.0003: --design powered chooses each method's rate from its "
            "learning-rate grid [5e-05, 0.0001, 0.0002]",
        ),
        (["--design", "dry", "--lr", "3e-4"], "--lr 0.0003: --design dry chooses each method's rate"),
        (
            ["--design", "powered", "--lr-grid", "1e-4", "--lr", "3e-4"],
            "--lr 0.0003: --design powered chooses each method's rate from its learning-rate grid [0.0001]",
        ),
        # powered_long takes every rate from powered's stage 1: neither flag is read
        (
            ["--design", "powered_long", "--lr", "3e-4"],
            "--lr: --design powered_long takes every method's rate from --design powered's stage 1",
        ),
        (
            ["--design", "powered_long", "--lr-grid", "1e-4", "2e-4"],
            "--lr-grid: --design powered_long takes every method's rate from --design powered's stage 1",
        ),
        # no stage-1 seeds: a grid would choose no rate and nothing would run
        (["--design", "quick", "--lr-grid", "1e-4"], "--lr-grid: --design quick has no stage 1"),
        (["--design", "legacy", "--lr-grid", "1e-4", "--table-only"], "--lr-grid: --design legacy has no stage 1"),
        # every method pinned: --lr reaches no run
        (
            ["--design", "quick", "--algos", "gepo", "--lrs", "gepo=5e-5", "--lr", "3e-4"],
            "--lr 0.0003: every method's rate is pinned with --lrs",
        ),
        (["--quick", "--design", "powered"], "--quick is --design quick: not with --design powered"),
        (["--quick", "--design", "legacy", "--table-only"], "--quick is --design quick: not with --design legacy"),
    ],
)
def test_a_flag_no_run_would_read_is_refused_at_start(tmp_path, args, message):
    proc = _sweep(tmp_path, *args, "--plan-only")
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()  # refused before anything is written


def test_update_doc_is_refused_with_plan_only(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("intro\n")
    proc = _sweep(tmp_path, "--design", "powered", "--plan-only", "--update-doc", str(page))
    assert proc.returncode == 2 and f"--update-doc {page}: not with --plan-only" in proc.stderr, proc.stderr
    assert page.read_text() == "intro\n" and not (tmp_path / "o").exists()


# the quick design's plan pins its warm start's weight hash, so its first plan builds that warm start
# (about 30 s in a fresh clone; CI's every run): those cases are slow-marked, the other designs'
# plans (nothing to build) stay in the default run
QUICK_PLAN = pytest.mark.slow


@pytest.mark.parametrize(
    "args, design, fields",
    [
        pytest.param(["--design", "quick", "--lr", "3e-4"], "quick", {"lr": 3e-4}, marks=QUICK_PLAN),
        pytest.param(["--quick", "--design", "quick"], "quick", {"lr": 1e-4}, marks=QUICK_PLAN),
        pytest.param(["--quick"], "quick", {}, marks=QUICK_PLAN),
        (["--design", "powered", "--lr-grid", "1e-4", "3e-4"], "powered", {"lr_grid": [1e-4, 3e-4]}),
        # no --design: the study's, powered (legacy can only tabulate)
        (["--lr-grid", "1e-4"], "powered", {"lr_grid": [1e-4]}),
        # --lrs is honoured on every design, powered_long's too
        (
            ["--design", "powered_long", "--algos", "gepo", "--lrs", "gepo=5e-5"],
            "powered_long",
            {"lrs": {"gepo": 5e-5}},
        ),
        pytest.param(
            ["--design", "quick", "--algos", "gepo", "grpo", "--lrs", "gepo=5e-5", "--lr", "3e-4"],
            "quick",
            {"lr": 3e-4, "lrs": {"gepo": 5e-5}},
            marks=QUICK_PLAN,
        ),
    ],
)
def test_the_flags_a_design_reads_reach_its_plan(tmp_path, args, design, fields):
    proc = _sweep(tmp_path, *args, "--plan-only")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((tmp_path / "o" / "plan.json").read_text())
    assert plan["design"] == design and {k: plan[k] for k in fields} == fields
