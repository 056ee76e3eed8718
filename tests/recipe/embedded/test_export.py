"""A run directory can be evaluated: ``python -m recipe.gepo.export RUN_DIR`` writes the embedded
engine's latest checkpoint as an HF folder holding exactly the learner's weights, and
``python -m recipe.gepo.evaluate model_path=RUN_DIR`` evaluates it (exporting it if needed)."""

from __future__ import annotations

import json
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
