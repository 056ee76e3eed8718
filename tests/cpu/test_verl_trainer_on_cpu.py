"""verl's own trainer, run for real on this CPU machine (slow: each run starts Ray and verl's
workers, 60-90 s). Run with ``make test-all`` or ``pytest -m slow tests/cpu``.

- verl's stock ``main_ppo`` with the project's plugin and ``loss_mode=gepo`` (``make verl-smoke``).
- ``hetero.engine=verl`` end to end through ``main_gepo``, in the setting that used to stall for
  good (constant 2.5 s weight delay, ~0.4 s steps, staleness bound 3): delayed versions must come
  due while the learner waits, the bound must hold, and the run directory must hold the same
  metrics.jsonl / report.md / curves.png as the embedded engine's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_PLATFORM")}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_verl_stock_main_ppo_trains_gepo_for_two_steps(tmp_path):
    from verl_ext.data.toy_assets import prepare_toy_assets

    assets = prepare_toy_assets(tmp_path / "toy", n_train=64, n_val=8)
    proc = _run(
        [
            sys.executable, "-m", "verl.trainer.main_ppo", "--config-dir", "configs", "+verl_preset=cpu_toy",
            f"actor_rollout_ref.model.path={assets.model_path}", f"data.train_files={assets.train_file}",
            f"data.val_files={assets.val_file}", "actor_rollout_ref.hybrid_engine=true",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=naive", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.policy_loss.loss_mode=gepo", "trainer.total_training_steps=2",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
        timeout=900,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    steps = re.findall(r"step:(\d+) - .*", out)
    assert steps[:2] == ["1", "2"], out[-4000:]
    step2 = re.search(r"step:2 - (.*)", out).group(1)
    # the project's loss ran (its is/* metrics), on the sampler's own log-probs (p == q on-policy)
    assert "actor/is/weight_var" in step2 and "actor/is/ess" in step2
    corr = float(re.search(r"training/rollout_actor_probs_pearson_corr:([0-9.]+)", step2).group(1))
    assert corr > 0.99


def test_hetero_engine_verl_does_not_stall_and_keeps_the_bound(tmp_path):
    run_dir = tmp_path / "run"
    proc = _run(
        [
            sys.executable, "-m", "recipe.gepo.main_gepo", "--config-dir", "configs", "+verl_preset=cpu_toy",
            "hetero.engine=verl", "trainer.total_training_steps=10", "hetero.delay.dist=constant",
            "hetero.delay.value=2.5", "hetero.max_delay=3", f"trainer.default_local_dir={run_dir}",
            f"task.cache_dir={ROOT / '.cache' / 'heterorl'}",
        ],
        timeout=900,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "hetero/staleness_max" in r]
    assert [r["step"] for r in train] == list(range(1, 11))
    assert max(r["hetero/staleness_max"] for r in train) <= 3  # the exact bound over weight versions
    versions = [r["hetero/sampler_weight_version"] for r in train]
    assert versions[-1] > 0, versions  # delayed versions did reach the samplers
    assert all(r["is/group_log_denominator_mean"] < 0 for r in train)  # driver-side GEPO denominators
    assert all(r["actor/has_group_denominator"] == 1.0 for r in train)
    assert (run_dir / "report.md").is_file() and (run_dir / "curves.png").is_file()
