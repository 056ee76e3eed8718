"""``sbatch scripts/slurm/verl_star.sbatch`` on a real SLURM cluster of namespace nodes (slow, root).

Nodes of ``research/testbeds/slurm_cluster.py`` joined by 100 Mbit/s links; the script, unmodified,
with the documented CPU switch (``PRESET=cpu_toy GPUS_PER_NODE=0``, ``--gpus-per-node=0
--cpus-per-task=2``): Ray head on node 1 and workers on the others, the verl engine's learner on
the first ``trainer.nnodes`` nodes (1, or 2 FSDP ranks with gloo across the links) and its hf_cpu
sampler on the last (their hostnames in the run's placement.json), weights crossing the link (the
samplers' weight version moves), every step once in metrics.jsonl, report.md and curves.png beside
it, and no Ray process of the job left after it.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.slurm.slurm_scripts import running_cluster

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


@pytest.fixture
def nodes(request):
    """A cluster of ``request.param`` nodes (indirect parametrisation), torn down after the test."""
    with running_cluster(request.param) as (_, env, _state):
        yield env


def _ray_processes_of(job_id: str) -> list[str]:
    """Command lines of live processes that belong to the job's Ray session dir."""
    marker = f"heterorl-ray-{job_id}"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                status = (entry / "status").read_text()
            except OSError:
                continue
            if marker in cmdline and "\nState:\tZ" not in status:
                found.append(cmdline[:200])
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    "nodes, learner_nodes",
    [(2, 1), (3, 2)],  # (3, 2): 2 FSDP learner ranks on 2 nodes, gloo across the links
    indirect=["nodes"],
    ids=["learner_1_node", "learner_2_nodes"],
)
def test_verl_star_runs_learner_and_sampler_on_their_nodes(nodes, learner_nodes, tmp_path):
    run_dir = tmp_path / "run"
    env = dict(nodes, PRESET="cpu_toy", GPUS_PER_NODE="0", REPO=str(ROOT), OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            "sbatch",
            "--wait",
            "--parsable",
            f"--nodes={learner_nodes + 1}",
            "--gpus-per-node=0",
            "--cpus-per-task=2",
            f"--output={tmp_path}/job-%j.out",
            str(ROOT / "scripts" / "slurm" / "verl_star.sbatch"),
            f"trainer.default_local_dir={run_dir}",
            f"trainer.total_training_steps={STEPS}",
            f"trainer.nnodes={learner_nodes}",
            f"task.cache_dir={ROOT / '.cache' / 'heterorl'}",
            "hetero.delay.dist=constant",
            "hetero.delay.value=1.0",
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    job_id = proc.stdout.strip().split(";")[0]
    log = "".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    print(f"job {job_id}: {time.monotonic() - t0:.0f} s")
    assert proc.returncode == 0, (proc.stderr + log)[-5000:]

    placement = json.loads((run_dir / "placement.json").read_text())
    learners = [f"n{i + 1}" for i in range(learner_nodes)]  # the first trainer.nnodes nodes
    assert sorted(n["hostname"] for n in placement["learner"]) == learners
    assert [n["hostname"] for n in placement["samplers"]] == [f"n{learner_nodes + 1}"]
    assert f"Ray cluster up: {learner_nodes + 1} nodes" in log

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["hetero/sampler_weight_version"] > 0  # delayed versions crossed the link
    assert all(r["actor/has_group_denominator"] == 1.0 for r in rows)  # denominators over whole groups
    assert (run_dir / "report.md").is_file() and (run_dir / "curves.png").is_file()
    assert _ray_processes_of(job_id) == []
