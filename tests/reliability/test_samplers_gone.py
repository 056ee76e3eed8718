"""No sampler delivers anything: the learner must not hang. It fails with a clear message after
``hetero.wait_timeout_s``, and while it waits the user should see that it is waiting.

The samplers are real Ray actors, alive, but they never see any weights (a constant weight
delay of 10^6 s), so from the learner's side every sampler is gone. The run is the real entry
point in a subprocess, bounded by a timeout."""

import re
import subprocess
import sys
import time

import pytest

from .conftest import CACHE_DIR, REPO

pytestmark = pytest.mark.slow  # a real async run of the entry point that waits out its timeout: ~24 s

WAIT_TIMEOUT_S = 4  # the learner reports its wait every WAIT_TIMEOUT_S / 3 s, so the status shows before the error


@pytest.fixture(scope="module")
def stalled_run(tmp_path_factory, toy_model_path):
    run_dir = tmp_path_factory.mktemp("stalled") / "run"
    cmd = [
        sys.executable,
        "-m",
        "recipe.gepo.main_gepo",
        "hetero.mode=async",
        "hetero.num_samplers=1",
        "hetero.transport=fs",
        "hetero.delay.dist=constant",
        "hetero.delay.value=1000000",
        f"hetero.wait_timeout_s={WAIT_TIMEOUT_S}",
        "trainer.total_training_steps=3",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}",
        "task.eval_size=8",
        f"task.cache_dir={CACHE_DIR}",
        f"actor_rollout_ref.model.path={toy_model_path}",
        f"hydra.run.dir={run_dir.parent / 'hydra'}",  # not outputs/<date> in the repository
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    return proc, time.monotonic() - t0, run_dir


@pytest.mark.timeout(300)
def test_learner_fails_clearly_after_the_wait_timeout(stalled_run):
    proc, elapsed, run_dir = stalled_run
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert f"waited {WAIT_TIMEOUT_S:.1f}s for 8 groups at learner_version=0" in output, output[-3000:]
    assert "Are the samplers alive, receiving weights, and (hetero.trust) enrolled?" in output
    assert "have 0 fresh groups" in output
    # it really waited (not an instant crash) and did not hang (the subprocess timeout is 240 s)
    assert elapsed >= WAIT_TIMEOUT_S
    assert not (run_dir / "checkpoints").exists(), "no step was taken, so nothing to checkpoint"


@pytest.mark.timeout(300)
def test_a_waiting_status_is_visible_before_the_timeout(stalled_run):
    proc, _, _ = stalled_run
    output = proc.stdout + proc.stderr
    status = re.search(r"waiting for rollouts.*wait_timeout_s", output, re.IGNORECASE)
    assert status is not None, "no waiting status line"
    assert status.start() < output.index("Are the samplers alive"), "the status must come before the error"
