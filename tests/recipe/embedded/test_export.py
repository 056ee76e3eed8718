"""A run directory can be evaluated: ``python -m recipe.gepo.export RUN_DIR`` writes the embedded
engine's latest checkpoint as an HF folder holding exactly the learner's weights, and
``python -m recipe.gepo.evaluate model_path=RUN_DIR`` evaluates it (exporting it if needed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recipe.gepo.export import PROVENANCE, export_run, is_run_dir, main
from recipe.gepo.main_gepo import run

from .helpers import TINY, compose_cfg

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def trained_run(tiny_model_path, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = compose_cfg(
        TINY
        + [f"actor_rollout_ref.model.path={tiny_model_path}", f"trainer.default_local_dir={run_dir}"]
        + [
            "hetero.mode=replay",
            "trainer.total_training_steps=2",
            "trainer.save_freq=1",
            "trainer.test_freq=0",
            "actor_rollout_ref.actor.optim.lr=1e-3",  # weights that visibly move from the base model
            "hetero.export_hf=final",  # the default (TINY turns it off for the other tests)
        ]
    )
    run(cfg)
    return run_dir


def test_export_writes_the_learners_weights_as_an_hf_folder(trained_run, tiny_model_path, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    assert is_run_dir(trained_run)
    assert main([str(trained_run)]) == 0
    folder = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert folder == trained_run / "hf" / "step_000002"
    assert json.loads((folder / PROVENANCE).read_text())["step"] == 2
    exported = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    saved = torch.load(trained_run / "checkpoints" / "step_000002.pt", weights_only=False)["learner"]["model"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    assert all(torch.equal(exported[name], saved[name]) for name in saved)
    assert any(not torch.equal(exported[name], base[name]) for name in saved)  # trained, not the base model
    earlier = export_run(trained_run, step=1, out=tmp_path / "step1")
    assert json.loads((earlier / PROVENANCE).read_text())["step"] == 1


def test_a_folder_without_checkpoints_is_refused_in_one_line(tmp_path, capsys):
    assert not is_run_dir(tmp_path)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "has no checkpoint" in err[0]
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_evaluate_takes_a_run_directory(trained_run, tmp_path):
    args = [
        sys.executable,
        "-m",
        "recipe.gepo.evaluate",
        f"model_path={trained_run}",
        "benchmarks=[toy]",
        "toy_n=4",
        "toy_digits=1",
        "samples_per_problem=1",
        "max_new_tokens=4",
        "device=cpu",
        f"output_dir={tmp_path / 'eval'}",
        "progress=false",
    ]
    out = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (trained_run / "hf" / "step_000002" / PROVENANCE).is_file()
    summary = json.loads(next((tmp_path / "eval").glob("*.json")).read_text())
    assert "hf/step_000002" in json.dumps(summary)


def test_training_ends_with_the_last_checkpoint_exported_and_all_exports_every_one(trained_run, capsys):
    """``hetero.export_hf=final`` (the default) left the fixture's run an HF folder of its last
    checkpoint; ``all`` adds the others; an export made from a checkpoint since rewritten (a fresh
    run in the same directory) is made again, a current one is kept."""
    from recipe.gepo.export import export_at_end

    final = trained_run / "hf" / "step_000002"
    assert (final / PROVENANCE).is_file() and not (trained_run / "hf" / "step_000001").exists()
    kept = (final / "model.safetensors").stat().st_mtime_ns
    lines = export_at_end(trained_run, "all")
    assert lines == [f"exported step {s} -> {trained_run / 'hf' / f'step_00000{s}'}" for s in (1, 2)]
    assert (final / "model.safetensors").stat().st_mtime_ns == kept  # current: not written again
    checkpoint = trained_run / "checkpoints" / "step_000001.pt"
    checkpoint.touch()  # rewritten
    export_at_end(trained_run, "all")
    provenance = json.loads((trained_run / "hf" / "step_000001" / PROVENANCE).read_text())
    assert provenance["checkpoint_mtime"] == checkpoint.stat().st_mtime
    assert export_at_end(trained_run, "none") == []


def test_a_run_without_checkpoints_or_on_megatron_says_why_nothing_was_exported(tmp_path):
    from recipe.gepo.export import export_at_end

    assert export_at_end(tmp_path, "final") == [
        "hetero.export_hf=final: no checkpoint to export (trainer.save_freq <= 0 saved none)"
    ]
    (line,) = export_at_end(tmp_path, "all", strategy="megatron")
    assert "Megatron checkpoints are not exported" in line and "model_merger" in line
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step_000003.pt").write_bytes(b"not a checkpoint")
    (line,) = export_at_end(tmp_path, "final")  # a failed export is a line, the run's files stay
    assert line.startswith("hetero.export_hf=final: step 3 not exported: ") and (tmp_path / "checkpoints").is_dir()


def test_the_dry_run_prints_a_plan_naming_data_steps_delay_bound_and_run_directory(tiny_model_path, tmp_path, capsys):
    cfg = compose_cfg(
        TINY
        + [
            f"actor_rollout_ref.model.path={tiny_model_path}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "hetero.mode=replay",
            "hetero.max_delay=5",
            "hetero.delay.dist=constant",
            "hetero.delay.value=2",
            "hetero.export_hf=all",
            "hetero.dry_run=true",
        ]
    )
    assert run(cfg) == {}
    plan = capsys.readouterr().out
    assert plan.startswith("HeteroRL embedded engine plan (dry run: nothing started)")
    assert f"model:           {tiny_model_path}" in plan
    assert "data:            toy_addition: " in plan and "mode:            replay, one process" in plan
    assert "delay (weights): constant(value=2) in steps" in plan and "staleness bound: 5 versions" in plan
    assert f"run directory:   {tmp_path / 'run'}; at the end every checkpoint becomes an HF folder" in plan
    assert not (tmp_path / "run").exists()


def test_the_report_names_the_settings_a_reader_cites(trained_run):
    report = (trained_run / "report.md").read_text()
    settings = report.split("## Settings", 1)[1].split("## Results", 1)[0]
    for row in (
        "| engine / mode | embedded engine, replay |",
        "| samplers | 1 (replay: one process) |",
        "| learning rate | 0.001 |",
        "| seed (hetero.seed) | 0 |",
        "| training steps | 2 |",
    ):
        assert row in settings, settings
    assert "| delay model | lognormal(" in settings and " in steps: median " in settings
    assert re.search(r"\| training wall time \(s, sum of step times\) \| [0-9.]+ \|", settings), settings
    assert re.search(r"\| evaluation \| \d+ problems at temperature 1.0 \|", settings), settings
    assert re.search(r"\| code commit \| ([0-9a-f]{7,}(-dirty)?|n/a) \|", settings), settings
