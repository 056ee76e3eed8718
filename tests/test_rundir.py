"""The run directory has one owner: both engines write metrics.jsonl through
``verl_ext.rundir`` and every reader parses it there."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from recipe.gepo.embedded.run_log import MetricLogger, RunSettings
from verl_ext import rundir

METRICS = {
    "a": 1,
    "b": np.float32(0.5),
    "c": torch.tensor(2.0),
    "flag": True,
    "nan": float("nan"),
    "inf": float("inf"),
    "text": "0.5",
    "none": None,
    "vec": [1.0, 2.0],
}
WRITTEN = {"step": 3, "a": 1.0, "b": 0.5, "c": 2.0, "flag": 1.0}


def settings(run_dir) -> RunSettings:
    cfg = OmegaConf.create(
        {
            "actor_rollout_ref": {"model": {"path": ""}, "rollout": {"n": 2, "temperature": 1.0}},
            "data": {"train_batch_size": 1, "max_response_length": 4},
            "trainer": {
                "total_training_steps": 1,
                "default_local_dir": str(run_dir),
                "save_freq": 0,
                "test_freq": 0,
                "resume_mode": "disable",
                "logger": [],
                "project_name": "p",
                "experiment_name": "e",
            },
        }
    )
    return RunSettings.from_config(cfg)


def test_both_engines_write_the_same_line(tmp_path):
    from verl.utils.tracking import Tracking

    from recipe.gepo.verl_engine.trainer import MetricsTee

    embedded = MetricLogger(tmp_path / "embedded", settings(tmp_path / "embedded"))
    embedded.log(METRICS, step=3)
    embedded.close()
    tee = MetricsTee(Tracking(project_name="p", experiment_name="e", default_backend=[]), tmp_path / "verl")
    tee.log(METRICS, step=3)
    lines = [(tmp_path / d / "metrics.jsonl").read_text() for d in ("embedded", "verl")]
    assert lines[0] == lines[1] == json.dumps(WRITTEN) + "\n"
    assert rundir.read_metric_rows(tmp_path / "verl") == [WRITTEN]


def test_a_checkpoint_counts_for_resume_only_once_its_metrics_line_is_written(tmp_path):
    """verl saves step k's checkpoint before logging step k: the tee moves verl's tracker to k
    only after k's line is in metrics.jsonl (a crash in between resumes from the checkpoint before)."""
    from verl.utils.tracking import Tracking

    from recipe.gepo.verl_engine.trainer import TRACKER_FILE, MetricsTee

    tee = MetricsTee(Tracking(project_name="p", experiment_name="e", default_backend=[]), tmp_path)
    tracker = tmp_path / TRACKER_FILE
    tracker.write_text("5")  # the previous checkpoint, as the trainer leaves it while saving step 10
    tee.commit_after(10, tracker)
    tee.log(METRICS, step=9)  # a late line of another step: no commit
    assert tracker.read_text() == "5"
    tee.log(METRICS, step=10)
    assert tracker.read_text() == "10" and rundir.read_metric_rows(tmp_path)[-1]["step"] == 10
    tee.log(METRICS, step=11)
    assert tracker.read_text() == "10"  # committed once


def test_truncate_keeps_the_original_lines_up_to_the_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "x": 1}\n{"step": 1, "x": 2.50}\nnot json\n{"step": 2, "x": 3}\n{"step": 1, "y"')
    rundir.truncate_metrics(path, after_step=1)
    assert path.read_text() == '{"step": 0, "x": 1}\n{"step": 1, "x": 2.50}\n'
    rundir.truncate_metrics(tmp_path / "absent.jsonl", 0)  # no file: nothing to do
    assert not (tmp_path / "absent.jsonl").exists()


def test_row_reader_and_frame_reader_agree_and_name_bad_lines(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 0, "x": 1}\n[1]\n{"step": 1, "x": "0.5"}\n{"step": 1, "e": 0.25}\n{"step": "a"}\n{"step": 2, "x"'
    )
    with pytest.warns(
        UserWarning, match=r"skipped 3 unreadable line\(s\): line 2: not a JSON object.*line 6: truncated"
    ):
        rows = rundir.read_metric_rows(tmp_path)
    assert rows == [{"step": 0, "x": 1.0}, {"step": 1, "x": 0.5}, {"step": 1, "e": 0.25}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        df = rundir.load_metrics(tmp_path)
    assert df["step"].tolist() == [0, 1] and df["x"].tolist() == [1.0, 0.5]
    assert df.attrs["skipped_lines"] == [2, 5, 6]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a live run's torn line, polled: no warning asked for
        assert rundir.read_metric_rows(tmp_path / "metrics.jsonl", warn=False) == rows
    assert rundir.read_metric_rows(tmp_path / "nowhere", missing_ok=True) == []
    with pytest.raises(rundir.RunDirError, match="nowhere"):
        rundir.read_metric_rows(tmp_path / "nowhere")


def test_checkpoint_round_trip_and_latest_pointer(tmp_path):
    assert rundir.load_latest_checkpoint(tmp_path) is None and rundir.latest_checkpoint_step(tmp_path) == 0
    rundir.save_checkpoint(tmp_path, 1, {"step": 1, "w": torch.ones(2)})
    path = rundir.save_checkpoint(tmp_path, 2, {"step": 2, "w": torch.zeros(2)})
    assert (tmp_path / "checkpoints" / "latest").read_text() == path.name == "step_000002.pt"
    assert rundir.latest_checkpoint_step(tmp_path) == 2
    state = rundir.load_latest_checkpoint(tmp_path)
    assert state["step"] == 2 and torch.equal(state["w"], torch.zeros(2))
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_run_config_round_trip(tmp_path):
    cfg = OmegaConf.create(
        {
            "actor_rollout_ref": {"actor": {"policy_loss": {"loss_mode": "gepo"}}},
            "hetero": {"max_delay": 8, "seed": "${seed}"},
            "seed": 3,
        }
    )
    assert rundir.write_run_config(tmp_path, cfg) == tmp_path / "config.yaml"
    assert rundir.read_run_config(tmp_path) == {"loss_mode": "gepo", "max_delay": 8, "preset": None, "seed": 3}


def test_config_leaves_flattens_skips_and_resume_sees_an_empty_mapping_change(tmp_path):
    tree = {"a": {"b": 1, "c": {"d": [1, 2]}, "_target_": "x"}, "e": {}, "f": None}
    assert dict(rundir.config_leaves(tree, skip=("_target_",))) == {"a.b": 1, "a.c.d": [1, 2], "f": None}
    assert dict(rundir.config_leaves(tree, keep_empty=True))["e"] == {}
    # a checkpointed run's empty mapping filled, or dropped, is a change resume refuses
    rundir.write_run_config(tmp_path, OmegaConf.create(tree))
    changed = rundir.resume_config_changes(tmp_path, OmegaConf.create({**tree, "e": {"g": 2}}))
    assert changed == [("e", {}, "<not set>"), ("e.g", "<not set>", 2)]
    dropped = {k: v for k, v in tree.items() if k != "e"}
    assert rundir.resume_config_changes(tmp_path, OmegaConf.create(dropped)) == [("e", {}, "<not set>")]


def test_one_jsonl_reader_marks_a_torn_tail_even_when_it_parses(tmp_path):
    """Metrics, events and evaluation records all read through ``iter_jsonl``: a last line without
    its newline is incomplete (the evaluation drops it; metrics keep it if it parses), a broken
    middle line is an error, and a torn unparsable tail says so."""
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\nnot json\n{"b": 2}')
    lines = list(rundir.iter_jsonl(path))
    assert [(ln.lineno, ln.complete, bool(ln.error)) for ln in lines] == [
        (1, True, False),
        (2, True, True),
        (3, False, False),
    ]
    assert lines[1].error.startswith("invalid JSON") and lines[2].value == {"b": 2}
    path.write_text('{"a": 1}\n{"b": ')
    assert list(rundir.iter_jsonl(path))[-1].error == "truncated last line"


def test_changed_settings_is_one_rule_for_every_resume_check():
    old, new = {"a": 1, "b": 2, "seed": 3}, {"a": 1, "b": 5, "c": 0, "seed": 4}
    assert rundir.changed_settings(old, new, may_change=("se*",)) == [("b", 2, 5), ("c", "<not set>", 0)]
    assert rundir.describe_changes([("k", i, i + 1) for i in range(10)], limit=2) == "k: 0 -> 1; k: 1 -> 2 and 8 more"
