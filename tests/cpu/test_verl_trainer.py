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
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from verl_ext.rundir import read_metric_rows

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_PLATFORM")}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _stock_main_ppo(tmp_path, *overrides: str, preset: str = "cpu_toy") -> str:
    """verl's own ``main_ppo`` on the toy assets with a CPU preset, colocated (sync) mode."""
    from verl_ext.data.toy_assets import prepare_toy_assets

    assets = prepare_toy_assets(tmp_path / "toy", n_train=64, n_val=8)
    proc = _run(
        [
            sys.executable,
            "-m",
            "verl.trainer.main_ppo",
            "--config-dir",
            "configs",
            f"+verl_preset={preset}",
            f"actor_rollout_ref.model.path={assets.model_path}",
            f"data.train_files={assets.train_file}",
            f"data.val_files={assets.val_file}",
            "actor_rollout_ref.hybrid_engine=true",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=naive",
            "trainer.total_training_steps=2",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            *overrides,
        ],
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def test_verl_stock_main_ppo_trains_ppo_with_a_critic(tmp_path):
    """PPO/GAE: a critic (value model, loaded with sdpa on the CPU) trains beside the actor."""
    out = _stock_main_ppo(tmp_path, "algorithm.adv_estimator=gae")
    losses = [float(v) for v in re.findall(r"critic/vf_loss:([-0-9.e]+)", out)]
    assert len(losses) == 2 and all(0 < v < 10 for v in losses), out[-4000:]


def test_verl_stock_main_ppo_trains_gepo_for_two_steps(tmp_path):
    out = _stock_main_ppo(
        tmp_path, "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=gepo"
    )
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
            sys.executable,
            "-m",
            "recipe.gepo.main_gepo",
            "--config-dir",
            "configs",
            "+verl_preset=cpu_toy",
            "hetero.engine=verl",
            "trainer.total_training_steps=10",
            "hetero.delay.dist=constant",
            "hetero.delay.value=2.5",
            "hetero.max_delay=3",
            f"trainer.default_local_dir={run_dir}",
            f"task.cache_dir={ROOT / '.cache' / 'heterorl'}",
        ],
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = read_metric_rows(run_dir)
    train = [r for r in rows if "hetero/staleness_max" in r]
    assert [r["step"] for r in train] == list(range(1, 11))
    assert max(r["hetero/staleness_max"] for r in train) <= 3  # the exact bound over weight versions
    versions = [r["hetero/sampler_weight_version"] for r in train]
    assert versions[-1] > 0, versions  # delayed versions did reach the samplers
    assert all(r["is/group_log_denominator_mean"] < 0 for r in train)  # driver-side GEPO denominators
    assert all(r["actor/has_group_denominator"] == 1.0 for r in train)
    assert all(r["reward/mean"] == r["critic/score/mean"] for r in train)  # the embedded engine's name too
    assert (run_dir / "report.md").is_file() and (run_dir / "curves.png").is_file()
    placement = json.loads((run_dir / "placement.json").read_text())  # one node here: this machine
    assert [n["hostname"] for n in placement["learner"] + placement["samplers"]] == [socket.gethostname()] * 2
    assert "[hetero] placement: samplers: 1 process(es) on" in out


def _main_gepo(run_dir: Path, steps: int, *overrides: str) -> list[dict]:
    proc = _run(
        [
            sys.executable,
            "-m",
            "recipe.gepo.main_gepo",
            "--config-dir",
            "configs",
            "+verl_preset=cpu_toy",
            "hetero.engine=verl",
            f"trainer.total_training_steps={steps}",
            f"trainer.default_local_dir={run_dir}",
            f"task.cache_dir={ROOT / '.cache' / 'heterorl'}",
            *overrides,
        ],
        timeout=900,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return read_metric_rows(run_dir)


def _export_keeps_float32_and_agrees_with_verls_merger(actor_dir: Path, tmp_path: Path) -> None:
    """recipe.gepo.verl_engine.fsdp_export of a real checkpoint: float32 weights that moved away from the
    starting model, equal to verl's own merger's output once rounded to bfloat16 as verl rounds."""
    import torch
    from safetensors.torch import load_file

    from recipe.gepo.verl_engine.fsdp_export import export

    ours = load_file(export(actor_dir, tmp_path / "export") / "model.safetensors")
    proc = _run(
        [
            sys.executable,
            "-m",
            "verl.model_merger",
            "merge",
            "--backend",
            "fsdp",
            "--local_dir",
            str(actor_dir),
            "--target_dir",
            str(tmp_path / "verl_merged"),
        ],
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    theirs = load_file(tmp_path / "verl_merged" / "model.safetensors")
    assert set(theirs) <= set(ours) and theirs
    assert all(t.dtype == torch.float32 for t in ours.values())
    for key, tensor in theirs.items():
        assert torch.equal(ours[key].bfloat16(), tensor), key
    assert any(not torch.equal(t, t.bfloat16().float()) for t in ours.values())  # float32 kept, not rounded


def test_delays_follow_the_model_and_a_resumed_run_loses_no_step(tmp_path):
    """Delayed sync observed in a real run: every pushed version's delay is the delay model's draw
    for it (same seed, same stream as replay mode), the samplers got it no earlier than that and
    at most one step (plus polling) later. Then the run crashes after step 4 with its last
    checkpoint at step 2 (simulated: checkpoint 4 removed) and resumes: steps 3-4 are trained and
    logged again, every step from 1 to 6 appears once, and steps 1-2 are untouched."""
    from verl_ext.hetero.delay import DelaySchedule, make_delay_model
    from verl_ext.hetero.seeding import sampler_stream

    run_dir = tmp_path / "run"
    delay = ["hetero.delay.dist=lognormal", "hetero.delay.low=0.3", "hetero.delay.high=2.0", "hetero.seed=3"]
    first = _main_gepo(run_dir, 4, "trainer.save_freq=2", *delay)
    assert [r["step"] for r in first if "actor/pg_loss" in r] == [1, 2, 3, 4]
    # hetero.export_hf=final (the default): the run ends with its last checkpoint as an HF folder
    provenance = json.loads((run_dir / "hf" / "step_000004" / "heterorl_export.json").read_text())
    assert provenance["step"] == 4 and provenance["checkpoint"].endswith("global_step_4/actor")

    _export_keeps_float32_and_agrees_with_verls_merger(run_dir / "global_step_4" / "actor", tmp_path)

    import shutil

    shutil.rmtree(run_dir / "global_step_4")
    (run_dir / "latest_checkpointed_iteration.txt").write_text("2")
    rows = _main_gepo(run_dir, 6, "trainer.save_freq=2", *delay)
    train = [r for r in rows if "actor/pg_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert train[:2] == [r for r in first if "actor/pg_loss" in r][:2]  # nothing produced before the checkpoint lost

    schedule = DelaySchedule(make_delay_model("lognormal", low=0.3, high=2.0, confidence=0.995, offset=0.0), seed=3)
    step_time = max(r["timing_s/step"] for r in first + train if "timing_s/step" in r)
    pushed = lambda rows: {int(r["hetero/sync_pushed_version"]): r for r in rows if "hetero/sync_pushed_version" in r}
    resumed = pushed(train[2:])
    # the resumed weights (version 2) go to the samplers at once, as the initial weights do
    assert resumed[2]["hetero/sync_drawn_delay"] == 0.0
    pushes = [(v, r) for v, r in pushed(first).items() if v > 0] + [(v, r) for v, r in resumed.items() if v > 2]
    assert pushes, "no delayed version reached the samplers"
    for version, r in pushes:
        assert r["hetero/sync_drawn_delay"] == pytest.approx(schedule.delay(version, sampler_stream(0)), rel=1e-9)
        late = r["hetero/sync_observed_delay"] - r["hetero/sync_drawn_delay"]
        assert 0.0 <= late <= step_time + 1.0, (version, r)


def test_hetero_engine_verl_trains_with_entropy_and_kl_to_reference_and_evaluates(tmp_path):
    """actor.entropy_coeff and actor.use_kl_loss reach the verl engine's objective: verl builds the
    reference model (forward-only FSDP2, its memory unpinned on the CPU) and the KL term starts
    at 0 (learner = reference) and grows once the learner has moved. verl's validation (before
    training and at the last step) lands in metrics.jsonl under the embedded engine's names too
    (``eval/acc_mean``, ``eval/<data_source>/acc``) and so in report.md."""
    run_dir = tmp_path / "run"
    rows = _main_gepo(
        run_dir,
        2,
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "trainer.val_before_train=true",
        "trainer.test_freq=2",
        "task.eval_size=8",
    )
    train = [r for r in rows if "actor/pg_loss" in r]
    assert [r["actor/kl_loss"] for r in train][0] == pytest.approx(0.0, abs=1e-6)
    assert train[1]["actor/kl_loss"] > 1e-4
    assert all(r["actor/entropy_loss"] > 0 for r in train)
    # verl's kl_loss / kl_coef from the loss, prefixed by verl's trainer (docs/algorithms.md)
    assert all(r["actor/kl_coef"] == pytest.approx(0.001) and "kl_coef" not in r and "kl_loss" not in r for r in train)

    evals = [r for r in rows if "eval/acc_mean" in r]
    assert [r["step"] for r in evals] == [0, 2]  # the initial validation and the last step's
    for r in evals:  # verl's key (one greedy sample per prompt: mean@1) and ours, the same number
        assert 0.0 <= r["eval/acc_mean"] <= 1.0
        assert r["eval/acc_mean"] == r["eval/toy_add3/acc"] == r["val-core/toy_add3/acc/mean@1"]
    md = (run_dir / "report.md").read_text()
    assert "`eval/acc_mean` (2 evaluations)" in md and "| toy_add3 | 2 |" in md
