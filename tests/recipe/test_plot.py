"""recipe.gepo.plot on synthetic run directories: Pearson r against numpy's corrcoef, the
accuracy-vs-delay table against values computed here, the figures, and the CLI as a
subprocess (success and a bad RUN_DIR)."""

import csv
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from recipe.gepo import plot
from recipe.gepo.run_report import RunDirError

REPO = Path(__file__).resolve().parents[2]
CONFIG = "actor_rollout_ref:\n  actor:\n    policy_loss:\n      loss_mode: {loss}\nhetero:\n  max_delay: {delay}\n"


def write_run(
    run_dir: Path,
    rng: np.random.Generator,
    loss: str | None,
    delay: int | None,
    n_steps: int = 30,
    eval_every: int = 10,
    with_is: bool = True,
    torn: bool = True,
) -> dict:
    """A run directory with per-step reward, IS metrics (KL, weight variance growing with
    staleness plus noise; step 3's variance is non-numeric) and evaluation lines; a torn
    last line. Returns the arrays written."""
    run_dir.mkdir(parents=True)
    st = rng.uniform(0, delay or 1, n_steps)
    kl = 0.01 * st + rng.uniform(0, 0.01, n_steps)
    var = 3 * kl + rng.normal(0, 0.01, n_steps)
    var[3] = np.nan  # logged as text below: must be left out of the pairs
    eval_steps = list(range(eval_every, n_steps + 1, eval_every))
    acc = rng.uniform(0.1, 0.9, len(eval_steps))
    lines = []
    for t in range(n_steps):
        line = {"step": t, "reward/mean": float(rng.uniform()), "hetero/staleness_mean": st[t]}
        if with_is:
            line.update({"is/kl_sampler_learner": kl[t], "is/weight_var": "n/a" if t == 3 else var[t]})
        lines.append(json.dumps(line))
    lines += [json.dumps({"step": s, "eval/acc_mean": a}) for s, a in zip(eval_steps, acc)]
    text = "\n".join(lines) + "\n" + ('{"step": 99, "is/weight_var": 5' if torn else "")
    (run_dir / "metrics.jsonl").write_text(text)
    if loss is not None:
        (run_dir / "config.yaml").write_text(CONFIG.format(loss=loss, delay=delay))
    return {"st": st, "kl": kl, "var": var, "acc": acc, "dir": run_dir}


@pytest.fixture
def runs(tmp_path):
    """Two seeds of (gepo, 4), one (gepo, 8), one (vanilla, 4) without IS metrics, one run
    without a config."""
    rng = np.random.default_rng(11)
    spec = [
        ("gepo_d4_s0", "gepo", 4, True),
        ("gepo_d4_s1", "gepo", 4, True),
        ("gepo_d8", "gepo", 8, True),
        ("vanilla_d4", "vanilla", 4, False),
        ("noconfig", None, None, True),
    ]
    return {name: write_run(tmp_path / name, rng, loss, delay, with_is=with_is) for name, loss, delay, with_is in spec}


def finite_pairs(x, y):
    keep = np.isfinite(x) & np.isfinite(y)
    return x[keep], y[keep]


def assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 0
    with Image.open(path) as im:
        assert im.format == "PNG"
        im.verify()
    with Image.open(path) as im:
        assert im.width > 100 and im.height > 100


def test_pearson_matches_numpy_and_is_nan_when_undefined():
    rng = np.random.default_rng(0)
    for n in (2, 3, 50):
        x = rng.normal(size=n)
        y = 0.5 * x + rng.normal(size=n)
        assert plot.pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-12)
    assert plot.pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(plot.pearson([1.0], [2.0]))
    assert math.isnan(plot.pearson([0.002] * 5, [1, 2, 3, 4, 5]))  # constant x
    with pytest.raises(ValueError, match="shape"):
        plot.pearson([1, 2], [1, 2, 3])


def test_correlations_match_corrcoef_per_run_and_pooled(runs):
    with pytest.warns(UserWarning):
        loaded, labels = plot.load_runs([str(r["dir"]) for r in runs.values()])
    corr = plot.correlations(loaded, labels)
    var_kl = corr[(corr["x"] == plot.KL) & (corr["y"] == plot.VAR)]
    pooled_x, pooled_y = [], []
    for i, (name, r) in enumerate(runs.items()):
        row = var_kl[var_kl["run"] == i].iloc[0]
        if name == "vanilla_d4":  # IS metrics not logged
            assert row["n"] == 0 and math.isnan(row["r"])
            continue
        x, y = finite_pairs(r["kl"], r["var"])
        assert row["n"] == len(x) == len(r["kl"]) - 1
        assert row["r"] == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-12)
        pooled_x.append(x)
        pooled_y.append(y)
    pooled = var_kl[var_kl["run"] == -1].iloc[0]
    assert pooled["label"] == plot.POOLED
    assert pooled["r"] == pytest.approx(np.corrcoef(np.concatenate(pooled_x), np.concatenate(pooled_y))[0, 1])
    # against staleness too
    st_var = corr[(corr["x"] == plot.STALENESS) & (corr["y"] == plot.VAR) & (corr["run"] == 0)].iloc[0]
    x, y = finite_pairs(runs["gepo_d4_s0"]["st"], runs["gepo_d4_s0"]["var"])
    assert st_var["r"] == pytest.approx(np.corrcoef(x, y)[0, 1], abs=1e-12)


def test_accuracy_vs_delay_best_last_over_seeds(runs):
    with pytest.warns(UserWarning):
        loaded, _ = plot.load_runs([str(r["dir"]) for r in runs.values()])
    table = plot.accuracy_vs_delay(loaded)
    assert list(zip(table["algorithm"], table["max_delay"], table["n"])) == [
        ("gepo", 4, 2),
        ("gepo", 8, 1),
        ("vanilla", 4, 1),
    ]
    seeds = [runs["gepo_d4_s0"]["acc"], runs["gepo_d4_s1"]["acc"]]
    best = np.array([a.max() for a in seeds])
    last = np.array([a[-1] for a in seeds])
    g4 = table.iloc[0]
    assert g4["best_mean"] == pytest.approx(best.mean()) and g4["best_std"] == pytest.approx(best.std(ddof=1))
    assert g4["last_mean"] == pytest.approx(last.mean()) and g4["last_std"] == pytest.approx(last.std(ddof=1))
    g8 = table.iloc[1]
    assert g8["best_mean"] == pytest.approx(runs["gepo_d8"]["acc"].max()) and math.isnan(g8["best_std"])
    assert g8["last_mean"] == pytest.approx(runs["gepo_d8"]["acc"][-1])


def test_runs_that_differ_in_more_than_the_seed_are_drawn_apart_naming_the_keys(runs, tmp_path):
    """A third (gepo, 4) run of other length is no seed of the first two: it gets its own point,
    labelled with what differs; seeds, run names and the delay model stay ignored."""
    other = write_run(tmp_path / "gepo_d4_long", np.random.default_rng(5), "gepo", 4)["dir"]
    with (other / "config.yaml").open("a") as f:
        f.write("trainer:\n  total_training_steps: 100\n  experiment_name: long\n")
    seed = runs["gepo_d4_s1"]["dir"] / "config.yaml"
    seed.write_text(seed.read_text() + "  seed: 7\n")  # under hetero: a seed, not a setting
    dirs = [runs[n]["dir"] for n in ("gepo_d4_s0", "gepo_d4_s1", "gepo_d8")] + [other]
    loaded, _ = plot.load_runs([str(d) for d in dirs])
    variants, differing = plot.setting_variants(loaded)
    assert differing == {"gepo": ["trainer.total_training_steps"]}
    assert variants == ["[trainer.total_training_steps=None]"] * 3 + ["[trainer.total_training_steps=100]"]
    table = plot.accuracy_vs_delay(loaded)
    assert list(zip(table["algorithm"], table["max_delay"], table["n"])) == [
        ("gepo [trainer.total_training_steps=100]", 4, 1),
        ("gepo [trainer.total_training_steps=None]", 4, 2),
        ("gepo [trainer.total_training_steps=None]", 8, 1),
    ]
    notes = []
    plot.make_figures(loaded, [d.name for d in dirs], tmp_path / "figs", log=notes.append)
    assert any("runs of gepo differ in more than the seed (trainer.total_training_steps)" in n for n in notes)


def test_labels_default_custom_and_errors(runs, tmp_path):
    dirs = [str(runs[n]["dir"]) for n in ("gepo_d4_s0", "gepo_d4_s1", "gepo_d8")]
    with pytest.warns(UserWarning):
        _, labels = plot.load_runs(dirs)
    assert labels == ["gepo, d=4 [gepo_d4_s0]", "gepo, d=4 [gepo_d4_s1]", "gepo, d=8"]
    with pytest.warns(UserWarning):
        assert plot.load_runs(dirs, ["a", "b", "c"])[1] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="--labels has 2 entries for 3 RUN_DIRs"):
        plot.load_runs(dirs, ["a", "b"])
    with pytest.raises(RunDirError, match="nowhere"):
        plot.load_runs(dirs + [str(tmp_path / "nowhere")])


def test_make_figures_per_algorithm_and_skips_what_no_run_logged(runs, tmp_path):
    other = write_run(tmp_path / "gspo_d2", np.random.default_rng(5), "gspo", 2, with_is=False, torn=False)
    with pytest.warns(UserWarning):
        loaded, labels = plot.load_runs([str(runs["vanilla_d4"]["dir"]), str(other["dir"])])
    notes = []
    written = plot.make_figures(loaded, labels, tmp_path / "out", log=notes.append)
    assert set(written) == {"curves", "curves_vanilla", "curves_gspo", "acc_vs_delay", "summary"}
    for name in written.keys() - {"summary"}:
        assert_png(written[name])
    assert sum("skipped scatter_" in n for n in notes) == 3


def test_cli_subprocess_writes_figures_and_prints_corrcoef(runs, tmp_path):
    out = tmp_path / "figs"
    used = ["gepo_d4_s0", "gepo_d4_s1", "gepo_d8"]
    cmd = [sys.executable, "-m", "recipe.gepo.plot", *[str(runs[n]["dir"]) for n in used], "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    wrote = dict(re.findall(r"^wrote (\S+): (.+)$", proc.stdout, flags=re.M))
    expected = {"curves", "acc_vs_delay", "scatter_var_kl", "scatter_var_staleness", "scatter_kl_staleness", "summary"}
    assert set(wrote) == expected
    for name, path in wrote.items():
        assert Path(path).parent == out
        if name != "summary":
            assert_png(Path(path))

    # the pooled r(weight_var, kl) printed equals numpy's corrcoef of all finite pairs
    with_is = [runs[n] for n in used]
    x = np.concatenate([finite_pairs(r["kl"], r["var"])[0] for r in with_is])
    y = np.concatenate([finite_pairs(r["kl"], r["var"])[1] for r in with_is])
    pooled_line = next(ln for ln in proc.stdout.splitlines() if ln.strip().startswith(plot.POOLED))
    printed = float(pooled_line.split()[2])
    assert printed == pytest.approx(np.corrcoef(x, y)[0, 1], abs=5e-5)
    assert f"[{x.size}]" in pooled_line

    # summary.csv carries each run's r at full precision
    with open(wrote["summary"]) as f:
        rows = list(csv.DictReader(f))
    assert [Path(r["run_dir"]).name for r in rows] == used
    col = f"r({plot.VAR}, {plot.KL})"
    x0, y0 = finite_pairs(runs["gepo_d8"]["kl"], runs["gepo_d8"]["var"])
    assert float(rows[2][col]) == pytest.approx(np.corrcoef(x0, y0)[0, 1], abs=1e-9)
    assert float(rows[2]["eval_best"]) == pytest.approx(runs["gepo_d8"]["acc"].max())


def test_cli_subprocess_bad_run_dir_names_it(runs, tmp_path):
    bad = tmp_path / "typo_run_dir"
    cmd = [
        sys.executable,
        "-m",
        "recipe.gepo.plot",
        str(runs["gepo_d8"]["dir"]),
        str(bad),
        "--out",
        str(tmp_path / "figs"),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: run directory {str(bad)!r} does not exist"], proc.stderr
    assert not (tmp_path / "figs").exists()
