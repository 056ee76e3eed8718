"""The command line as a researcher meets it (issue 51): every refusal is one ``error:`` line,
hydra leaves no ``outputs/`` folder, the default run directory names the run, a finished run is
not trained again, a run directory holding another config's run is refused, and a run ends with
a summary naming report.md and curves.png.

The fast tests compose the config as hydra does and call the command line's own functions
(:func:`~recipe.gepo.main_gepo.hydra_refusal` for what hydra refuses, :func:`run_command` for the
rest); the slow ones run ``python -m recipe.gepo.main_gepo`` itself (hydra's app cannot start in
this process: its config folder is no importable package).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import HydraException

from recipe.gepo import main_gepo

from .helpers import TINY, compose_cfg


REPO = Path(__file__).resolve().parents[3]

BAD_INPUTS = [
    # (id, overrides, text the one error line must hold)
    ("typo_without_plus", ["hetero.max_dealy=8"], "hetero.max_dealy (did you mean hetero.max_delay?)"),
    ("typo_with_plus", ["+hetero.max_dealy=8"], "hetero.max_dealy (did you mean hetero.max_delay?)"),
    ("typo_in_section", ["heteros.max_delay=8"], "heteros (did you mean hetero?)"),
    (
        "steps_not_a_number",
        ["trainer.total_training_steps=abc"],
        "trainer.total_training_steps='abc': expected an integer",
    ),
    ("delay_not_a_number", ["hetero.max_delay=abc"], "hetero.max_delay='abc': expected an integer"),
    ("missing_model", ["actor_rollout_ref.model.path=/nonexistent/heterorl-model"], "actor_rollout_ref.model.path="),
    ("unknown_preset", ["algorithm_preset=nope"], "algorithm_preset/nope"),
    ("unparsable", ["hetero.max_delay=["], "hetero.max_delay=[: hydra cannot parse"),
    ("plus_on_a_known_key", ["+hetero.max_delay=3"], "set it without the +: hetero.max_delay=3"),
]


def refusal_of(overrides: list[str], monkeypatch) -> str:
    """What the command line prints for ``overrides``: hydra's refusal or the run's, as one text."""
    monkeypatch.delenv(main_gepo.DEBUG_ENV, raising=False)
    try:
        cfg = compose_cfg(overrides)
    except HydraException as err:
        return main_gepo.refusal(main_gepo.hydra_refusal(err, overrides))
    with pytest.raises(SystemExit) as exit:
        main_gepo.run_command(cfg)
    return str(exit.value.code)


def one_error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert "Traceback" not in text, text
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, text
    return errors[0]


@pytest.mark.parametrize("overrides, expected", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_each_bad_input_is_one_error_line_and_leaves_nothing(monkeypatch, tmp_path, overrides, expected):
    monkeypatch.chdir(tmp_path)
    text = refusal_of([*TINY, "hetero.mode=replay", *overrides], monkeypatch)
    assert len(text.splitlines()) == 1
    assert expected in one_error_line(text), text
    assert list(tmp_path.iterdir()) == []  # no run directory


def test_the_default_run_directory_names_loss_mode_and_delay():
    assert compose_cfg(["hetero.mode=replay", "hetero.max_delay=8"]).trainer.default_local_dir == "runs/gepo-replay-d8"
    assert (
        compose_cfg(["algorithm_preset=gspo", "hetero.max_delay=4"]).trainer.default_local_dir == "runs/gspo-async-d4"
    )
    assert compose_cfg(["trainer.default_local_dir=/data/mine"]).trainer.default_local_dir == "/data/mine"


def test_a_finished_run_is_not_trained_again_and_another_config_is_refused(
    monkeypatch, capsys, tmp_path, tiny_model_path
):
    """Run, re-run the same command (says the run finished, exit 0, nothing trained), change a
    setting that the run directory's name does not hold (one error line), train on with more steps."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(main_gepo.DEBUG_ENV, raising=False)
    command = [
        *(o for o in TINY if not o.startswith("trainer.resume_mode")),
        f"actor_rollout_ref.model.path={tiny_model_path}",
        "hetero.mode=replay",
        "trainer.total_training_steps=2",
    ]
    run_dir = Path("runs/gepo-replay-d8")

    main_gepo.run_command(compose_cfg(command))
    out = capsys.readouterr().out
    assert "learner steps      2 of 2" in out and "held-out accuracy  " in out
    assert (
        f"report             {run_dir / 'report.md'}" in out and f"curves             {run_dir / 'curves.png'}" in out
    )
    assert (run_dir / "report.md").is_file() and (run_dir / "curves.png").is_file()
    metrics = (run_dir / "metrics.jsonl").read_text()

    main_gepo.run_command(compose_cfg(command))
    out = capsys.readouterr().out
    assert out.startswith(f"the run at {run_dir} finished at step 2 of 2")
    assert "trainer.total_training_steps=<more than 2>" in out and "trainer.resume_mode=disable" in out
    assert len(out.splitlines()) == 1
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # nothing trained, nothing logged

    with pytest.raises(SystemExit) as exit:
        main_gepo.run_command(compose_cfg([*command, "actor_rollout_ref.actor.optim.lr=0.001"]))
    line = one_error_line(str(exit.value.code))
    assert "trainer.default_local_dir='runs/gepo-replay-d8' holds a run with another config" in line
    assert "actor_rollout_ref.actor.optim.lr: 0.0001 -> 0.001" in line and "trainer.resume_mode=disable" in line

    main_gepo.run_command(compose_cfg([*command[:-1], "trainer.total_training_steps=3"]))
    out = capsys.readouterr().out
    assert f"resuming the run at {run_dir} from step 2 of 3" in out and "learner steps      3 of 3" in out


def test_the_summary_without_metrics_says_so(tmp_path):
    from recipe.gepo.run_report import closing_summary

    assert closing_summary(tmp_path) == [f"run {tmp_path}: no metrics were logged (metrics.jsonl missing)"]


def test_a_hub_id_is_left_to_the_verl_engine_and_a_folder_needs_config_json(tmp_path):
    main_gepo.check_model_path("Qwen/Qwen3-1.7B", hub_ids=True)
    with pytest.raises(main_gepo.ModelPathError, match="no such folder"):
        main_gepo.check_model_path("Qwen/Qwen3-1.7B")
    with pytest.raises(main_gepo.ModelPathError, match="no config.json"):
        main_gepo.check_model_path(str(tmp_path))


# ------------------------------------------------------------------------ the real command line


def command(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (main_gepo.DEBUG_ENV, main_gepo.HYDRA_FULL_ERROR)}
    return subprocess.run(
        [sys.executable, "-m", "recipe.gepo.main_gepo", *args],
        cwd=cwd,
        env={**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # ~15 s of imports per command
@pytest.mark.parametrize("overrides, expected", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_each_bad_input_on_the_real_command_line(tmp_path, overrides, expected):
    proc = command([*TINY, "hetero.mode=replay", *overrides], tmp_path)
    assert proc.returncode == 1
    assert expected in one_error_line(proc.stderr), proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # three commands of ~15 s each
def test_run_rerun_and_refusal_on_the_real_command_line(tmp_path, tiny_model_path):
    args = [
        *(o for o in TINY if not o.startswith("trainer.resume_mode")),
        f"actor_rollout_ref.model.path={tiny_model_path}",
        "hetero.mode=replay",
        "trainer.total_training_steps=2",
    ]
    first = command(args, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "report             runs/gepo-replay-d8/report.md" in first.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    again = command(args, tmp_path)
    assert again.returncode == 0 and "finished at step 2 of 2" in again.stdout, again.stderr[-3000:]
    other = command([*args, "actor_rollout_ref.actor.optim.lr=0.001"], tmp_path)
    assert other.returncode == 1
    assert "holds a run with another config" in one_error_line(other.stderr)


def test_a_typo_or_a_bad_value_is_refused_before_torch_or_verl_is_imported(tmp_path):
    """The command line's checks of keys, types and the project's sections run first: a refusal
    comes in a few seconds, not after the ~10 s of importing verl (torch, tensordict)."""
    probe = (
        "import sys\n"
        "from recipe.gepo.main_gepo import cli\n"
        "for argv in (['hetero.max_dealy=3'], ['task.digits=abc']):\n"
        "    sys.argv = ['main_gepo', *argv]\n"
        "    try:\n"
        "        cli()\n"
        "    except SystemExit as exit_:\n"
        "        print(exit_.code)\n"
        "print('imported:', sorted({'verl', 'torch'} & set(sys.modules)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != main_gepo.DEBUG_ENV}
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[-1] == "imported: []", out.stdout + out.stderr[-2000:]
    assert [line.split(":")[0] for line in lines[:-1]] == ["error"] * 2, out.stdout
    assert "did you mean hetero.max_delay?" in lines[0] and "task.digits='abc'" in lines[1]
