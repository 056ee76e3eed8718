"""Sampler pools as their own SLURM jobs beside a verl-engine learner job, on a real cluster of
namespace nodes (slow, root): a lost pool node fails only that pool's job.

Five nodes with 100 Mbit/s links: the learner's job (``verl_star.sbatch``, hetero.transport=fs,
``REQUEUE_ON_FAILURE=2``) on two, two pools (``remote_samplers.sbatch`` with ``POOL=1``, an array of
two, each enrolled through ``ENROLMENT_FILE`` after the learner started) on two more, one spare. The
node of pool 32 is powered off mid-run (``slurm_cluster.py node-gone``). The learner's job goes on,
never failed nor requeued, training on pool 33's groups; Slurm requeues the pool's job (its node
failed; it starts again ~2 min later, Slurm's requeue delay) onto the spare node, where the pool
resumes after the batches it claimed. Every step once, every trained group a pool's and none twice,
both pools stopped by the learner's stop marker. ~14 min.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.slurm_scripts import cli as _cli, running_cluster, wait_for

ROOT = Path(__file__).resolve().parents[2]
STEPS = 60
SPEED_FACTOR = 16  # the toy learner then waits ~8 s a step on one pool: it still trains when the lost pool is back
JOB_TIMEOUT_S = 1500
POOLS = (32, 33)


@pytest.fixture
def five_nodes():
    with running_cluster(5) as (_, env, _state):
        yield env


def _sbatch(env: dict, cwd: Path, args: list[str], **extra_env: str) -> str:
    proc = subprocess.run(
        ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=2", "--open-mode=append", *args],
        env=dict(env, REPO=str(ROOT), OMP_NUM_THREADS="1", **extra_env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _job(env: dict, job_id: str) -> dict[str, str]:
    """scontrol's fields of the job ({} once slurmctld has forgotten it)."""
    out = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True, timeout=30)
    return {} if out.returncode != 0 else dict(p.split("=", 1) for p in out.stdout.split() if "=" in p)


def _wait(predicate, what: str) -> None:
    wait_for(predicate, what, JOB_TIMEOUT_S)


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.is_file() else ""
    return [json.loads(line)["step"] for line in text.splitlines() if line.strip()]


def _text(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


@pytest.mark.slow
def test_a_lost_pool_node_fails_only_the_pools_job_which_comes_back_on_a_spare_and_resumes(five_nodes, tmp_path):
    env, run_dir, exchange = five_nodes, tmp_path / "run", tmp_path / "exchange"
    enrolment, keys = tmp_path / "enrolment.json", tmp_path / "keys"
    shared = [
        "+verl_preset=cpu_toy", "hetero.engine=verl", "hetero.transport=fs", "hetero.delay.dist=none",
        "hetero.max_delay=2", "hetero.max_queued_groups=8", "hetero.weight_sync=delta", "hetero.weights_bf16=true",
        f"task.cache_dir={ROOT / '.cache' / 'heterorl'}",
    ]  # fmt: skip
    enrolment.write_text('{"keys": {}}')  # the pools enrol themselves when they start (ENROLMENT_FILE)
    learner = _sbatch(
        env,
        tmp_path,
        ["--nodes=2", f"--output={tmp_path}/learner-%j.out", str(ROOT / "scripts/slurm/verl_star.sbatch")]
        + [s for s in shared if not s.startswith(("+verl_preset", "hetero.engine"))]
        + [
            f"hetero.transport_url={exchange}",
            f"hetero.trust.enrolment_file={enrolment}",
            f"trainer.default_local_dir={run_dir}",
            f"trainer.total_training_steps={STEPS}",
            "trainer.save_freq=2",
            "trainer.resume_mode=auto",
        ],  # fmt: skip
        PRESET="cpu_toy",
        GPUS_PER_NODE="0",
        REQUEUE_ON_FAILURE="2",
    )
    learner_log = tmp_path / f"learner-{learner}.out"
    # a fresh learner clears the exchange: the pools are submitted once it reads it
    _wait(lambda: "[hetero] sampler pools: reading" in _text(learner_log), "the learner's ingress")
    pools = _sbatch(
        env,
        tmp_path,
        [
            "--nodes=1",
            f"--array=0-{len(POOLS) - 1}",
            f"--output={tmp_path}/pool-%A_%a.out",
            str(ROOT / "scripts/slurm/remote_samplers.sbatch"),
        ],  # fmt: skip
        POOL="1",
        EXCHANGE_URL=str(exchange),
        INDEX_BASE=str(POOLS[0]),
        KEY_DIR=str(keys),
        ENROLMENT_FILE=str(enrolment),
        PRESET_ARGS=" ".join(shared),
        SAMPLER_CMD=f"{sys.executable} -m recipe.gepo.pool --speed-factor {SPEED_FACTOR}",
    )
    pool_log = {index: tmp_path / f"pool-{pools}_{i}.out" for i, index in enumerate(POOLS)}
    _wait(lambda: all(_text(log).count("] batch ") >= 2 for log in pool_log.values()), "both pools sending")
    _wait(lambda: len(_steps(run_dir)) >= 3, "step 3")
    victim = _job(env, f"{pools}_0")["NodeList"]
    assert victim not in _job(env, learner)["NodeList"]
    assert _cli("node-gone", "--node", victim).returncode == 0
    at_fault = len(_steps(run_dir))

    def resumed() -> bool:
        return _text(pool_log[POOLS[0]]).count("] up: exchange") >= 2

    _wait(resumed, f"pool {POOLS[0]} requeued and up again")
    back_at = len(_steps(run_dir))
    assert _job(env, f"{pools}_0")["NodeList"] != victim
    _wait(lambda: _job(env, learner).get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", None), "the learner")
    assert _job(env, learner)["JobState"] == "COMPLETED" and _job(env, learner)["Restarts"] == "0"
    log = _text(learner_log)
    assert "error: the recipe exited" not in log and "requeueing" not in log
    assert _steps(run_dir) == list(range(1, STEPS + 1))
    print(f"learner at step {at_fault} when pool {POOLS[0]}'s node went, at {back_at} when it was back")
    assert back_at > at_fault  # it trained on the other pool meanwhile

    for i in range(len(POOLS)):  # the learner's stop marker ends both pools
        _wait(lambda i=i: _job(env, f"{pools}_{i}").get("JobState") in ("COMPLETED", "FAILED", None), f"pool {i}")
        assert _job(env, f"{pools}_{i}").get("JobState", "COMPLETED") == "COMPLETED"
    starts = [
        int(b) for b in re.findall(r"\] up: exchange .*, launch \S+, starting at batch (\d+)", _text(pool_log[32]))
    ]
    assert len(starts) == 2 and starts[1] > 0  # the requeued pool resumed after the batches it had claimed
    launches = re.findall(r"launch (r32-\S+),", _text(pool_log[32]))
    audit = [json.loads(line) for line in (run_dir / "pool_trained.jsonl").read_text().splitlines()]
    trained = [g for row in audit for g in row["groups"]]
    assert len(trained) == 4 * STEPS and len(set(trained)) == len(trained)
    assert all(g.startswith(("r32-", "r33-")) for g in trained)
    assert any(g.startswith(f"{launches[1]}-") for g in trained), "the requeued pool's groups were trained"
