"""recipe.gepo.run_report on synthetic run directories: tolerant metrics.jsonl loading, summary
numbers against values computed here from the data written, report.md/curves.png output."""

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from recipe.gepo import run_report as report

CONFIG = """\
actor_rollout_ref:
  actor:
    policy_loss:
      loss_mode: {loss}
      group_size: ${{actor_rollout_ref.rollout.missing_key}}
hetero:
  max_delay: {delay}
  seed: 3
"""


def write_run(
    run_dir: Path,
    lines: list,
    tail: str = "",
    loss: str | None = "gepo",
    delay: int | None = 4,
    preset: str | None = None,
) -> Path:
    """A run directory: ``lines`` (dicts, or raw strings written as they are) one per line in
    metrics.jsonl, then ``tail`` without a newline (a torn write); a config.yaml unless ``loss``
    is None (the config holds an unresolvable interpolation, as composed configs may)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    body = "".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines)
    (run_dir / "metrics.jsonl").write_text(body + tail, encoding="utf-8")
    if loss is not None:
        text = CONFIG.format(loss=loss, delay=delay)
        if preset is not None:
            text += f"algorithm_preset: {preset}\n"
        (run_dir / "config.yaml").write_text(text, encoding="utf-8")
    return run_dir


def synthetic(rng: np.random.Generator, n_steps: int = 40, eval_every: int = 10, max_k: int = 4):
    """Training lines (idle fraction and step time deliberately not logged), separate
    evaluation lines every ``eval_every`` steps, and the raw arrays for independent checks."""
    data = {
        "reward": rng.uniform(0, 1, n_steps),
        "kl": rng.uniform(0, 0.1, n_steps),
        "var": rng.uniform(0, 0.5, n_steps),
        "dropped": rng.integers(0, 3, n_steps),
        "hist": rng.integers(0, 6, (n_steps, max_k + 1)),
    }
    data["hist"][5] = 0  # a step that consumed nothing (its staleness_mean is logged as 0)
    lines = []
    for t in range(n_steps):
        h = data["hist"][t]
        consumed = h.sum()
        line = {
            "step": t + 1,
            "reward/mean": data["reward"][t],
            "reward/std": 0.1,
            "is/kl_sampler_learner": data["kl"][t],
            "is/weight_var": data["var"][t],
            "hetero/dropped": int(data["dropped"][t]),
            "hetero/staleness_mean": float((np.arange(max_k + 1) * h).sum() / consumed) if consumed else 0.0,
            "hetero/staleness_max": float(np.nonzero(h)[0].max()) if consumed else 0.0,
        }
        line.update({f"hetero/staleness_hist/{k}": int(c) for k, c in enumerate(h)})
        lines.append(line)
    eval_steps = list(range(eval_every, n_steps + 1, eval_every))
    data["eval_steps"] = eval_steps
    data["eval"] = rng.uniform(0.2, 0.8, len(eval_steps))
    for s, a in zip(eval_steps, data["eval"]):
        lines.append({"step": s, "eval/toy/acc": a, "eval/acc_mean": a})
    return lines, data


# --------------------------------------------------------------------------- load_metrics


def test_load_metrics_tolerates_torn_last_line_and_non_numeric_values(tmp_path):
    lines = [
        {"step": 1, "reward/mean": 0.5, "actor/loss": "oops", "is/ess": None},
        {"step": 2, "reward/mean": "0.25", "actor/loss": 1.5, "is/ess": [1, 2]},
        {"step": 2, "eval/toy/acc": 0.75},  # evaluation on its own line, same step
        "",
        {"step": 3, "reward/mean": "NaN", "actor/loss": True},
    ]
    run = write_run(tmp_path / "run", lines, tail='{"step": 4, "reward/me')
    with pytest.warns(UserWarning, match=r"line 6: truncated last line"):
        df = report.load_metrics(run)
    assert df["step"].tolist() == [1, 2, 3]
    assert df["step"].dtype == np.int64
    assert df["reward/mean"].iloc[0] == 0.5 and df["reward/mean"].iloc[1] == 0.25
    assert math.isnan(df["reward/mean"].iloc[2])
    assert math.isnan(df["actor/loss"].iloc[0]) and df["actor/loss"].iloc[1] == 1.5
    assert math.isnan(df["actor/loss"].iloc[2])  # a boolean is not a metric value
    assert df["is/ess"].isna().all()
    assert df["eval/toy/acc"].tolist()[1] == 0.75 and df["eval/toy/acc"].isna().sum() == 2
    assert df.attrs["skipped_lines"] == [6]


def test_load_metrics_resumed_run_last_value_wins_and_bad_lines_are_named(tmp_path):
    lines = [
        {"step": 1, "reward/mean": 0.1},
        {"step": 2, "reward/mean": 0.2, "actor/loss": 5.0},
        '{"step": 3, "rew{"step": 2, "reward/mean": 0.9}',  # torn write, then the resumed run
        {"step": 2, "reward/mean": 0.8},  # re-logged by the resumed run: wins
        {"step": 3, "reward/mean": 0.3},
        [1, 2],
        {"reward/mean": 1.0},
        {"step": 2.5, "reward/mean": 1.0},
    ]
    run = write_run(tmp_path / "run", lines)
    with pytest.warns(UserWarning) as rec:
        df = report.load_metrics(run)
    msg = str(rec[0].message)
    assert "skipped 4" in msg and "line 3: invalid JSON" in msg and "line 6: not a JSON object" in msg
    assert "line 7: no integral 'step'" in msg and "line 8: no integral 'step'" in msg
    assert df["step"].tolist() == [1, 2, 3]
    assert df["reward/mean"].tolist() == [0.1, 0.8, 0.3]
    assert df["actor/loss"].iloc[1] == 5.0  # kept from the first line of step 2


def test_load_metrics_empty_file_gives_empty_frame(tmp_path):
    run = write_run(tmp_path / "run", [])
    df = report.load_metrics(run)
    assert len(df) == 0 and list(df.columns) == ["step"]


def test_bad_run_dir_errors_name_the_directory(tmp_path):
    missing = tmp_path / "no_such_run"
    with pytest.raises(report.RunDirError, match="no_such_run.*does not exist"):
        report.load_metrics(missing)
    empty = tmp_path / "empty_run"
    empty.mkdir()
    with pytest.raises(report.RunDirError, match="empty_run.*has no metrics.jsonl"):
        report.summarize(empty)
    with pytest.raises(report.RunDirError, match="empty_run"):
        report.write_report(empty)


# --------------------------------------------------------------------------- summarize


def test_summarize_matches_independent_computation(tmp_path):
    rng = np.random.default_rng(7)
    lines, d = synthetic(rng)
    # a torn last line that would change steps, KL and the eval numbers if it were parsed
    run = write_run(tmp_path / "run", lines, tail='{"step": 999, "is/kl_sampler_learner": 123.0, "eval/acc_mean": 1')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = report.summarize(run)

    n = len(d["reward"])
    assert s["steps"] == n and s["first_step"] == 1 and s["last_step"] == n
    assert s["skipped_lines"] == 1
    assert s["eval_metric"] == "eval/acc_mean" and s["eval_count"] == len(d["eval"])
    assert s["eval_first"] == pytest.approx(d["eval"][0])
    assert s["eval_last"] == pytest.approx(d["eval"][-1])
    assert s["eval_best"] == pytest.approx(d["eval"].max())
    assert s["eval_best_step"] == d["eval_steps"][int(np.argmax(d["eval"]))]
    k = np.arange(d["hist"].shape[1])
    counts = d["hist"].sum(axis=0)
    assert s["staleness_mean"] == pytest.approx((k * counts).sum() / counts.sum())
    assert s["staleness_max"] == k[counts > 0].max()
    assert s["staleness_hist"] == {int(i): float(c) for i, c in zip(k, counts)}
    assert s["dropped_total"] == d["dropped"].sum()
    assert s["kl_final"] == pytest.approx(d["kl"][-1])
    assert s["weight_var_final"] == pytest.approx(d["var"][-1])
    assert s["reward_first"] == pytest.approx(d["reward"][0]) and s["reward_last"] == pytest.approx(d["reward"][-1])
    assert math.isnan(s["learner_idle_frac_mean"])  # not logged
    assert (s["loss_mode"], s["max_delay"], s["label"]) == ("gepo", 4, "gepo, d=4")


def test_summarize_staleness_without_histogram_and_idle_fraction(tmp_path):
    rng = np.random.default_rng(1)
    st = rng.uniform(0, 5, 12)
    smax = st + rng.uniform(0, 2, 12)
    idle = rng.uniform(0, 1, 12)
    lines = [
        {"step": t, "hetero/staleness_mean": st[t], "hetero/staleness_max": smax[t], "perf/learner_idle_frac": idle[t]}
        for t in range(12)
    ]
    s = report.summarize(write_run(tmp_path / "plain", lines, loss=None))
    assert s["staleness_mean"] == pytest.approx(st.mean())
    assert s["staleness_max"] == pytest.approx(smax.max())
    assert s["learner_idle_frac_mean"] == pytest.approx(idle.mean())
    assert math.isnan(s["kl_final"]) and math.isnan(s["dropped_total"]) and s["eval_metric"] is None
    assert s["loss_mode"] is None and s["label"] == "unknown, d=?"

    # with hetero/consumed logged the mean is weighted by consumed groups
    consumed = rng.integers(0, 9, 12)
    for line, c in zip(lines, consumed):
        line["hetero/consumed"] = int(c)
    s = report.summarize(write_run(tmp_path / "weighted", lines, loss=None))
    assert s["staleness_mean"] == pytest.approx((st * consumed).sum() / consumed.sum())


def test_eval_accuracy_falls_back_to_benchmark_mean(tmp_path):
    lines = [
        {"step": 10, "eval/aime/acc": 0.2, "eval/math/acc": 0.6},
        {"step": 20, "eval/aime/acc": 0.4},  # math not evaluated at 20: no mean there
        {"step": 30, "eval/aime/acc": 0.1, "eval/math/acc": 0.5},
    ]
    s = report.summarize(write_run(tmp_path / "run", lines))
    assert s["eval_count"] == 2
    assert s["eval_first"] == pytest.approx(0.4) and s["eval_last"] == pytest.approx(0.3)
    assert s["eval_best"] == pytest.approx(0.4) and s["eval_best_step"] == 10
    single = report.summarize(write_run(tmp_path / "one", [{"step": 1, "eval/toy/acc": 0.9}]))
    assert single["eval_metric"] == "eval/toy/acc" and single["eval_best"] == pytest.approx(0.9)


def test_config_preset_and_bad_delay(tmp_path):
    run = write_run(tmp_path / "run", [{"step": 1}], loss="vanilla", delay=2, preset="dr_grpo")
    r = report.load_run(run)
    assert (r.loss_mode, r.max_delay, r.preset, r.seed) == ("vanilla", 2, "dr_grpo", 3)
    assert r.label == "dr_grpo (vanilla), d=2"
    bad = write_run(tmp_path / "bad", [{"step": 1}], loss="gepo", delay="eight")
    with pytest.warns(UserWarning, match="hetero.max_delay='eight' is not an integer"):
        assert report.load_run(bad).max_delay is None


# --------------------------------------------------------------------------- write_report


def assert_png(path: Path) -> tuple[int, int]:
    assert path.is_file() and path.stat().st_size > 0
    with Image.open(path) as im:
        assert im.format == "PNG"
        im.verify()
    with Image.open(path) as im:
        assert im.width > 200 and im.height > 200
        return im.size


def test_write_report_files_and_content(tmp_path):
    rng = np.random.default_rng(3)
    lines, d = synthetic(rng)
    run = write_run(tmp_path / "run", lines, tail='{"st')
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        md, png = report.write_report(run)
    assert md == run / "report.md" and png == run / "curves.png"
    assert_png(png)
    text = md.read_text()
    assert "![training curves](curves.png)" in text
    assert f"{d['eval'].max():.4g} (step {d['eval_steps'][int(np.argmax(d['eval']))]})" in text
    assert f"| dropped groups (total) | {d['dropped'].sum()} |" in text
    assert "`perf/learner_idle_frac`" in text  # listed as not logged
    assert "1 unreadable line(s)" in text
    # the summary table keeps two columns on every row (no "|" inside a cell breaks it)
    table = text.split("| quantity | value |\n|---|---|\n")[1].split("\n\n")[0].splitlines()
    assert len(table) >= 10 and all(row.count("|") == 3 for row in table), table
    assert any(row.startswith("| final KL(sampler") for row in table)


def test_write_report_with_absent_metrics_does_not_crash(tmp_path):
    sparse = write_run(
        tmp_path / "sparse",
        [
            '{"step": 0, "reward/mean": 0.1, "actor/grad_norm": Infinity}',
            {"step": 1, "actor/loss": 2.0, "is/kl_sampler_learner": "-inf"},
        ],
    )
    out = tmp_path / "elsewhere"
    md, png = report.write_report(sparse, out_dir=out)
    assert md.parent == out and png.parent == out
    assert_png(png)
    text = md.read_text()
    for name in ("is/kl_sampler_learner", "is/weight_var", "hetero/staleness_hist/<k>", "eval/... accuracy"):
        assert f"`{name}`" in text
    assert "Infinite values" in text and "`actor/grad_norm` (1 step)" in text
    assert "| final KL(sampler ‖ learner) | n/a |" in text
    empty = write_run(tmp_path / "empty", [])
    md, png = report.write_report(empty)
    assert_png(png)
    assert "| steps logged | 0 |" in md.read_text()


def test_report_cli_in_process(tmp_path, capsys):
    run = write_run(tmp_path / "run", [{"step": 1, "reward/mean": 0.3}])
    assert report.main([str(run)]) == 0
    assert f"wrote {run / 'report.md'}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        report.main([str(tmp_path / "missing_run")])
    assert e.value.code == 2
    assert "missing_run" in capsys.readouterr().err


def test_the_reward_band_stays_inside_the_rewards_seen_and_accuracy_gets_a_binomial_interval():
    df = pd.DataFrame(
        {
            "step": [1, 2],
            "reward/mean": [0.9, 0.1],
            "reward/std": [0.3, 0.3],
            "reward/min": [0.0, 0.0],
            "reward/max": [1.0, 1.0],
        }
    )
    low, high, label = report.reward_band(df)
    assert low.tolist() == pytest.approx([0.6, 0.0]) and high.tolist() == pytest.approx([1.0, 0.4])
    assert label == "± std (within min/max)"
    low, high, label = report.reward_band(df.drop(columns=["reward/min", "reward/max"]))
    assert low.tolist() == pytest.approx([0.6, -0.2]) and label == "± std"  # no bounds logged: as is
    assert report.reward_band(df.drop(columns=["reward/std"])) is None
    low, high = report.accuracy_interval(np.array([0.5, 0.0]), np.array([256, 256]))
    assert low[0] == pytest.approx(0.5 - 1.96 * 0.5 / 16) and high[0] == pytest.approx(0.5 + 1.96 * 0.5 / 16)
    assert low[1] == high[1] == 0.0
