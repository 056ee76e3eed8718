"""Replay mode end to end (in-process ``main_gepo.run``): the staleness bound, the metric names,
resume equal to an uninterrupted run."""

from __future__ import annotations

import json
import math

import pytest

from recipe.gepo.main_gepo import run

from .helpers import STEP_METRICS, read_metrics, train_lines

MAX_DELAY = 4
STEPS = 8
PROMPTS = 2  # data.train_batch_size in the tiny config

# timing-dependent metrics: the only ones allowed to differ between two runs of the same seed
TIMING = ("perf/", "hetero/wait_s")


def test_replay_staleness_is_positive_and_bounded(tiny_cfg, tmp_path):
    # delay low=3 high=12 (steps, median 6): most draws exceed max_delay=4 and must be capped
    cfg = tiny_cfg(
        tmp_path,
        "hetero.mode=replay",
        f"hetero.max_delay={MAX_DELAY}",
        "hetero.delay.low=3",
        "hetero.delay.high=12",
        f"trainer.total_training_steps={STEPS}",
        "trainer.test_freq=4",
    )
    final = run(cfg)

    lines = read_metrics(tmp_path)
    assert [line["step"] for line in lines] == list(range(STEPS + 1))
    steps = train_lines(lines)
    for line in steps:
        step = line["step"]
        missing = [name for name in STEP_METRICS if name not in line]
        assert not missing, f"step {step}: missing {missing}"
        # the logger drops non-finite values, so presence + isfinite = a finite loss
        assert math.isfinite(line["actor/loss"]) and math.isfinite(line["actor/grad_norm"])
        assert 0 <= line["hetero/staleness_max"] <= MAX_DELAY
        # version k-1 is the newest; at step k only versions 0..k-1 exist
        assert line["hetero/staleness_max"] <= step - 1
        hist = {k: v for k, v in line.items() if k.startswith("hetero/staleness_hist/")}
        assert sorted(int(k.rsplit("/", 1)[1]) for k in hist) == list(range(MAX_DELAY + 1))
        assert sum(hist.values()) == PROMPTS == line["hetero/consumed"]
        observed = [int(k.rsplit("/", 1)[1]) for k, v in hist.items() if v > 0]
        assert max(observed) == line["hetero/staleness_max"] and min(observed) == line["hetero/staleness_min"]
        assert line["hetero/dropped"] == 0  # replay generates exactly what it consumes
        assert line["training/policy_version"] == step
        if line["hetero/staleness_max"] == 0:
            # on-policy: the sampler snapshot is the current model, p == q
            assert line["is/kl_sampler_learner"] < 1e-6
    assert max(line["hetero/staleness_max"] for line in steps) > 0
    assert max(line["hetero/staleness_max"] for line in steps) == MAX_DELAY  # capped draws sit at the bound
    stale = [line["is/kl_sampler_learner"] for line in steps if line["hetero/staleness_min"] > 0]
    assert stale and max(stale) > 1e-6  # off-policy batches: the learner has moved away from q

    evals = [line["step"] for line in lines if "eval/toy/acc" in line]
    assert evals == [0, 4, 8]
    assert all(0.0 <= line["eval/toy/acc"] <= 1.0 for line in lines if "eval/toy/acc" in line)
    assert final["training/policy_version"] == STEPS
    for name in ("config.yaml", "report.md", "curves.png", "checkpoints/latest"):
        assert (tmp_path / name).exists(), name


def _comparable(line: dict) -> dict:
    return {k: v for k, v in line.items() if not k.startswith(TIMING)}


def test_resume_equals_uninterrupted_run(tiny_cfg, tmp_path):
    k = 3
    common = (
        "hetero.mode=replay",
        f"hetero.max_delay={MAX_DELAY}",
        "hetero.delay.low=1",
        "hetero.delay.high=6",
        f"trainer.save_freq={k}",
        f"trainer.test_freq={k}",
    )
    run(tiny_cfg(tmp_path / "a", *common, f"trainer.total_training_steps={2 * k}"))
    run(tiny_cfg(tmp_path / "b", *common, f"trainer.total_training_steps={k}"))
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text().strip() == f"step_{k:06d}.pt"
    run(tiny_cfg(tmp_path / "b", *common, f"trainer.total_training_steps={2 * k}", "trainer.resume_mode=auto"))

    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [line["step"] for line in b] == list(range(2 * k + 1)), "each step logged exactly once"
    assert [line["step"] for line in a] == [line["step"] for line in b]
    # the resumed half must have been trained off-policy, or the test would not exercise the
    # restored snapshot ring
    assert max(line["hetero/staleness_max"] for line in b[k + 1 :]) > 0
    for la, lb in zip(a, b):
        ca, cb = _comparable(la), _comparable(lb)
        assert ca.keys() == cb.keys(), f"step {la['step']}: {sorted(ca.keys() ^ cb.keys())}"
        for name in ca:
            assert cb[name] == pytest.approx(ca[name], rel=1e-6, abs=1e-6), f"step {la['step']}: {name}"


@pytest.mark.slow  # ~6 s; the set-aside of a fresh run is checked by default through its checkpoint pointer
def test_fresh_run_in_used_dir_keeps_old_metrics_beside(tiny_cfg, tmp_path):
    for _ in range(2):
        run(tiny_cfg(tmp_path, "hetero.mode=replay", "trainer.total_training_steps=2", "trainer.test_freq=0"))
    assert [line["step"] for line in read_metrics(tmp_path)] == [0, 1, 2]
    old = sorted(tmp_path.glob("metrics.*.jsonl"))
    assert len(old) == 1 and [json.loads(x)["step"] for x in old[0].read_text().splitlines()] == [0, 1, 2]


def test_a_fresh_auto_run_without_a_checkpoint_does_not_append_to_old_metrics(tiny_cfg, tmp_path):
    """resume_mode=auto and no checkpoint (a run killed before its first save, save_freq 0): the
    run starts at step 0, so the directory's metrics.jsonl is set aside, not appended to."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/acc_mean": 0.9}\n{"step": 7, "reward/mean": 0.9}\n')
    run(
        tiny_cfg(
            tmp_path,
            "hetero.mode=replay",
            "trainer.total_training_steps=2",
            "trainer.test_freq=0",
            "trainer.save_freq=0",
            "trainer.resume_mode=auto",
        )
    )
    assert [line["step"] for line in read_metrics(tmp_path)] == [0, 1, 2]
    (old,) = tmp_path.glob("metrics.*.jsonl")
    assert [json.loads(x)["step"] for x in old.read_text().splitlines()] == [0, 7]


def test_resuming_with_another_config_is_refused_naming_the_keys(tiny_cfg, tmp_path):
    """A checkpoint resumes only the config that wrote it: another max_delay would train on from its
    weights and label them with the new settings. How long it runs may change."""
    common = ("hetero.mode=replay", "trainer.save_freq=2", "trainer.test_freq=0")
    run(tiny_cfg(tmp_path, *common, "trainer.total_training_steps=2"))
    with pytest.raises(ValueError, match=r"another config \(hetero.max_delay: 8 -> 3\).*trainer.resume_mode=disable"):
        run(
            tiny_cfg(
                tmp_path, *common, "hetero.max_delay=3", "trainer.total_training_steps=4", "trainer.resume_mode=auto"
            )
        )
    assert "max_delay: 8" in (tmp_path / "config.yaml").read_text()  # the run's own config was kept
    run(tiny_cfg(tmp_path, *common, "trainer.total_training_steps=4", "trainer.resume_mode=auto"))
    assert [line["step"] for line in read_metrics(tmp_path)] == [0, 1, 2, 3, 4]


def test_a_fresh_run_sets_the_old_checkpoint_pointer_aside(tiny_cfg, tmp_path):
    """resume_mode=disable starts over: a later auto start must resume that run, not the older one
    whose checkpoint is still in the directory (it stays, under its own name)."""
    common = ("hetero.mode=replay", "trainer.test_freq=0")
    run(tiny_cfg(tmp_path, *common, "trainer.total_training_steps=2", "trainer.save_freq=2"))
    run(tiny_cfg(tmp_path, *common, "hetero.max_delay=3", "trainer.total_training_steps=1", "trainer.save_freq=0"))
    ckpt = tmp_path / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_000001.pt"  # the second run's (saved at its end)
    (kept,) = ckpt.glob("latest.*")
    assert kept.read_text().strip() == "step_000002.pt" and (ckpt / "step_000002.pt").is_file()


def test_a_failed_run_still_gets_its_report(tiny_cfg, tmp_path, monkeypatch):
    """A run that raises (here: its evaluation fails after two steps) leaves report.md and
    curves.png for what it logged; the run's own error is the one raised."""
    from recipe.gepo.embedded import loop

    real = loop.LearnerRuntime.evaluate
    calls = []

    def evaluate_then_fail(self, seed):
        calls.append(seed)
        if len(calls) > 1:
            raise RuntimeError("evaluation failed on purpose")
        return real(self, seed)

    monkeypatch.setattr(loop.LearnerRuntime, "evaluate", evaluate_then_fail)
    with pytest.raises(RuntimeError, match="on purpose"):
        run(tiny_cfg(tmp_path, "hetero.mode=replay", "trainer.total_training_steps=2", "trainer.test_freq=2"))
    assert (tmp_path / "report.md").is_file() and (tmp_path / "curves.png").is_file()
