"""Faults under ``sbatch scripts/slurm/verl_star.sbatch`` on a real SLURM cluster of namespace
nodes (slow, root): what survives is what docs/scale-out.md promises.

Three nodes (the job takes two, one is spare), 100 Mbit/s links, the toy preset with a checkpoint
every 5 steps and ``trainer.resume_mode=auto``:

- the sampler node vanishes mid-job (``slurm_cluster.py node-gone``: its namespace, slurmd and Ray
  worker die) -- the recipe fails at once (Ray: the sampler actor is unavailable), the script names
  the failure and how many Ray nodes are left, and with ``REQUEUE_ON_FAILURE=2`` requeues the job;
  Slurm has marked the node DOWN by then (``SlurmdTimeout``, 30 s) and starts it again on the two
  nodes left, where it resumes from the last checkpoint;
- the sampler node's link is cut for 30 s and healed: the same;
- ``scancel`` mid-job, then the same ``sbatch`` again: resumed from the last checkpoint.

Each time metrics.jsonl holds every step 1..N exactly once (a resumed run re-logs the steps after
its checkpoint and drops the ones it re-does) and the job ends with exit 0.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.slurm.slurm_scripts import cli as _cli, running_cluster, wait_for

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30
SAVE_FREQ = 5
JOB_TIMEOUT_S = 900


@pytest.fixture
def three_nodes():
    with running_cluster(3) as (_, env, _state):
        yield env


def _submit(env: dict, tmp_path: Path, run_dir: Path) -> str:
    cmd = [
        "sbatch",
        "--parsable",
        "--nodes=2",
        "--gpus-per-node=0",
        "--cpus-per-task=2",
        "--open-mode=append",
        f"--output={tmp_path}/job-%j.out",
        str(ROOT / "scripts" / "slurm" / "verl_star.sbatch"),
        f"trainer.default_local_dir={run_dir}",
        f"trainer.total_training_steps={STEPS}",
        f"trainer.save_freq={SAVE_FREQ}",
        "trainer.resume_mode=auto",
        f"task.cache_dir={ROOT / '.cache' / 'heterorl'}",
        "hetero.delay.dist=constant",
        "hetero.delay.value=1.0",
    ]
    job_env = dict(
        env, PRESET="cpu_toy", GPUS_PER_NODE="0", REPO=str(ROOT), OMP_NUM_THREADS="1", REQUEUE_ON_FAILURE="2"
    )
    proc = subprocess.run(cmd, env=job_env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _job_state(env: dict, job_id: str) -> tuple[str, str]:
    """(state, exit code) from scontrol; ("GONE", "") once slurmctld has forgotten the job."""
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return "GONE", ""
    fields = dict(part.split("=", 1) for part in out.stdout.split() if "=" in part)
    return fields.get("JobState", "?"), fields.get("ExitCode", "")


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def _checkpointed(run_dir: Path) -> int:
    tracker = run_dir / "latest_checkpointed_iteration.txt"
    return int(tracker.read_text().strip() or 0) if tracker.is_file() else 0


def _wait_done(env: dict, job_id: str) -> str:
    wait_for(
        lambda: _job_state(env, job_id)[0] in ("COMPLETED", "FAILED", "CANCELLED", "GONE"),
        f"job {job_id}",
        JOB_TIMEOUT_S,
    )
    return _job_state(env, job_id)[0]


def _sampler_node(run_dir: Path) -> str:
    return json.loads((run_dir / "placement.json").read_text())["samplers"][0]["hostname"]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["node_gone", "link_cut_30s"])
def test_a_lost_sampler_node_requeues_the_job_which_resumes(three_nodes, tmp_path, fault):
    env, run_dir = three_nodes, tmp_path / "run"
    job_id = _submit(env, tmp_path, run_dir)
    wait_for(lambda: _checkpointed(run_dir) >= SAVE_FREQ, "a first checkpoint", JOB_TIMEOUT_S)
    victim = _sampler_node(run_dir)
    assert victim != "n1"  # the learner's node is the head; the sampler's is the other
    if fault == "node_gone":
        assert _cli("node-gone", "--node", victim).returncode == 0
    else:
        assert _cli("cut", "--node", victim).returncode == 0
        time.sleep(30)
        assert _cli("heal", "--node", victim).returncode == 0
    lost_at = _checkpointed(run_dir)
    assert _wait_done(env, job_id) == "COMPLETED"
    log = "".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    assert "error: the recipe exited with status" in log and f"requeueing job {job_id} (restart 1 of 2)" in log
    assert f"Resuming from {run_dir}/global_step_" in log
    assert _sampler_node(run_dir) != victim or fault == "link_cut_30s"  # node-gone: the spare node took over
    assert lost_at < STEPS and _steps(run_dir) == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_a_cancelled_job_resubmitted_resumes_from_its_checkpoint(three_nodes, tmp_path):
    env, run_dir = three_nodes, tmp_path / "run"
    first = _submit(env, tmp_path, run_dir)
    wait_for(lambda: _checkpointed(run_dir) >= SAVE_FREQ, "a first checkpoint", JOB_TIMEOUT_S)
    subprocess.run(["scancel", first], env=env, check=True, timeout=30)
    assert _wait_done(env, first) in ("CANCELLED", "GONE")
    cancelled_at = _checkpointed(run_dir)
    assert 0 < cancelled_at < STEPS
    second = _submit(env, tmp_path, run_dir)
    assert _wait_done(env, second) == "COMPLETED"
    log = (tmp_path / f"job-{second}.out").read_text()
    assert f"Resuming from {run_dir}/global_step_{cancelled_at}" in log
    assert _steps(run_dir) == list(range(1, STEPS + 1))
