"""What a run leaves outside its run directory and takes from the environment:
TensorBoard events go into the run directory (or ``$TENSORBOARD_DIR``), never the working
directory; the user's ``OMP_NUM_THREADS`` is respected."""

from __future__ import annotations

import os

import pytest
import torch

from recipe.gepo.embedded.run_log import MetricLogger, RunSettings
from recipe.gepo.main_gepo import run
from verl_ext.torch_threads import default_threads, set_torch_threads

from .helpers import read_metrics

TWO_STEPS = ("hetero.mode=replay", "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.save_freq=2")


def events(folder) -> list:
    return sorted(folder.rglob("events.out.tfevents.*"))


@pytest.fixture
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_tensorboard_events_go_to_the_run_dir_not_the_cwd(tiny_cfg, tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    cwd, run_dir = tmp_path / "cwd", tmp_path / "run"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    run(tiny_cfg(run_dir, *TWO_STEPS, "trainer.logger=[console,tensorboard]"))
    assert [line["step"] for line in read_metrics(run_dir)] == [0, 1, 2]
    assert events(run_dir / "tensorboard"), "no TensorBoard events beside metrics.jsonl"
    assert not events(cwd) and not (cwd / "tensorboard_log").exists()
    assert "TENSORBOARD_DIR" not in os.environ  # set only while verl's Tracking starts


def test_a_users_tensorboard_dir_wins(tiny_cfg, tmp_path, monkeypatch):
    mine = tmp_path / "mine"
    monkeypatch.setenv("TENSORBOARD_DIR", str(mine))
    cfg = tiny_cfg(tmp_path / "run", "trainer.logger=[tensorboard]")
    logger = MetricLogger(tmp_path / "run", RunSettings.from_config(cfg), cfg)
    logger.log({"x": 1.0}, step=1)
    logger.close()
    assert events(mine) and not (tmp_path / "run" / "tensorboard").exists()
    assert os.environ["TENSORBOARD_DIR"] == str(mine)


def test_run_respects_omp_num_threads(tiny_cfg, tmp_path, monkeypatch, keep_torch_threads):
    # 3: what the user asked for, and more than the 2 the entry point used to force on any machine
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)  # what torch reads from OMP_NUM_THREADS when it starts
    run(tiny_cfg(tmp_path, *TWO_STEPS))
    assert [line["step"] for line in read_metrics(tmp_path)] == [0, 1, 2]
    assert torch.get_num_threads() == 3


def test_threads_default_without_omp_num_threads(monkeypatch, keep_torch_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(1)
    assert set_torch_threads(2) == default_threads(2) == max(1, min(2, os.cpu_count() or 1))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert set_torch_threads(2) == default_threads(2)  # left alone: torch keeps what it has
    torch.set_num_threads(1)
    assert set_torch_threads(2) == 1
