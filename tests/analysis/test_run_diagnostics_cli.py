"""``python -m verl_ext.analysis.run_diagnostics`` reads run directories through ``verl_ext.rundir``
(no recipe import) and tables every diagnostic pair, the E[A]-error pairs included."""

from __future__ import annotations

import json

from verl_ext.analysis import run_diagnostics as rd


def _run_dir(path, slope):
    path.mkdir()
    lines = [
        {
            "step": k,
            rd.STALENESS: float(k % 4),
            "hetero/consumed": 2.0,
            rd.KL: 0.01 * k,
            rd.VAR: 0.02 * k + 0.001 * (k % 3),
            rd.ERROR: slope * (k % 4) + 0.01 * k,
        }
        for k in range(1, 9)
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_cli_writes_figures_and_tables_every_pair(tmp_path, capsys):
    runs = [str(_run_dir(tmp_path / "a", 0.1)), str(_run_dir(tmp_path / "b", 0.2))]
    assert rd.main([*runs, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "r(adv_estimation_error, staleness_mean)" in out and "r(weight_var, kl_sampler_learner)" in out
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len([n for n in written if n.endswith(".png")]) == len(rd.DIAG_PAIRS)
    assert "diag_correlations.csv" in written


def test_cli_names_a_bad_run_dir(tmp_path, capsys):
    assert rd.main([str(tmp_path / "missing"), "--out", str(tmp_path / "out")]) == 2
    assert "missing" in capsys.readouterr().err
