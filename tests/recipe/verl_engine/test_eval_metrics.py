"""The verl engine's evaluation under the embedded engine's names: verl's real validation metrics
(``_val_metrics_update`` over ``process_validation_metrics``, fed small inputs) become
``eval/<data_source>/acc`` and ``eval/acc_mean``, and reach metrics.jsonl and report.md."""

import pytest
from verl.utils.tracking import Tracking

from recipe.gepo import run_report as report
from recipe.gepo.verl_engine.trainer import (
    HeteroSeparateAsyncTrainer,
    MetricsTee,
    embedded_eval_metrics,
)
from verl_ext.rundir import read_metric_rows


def verl_val_metrics(rows, n, expected=None):
    """What verl 0.9.1's ``_validate`` returns for ``rows`` = [(data_source, uid, extra_info)]:
    its own ``_val_metrics_update`` (which uses no trainer state) on the inputs ``_validate``
    collects -- ``reward`` is always there (the summed score), the reward function's extra keys
    (``acc``, ``pred``) beside it."""
    infos: dict[str, list] = {}
    for _, _, info in rows:
        for key, value in info.items():
            infos.setdefault(key, []).append(value)
    sources = [src for src, _, _ in rows]
    counts = {(src, uid): n for src, uid, _ in rows} | (expected or {})
    trainer = object.__new__(HeteroSeparateAsyncTrainer)  # verl's method, no construction needed
    return trainer._val_metrics_update(sources, [uid for _, uid, _ in rows], infos, [1] * len(rows), counts)


def sample(correct, fmt_bonus=0.5):
    """One response: its 0/1 ``acc`` and a reward that also pays a format bonus (so != acc)."""
    return {"reward": float(correct) + fmt_bonus, "acc": float(correct), "pred": "7" if correct else "3"}


def test_mean_at_n_of_acc_per_data_source_and_their_mean():
    # toy_add3: prompt a 3/4 correct, prompt b 1/4; openai/gsm8k (a '/' in the name): 4/4 and 0/4
    rows = [("toy_add3", "a", sample(c)) for c in (1, 1, 1, 0)] + [("toy_add3", "b", sample(c)) for c in (0, 0, 1, 0)]
    rows += [("openai/gsm8k", "c", sample(1)) for _ in range(4)] + [("openai/gsm8k", "d", sample(0)) for _ in range(4)]
    val = verl_val_metrics(rows, n=4)
    assert val["val-core/toy_add3/acc/mean@4"] == pytest.approx(0.5)  # verl's key, as logged
    assert "val-core/toy_add3/reward/mean@4" not in val and "val-aux/toy_add3/reward/mean@4" in val
    assert any(k.startswith("val-core/toy_add3/acc/best@") for k in val)  # not accuracies of a sample

    ev = embedded_eval_metrics(val)
    assert ev == {
        "eval/toy_add3/acc": pytest.approx(0.5),  # fraction of correct samples, not the reward (1.0)
        "eval/openai/gsm8k/acc": pytest.approx(0.5),
        "eval/acc_mean": pytest.approx(0.5),
    }
    # per-source means that differ: acc_mean is their unweighted mean
    rows2 = [("toy_add3", "a", sample(c)) for c in (1, 1, 1, 1)] + [("math500", "m", sample(c)) for c in (1, 0, 0, 0)]
    ev2 = embedded_eval_metrics(verl_val_metrics(rows2, n=4))
    assert ev2["eval/toy_add3/acc"] == 1.0 and ev2["eval/math500/acc"] == 0.25
    assert ev2["eval/acc_mean"] == pytest.approx(0.625)


def test_one_sample_per_prompt_is_the_embedded_engines_accuracy():
    """n=1 (verl's default val_kwargs.n): mean@1, the fraction of prompts answered correctly --
    exactly what the embedded engine's Task.evaluate computes."""
    outcomes = [1, 0, 1, 1, 0, 0, 0, 1, 1, 1]
    rows = [("toy_add3", f"u{i}", sample(c)) for i, c in enumerate(outcomes)]
    val = verl_val_metrics(rows, n=1)
    assert {k for k in val if k.startswith("val-core/")} == {"val-core/toy_add3/acc/mean@1"}
    assert embedded_eval_metrics(val) == {"eval/toy_add3/acc": 0.6, "eval/acc_mean": 0.6}


def test_failed_sessions_count_as_wrong_and_a_reward_only_source_uses_reward():
    # prompt a expected 4 samples, 2 came back (both correct): verl counts the missing two as acc 0
    rows = [("toy_add3", "a", sample(1)) for _ in range(2)]
    val = verl_val_metrics(rows, n=4, expected={("toy_add3", "a"): 4})
    assert embedded_eval_metrics(val)["eval/toy_add3/acc"] == pytest.approx(0.5)
    # a reward function without ``acc``: verl's core variable is ``reward``, so is ours
    rows = [("rm_only", "r", {"reward": v}) for v in (0.2, 0.4)]
    val = verl_val_metrics(rows, n=2)
    assert embedded_eval_metrics(val) == {"eval/rm_only/acc": pytest.approx(0.3), "eval/acc_mean": pytest.approx(0.3)}


def test_training_metrics_get_no_eval_keys():
    assert embedded_eval_metrics({"critic/score/mean": 0.4, "val-aux/num_turns/mean": 1.0}) == {}


def test_eval_reaches_metrics_jsonl_and_report(tmp_path):
    """Through the tee (verl's real Tracking behind it) into metrics.jsonl, then report.md: the
    verl engine's evaluations are the report's eval accuracy, as the embedded engine's are."""
    tee = MetricsTee(Tracking("p", "e", default_backend=[]), tmp_path)
    for step, outcomes in ((0, (0, 0, 1, 0)), (2, (1, 1, 1, 0))):
        val = verl_val_metrics([("toy_add3", f"u{i}", sample(c)) for i, c in enumerate(outcomes)], n=1)
        val.update(embedded_eval_metrics(val))  # what HeteroSeparateAsyncTrainer._validate returns
        tee.log(data=val | ({"critic/score/mean": 0.5, "reward/mean": 0.5} if step else {}), step=step)
    rows = read_metric_rows(tmp_path)
    assert [(r["step"], r["eval/acc_mean"]) for r in rows] == [(0, 0.25), (2, 0.75)]

    summary = report.summarize(tmp_path)
    assert summary["eval_metric"] == "eval/acc_mean" and summary["eval_count"] == 2
    assert (summary["eval_first"], summary["eval_last"], summary["eval_best_step"]) == (0.25, 0.75, 2)
    md_path, _ = report.write_report(tmp_path)
    md = md_path.read_text()
    assert "`eval/acc_mean` (2 evaluations)" in md and "| toy_add3 | 2 |" in md


def test_the_console_is_a_progress_bar_of_chosen_metrics_not_verls_every_metric(tmp_path, capsys):
    """With verl's console backend asked for, its per-step dump of every metric gives way to one
    progress bar (reward, staleness, accuracy, step time); metrics.jsonl keeps everything."""
    tee = MetricsTee(Tracking("p", "e", default_backend=["console"]), tmp_path, total_steps=2)
    assert "console" not in tee.tracking.logger
    tee.log({report.EVAL_MEAN: 0.25, "val-core/x/acc/mean@1": 0.25}, step=0)
    tee.log({"reward/mean": 0.5, "hetero/staleness_mean": 1.5, "timing_s/step": 2.0, "actor/pg_loss": 0.1}, step=1)
    tee.log({"reward/mean": 0.75, "actor/pg_loss": 0.2}, step=2)
    out = capsys.readouterr()
    assert "actor/pg_loss" not in out.out + out.err  # verl's console would print every metric
    assert "2/2" in out.err and "reward=0.75" in out.err and "acc=0.25" in out.err and "stale=1.5" in out.err
    assert [r["step"] for r in read_metric_rows(tmp_path)] == [0, 1, 2]
