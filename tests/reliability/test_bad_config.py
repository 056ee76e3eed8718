"""Bad configuration fails in ``run(cfg)`` before any work: no run directory, no Ray, no model,
and an error that names the offending key and value.

(``HeteroConfig`` field validation alone is tested in tests/recipe/test_hetero_config.py;
here the whole entry point is driven, which is what a user runs.)
"""

import subprocess
import sys
import time

import pytest
import ray

from recipe.gepo.main_gepo import run

from .conftest import REPO, compose_trainer


def run_must_fail_early(tmp_path, overrides, match):
    run_dir = tmp_path / "run"
    # if validation let the value through, keep the accidental run tiny
    guard = [o for o in ("trainer.total_training_steps=1", "task.eval_size=4") if o.split("=")[0] not in str(overrides)]
    cfg = compose_trainer(*overrides, *guard, f"trainer.default_local_dir={run_dir}")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=match):
        run(cfg)
    assert time.monotonic() - t0 < 10, "validation must not wait for anything"
    assert not run_dir.exists(), "the run directory was created before the config was validated"
    assert not ray.is_initialized(), "Ray was started before the config was validated"


@pytest.mark.parametrize(
    "overrides, match",
    [
        # negative delays, in each delay model that takes one
        (["hetero.delay.low=-1"], r"hetero\.delay: lognormal: low=-1"),
        (
            ["hetero.delay.dist=weibull", "hetero.delay.low=-3", "hetero.delay.high=4"],
            r"hetero\.delay: weibull: low=-3",
        ),
        (["hetero.delay.dist=constant", "hetero.delay.value=-0.5"], r"hetero\.delay: constant: value=-0.5"),
        # low > high
        (["hetero.delay.low=5", "hetero.delay.high=2"], r"low=5.*high=2"),
        (["hetero.max_delay=-1"], r"hetero\.max_delay=-1"),
        (["hetero.wait_timeout_s=0"], r"hetero\.wait_timeout_s=0"),
        # group size 1 with a group-normalised estimator (the default gepo preset uses grpo's)
        (["actor_rollout_ref.rollout.n=1"], r"rollout\.n=1.*'grpo'"),
        (["actor_rollout_ref.rollout.n=1", "algorithm_preset=grpo"], r"rollout\.n=1.*'grpo'"),
        (["actor_rollout_ref.rollout.n=1", "algorithm_preset=bnpo"], r"rollout\.n=1.*'bnpo'"),
        # a batch of no whole groups (the local engine counts the batch in prompt groups)
        (["data.train_batch_size=0"], r"data\.train_batch_size=0"),
        (["trainer.total_training_steps=0"], r"trainer\.total_training_steps=0"),
        (["actor_rollout_ref.rollout.temperature=0"], r"temperature=0"),
        (["hetero.mode=sometimes"], r"hetero\.mode='sometimes'"),
        # verl optimizer schedules the embedded learner does not run
        (["actor_rollout_ref.actor.optim.lr_warmup_steps=20"], r"optim\.lr_warmup_steps=20"),
        (["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"], r"optim\.lr_scheduler_type='cosine'"),
    ],
)
def test_bad_value_fails_before_any_work_naming_it(tmp_path, overrides, match):
    run_must_fail_early(tmp_path, overrides, match)


def test_unknown_loss_mode_fails_before_any_work(tmp_path):
    # replay mode: if it is not caught early, the accidental run stays in-process and short
    run_must_fail_early(
        tmp_path, ["actor_rollout_ref.actor.policy_loss.loss_mode=not_a_loss", "hetero.mode=replay"], r"not_a_loss"
    )


def test_unknown_preset_on_the_command_line_names_it_and_creates_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "recipe.gepo.main_gepo",
            "algorithm_preset=not_an_algorithm",
            f"trainer.default_local_dir={run_dir}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "algorithm_preset/not_an_algorithm" in output, output[-2000:]
    assert "gepo" in output and "grpo" in output, "the error should list the available presets"
    assert not run_dir.exists()
