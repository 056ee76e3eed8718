import numpy as np

from verl_ext.analysis import figures


def test_cli_writes_pngs_and_summary(tmp_path, capsys):
    out = tmp_path / "figs"
    rc = figures.main(
        ["--out", str(out), "--bernoulli-points", "8", "--gaussian-points", "5", "--pairs", "20", "--groups", "20"]
    )
    assert rc == 0
    for name in ("figure2_bernoulli.png", "figure2_gaussian.png", "bias.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
    text = capsys.readouterr().out
    assert "Bernoulli grid (64 points" in text
    assert "Gaussian grid (25 points" in text
    assert "closed form vs scipy quadrature" in text
    assert "Random discrete pairs (20 pairs" in text


def test_cli_rejects_tiny_grid(tmp_path, capsys):
    try:
        figures.main(["--out", str(tmp_path), "--bernoulli-points", "1"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("expected a usage error")
    assert "--bernoulli-points must be >= 2" in capsys.readouterr().err


def test_kl_bucket_table_counts():
    kl = np.array([0.01, 0.03, 0.1, 0.3, 3.0])
    diff = np.array([-1.0, 1.0, 1.0, -1.0, 2.0])
    rows = figures.kl_bucket_table(kl, diff, edges=(0.0, 0.05, 1.0, np.inf))
    assert [(r[2], r[3]) for r in rows] == [(2, 0.5), (2, 0.5), (1, 1.0)]
    assert rows[2][4] == 2.0
