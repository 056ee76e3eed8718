"""research/study/smollm2_learning.py report: per-seed first/last-window means of the reward (metrics.jsonl)
and of accuracy and boxed rate (the rollout dumps scored again by the math reward), and the verdict
rule (every seed's rise above the seed-to-seed spread of the first-window means)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "research" / "study" / "smollm2_learning.py"


@pytest.fixture
def learning(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("smollm2_learning", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["smollm2_learning"] = module
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "RUNS", tmp_path)
    return module


def _fake_run(out: Path, rewards: list[float], boxed_from: int) -> None:
    """A run dir: reward/mean per step; each step's dump has 2 responses, boxed (and one correct)
    from step ``boxed_from`` on."""
    (out / "rollouts").mkdir(parents=True)
    lines = [json.dumps({"step": i + 1, "reward/mean": r}) for i, r in enumerate(rewards)]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    for step in range(1, len(rewards) + 1):
        good = step >= boxed_from
        samples = [
            {"output": "so \\boxed{5}" if good else "so 5", "gts": "5", "step": step},
            {"output": "so \\boxed{7}" if good else "so 7", "gts": "5", "step": step},
        ]
        (out / "rollouts" / f"{step}.jsonl").write_text("\n".join(json.dumps(s) for s in samples) + "\n")


def test_a_rise_beyond_the_seed_spread_is_reported_as_such(learning, tmp_path, capsys):
    _fake_run(tmp_path / "smollm2_gepo_s0", [0.0, 0.0, 0.1, 0.1], boxed_from=3)
    _fake_run(tmp_path / "smollm2_gepo_s1", [0.01, 0.0, 0.2, 0.2], boxed_from=3)
    assert learning.report([0, 1], window=2, out_png=tmp_path / "fig.png") == 0
    out = capsys.readouterr().out
    assert "| 0 | 4 | 0.000 | 0.100 | +0.100 | 0.00 -> 1.00 | 0.000 -> 0.500 |" in out
    assert "spread of the first-2 means: 0.005; every seed's rise above it: yes" in out
    assert (tmp_path / "fig.png").stat().st_size > 0


def test_no_rise_and_no_run_are_named(learning, tmp_path, capsys):
    _fake_run(tmp_path / "smollm2_gepo_s0", [0.1, 0.0, 0.0, 0.0], boxed_from=9)
    _fake_run(tmp_path / "smollm2_gepo_s1", [0.0, 0.0, 0.05, 0.0], boxed_from=9)
    assert learning.report([0, 1], window=2, out_png=None) == 0
    assert "every seed's rise above it: no" in capsys.readouterr().out
    assert learning.report([7], window=2, out_png=None) == 2
    assert "no run of seeds [7]" in capsys.readouterr().err


def test_evaluation_scores_and_the_checkpoint_the_tracker_names(learning, tmp_path):
    records = [
        {"benchmark": "math500", "acc": 0.0, "error": "no_boxed"},
        {"benchmark": "math500", "acc": 1.0, "error": None},
        {"benchmark": "gsm8k", "acc": 0.0, "error": "wrong"},
        {"benchmark": "gsm8k", "acc": 0.0, "error": "no_answer"},
        {"benchmark": "gsm8k", "acc": 1.0, "error": None},
        {"benchmark": "gsm8k", "acc": 0.0, "error": "no_boxed"},
    ]
    (tmp_path / "records.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    assert learning.eval_scores(tmp_path) == (0.5, 0.25, 0.5, 0.5)

    run = tmp_path / "smollm2_gepo_s3"
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        learning.last_checkpoint(run)
    run.mkdir()
    (run / "latest_checkpointed_iteration.txt").write_text("25\n")
    assert learning.last_checkpoint(run) == run / "global_step_25" / "actor"
