"""``--replicate DESIGN=HEX``: a design's drops from its pinned warm start beside those from another
build of the same recipe (powered_long's first start), and whether the methods' ranking holds
(Spearman's rho of their mean drops) -- ``research.study.analyse.replicate_rows`` and the command line."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from research.study.analyse import replicate_rows
from research.study.plan import DESIGNS, POWERED_LONG_WARM_START, Plan, design_id
from research.study.rows import append_row

OTHER = "b" * 64


def _runs(drops: dict[str, float], seeds=(0, 1), delay="fix256", start=0.7) -> list[dict]:
    """On-policy and stale runs per method: the stale score ``start - drop`` (+ a seed's 0.01)."""
    runs = []
    for algo, drop in drops.items():
        for seed in seeds:
            runs.append({"task": "long", "algo": algo, "delay": 0, "seed": seed, "lq_mean": start + 0.01 * seed})
            runs.append(
                {"task": "long", "algo": algo, "delay": delay, "seed": seed, "lq_mean": start + 0.01 * seed - drop}
            )
    return runs


def test_each_start_pairs_its_own_seeds_and_the_ranking_is_correlated():
    ours = _runs({"a": 0.05, "b": 0.10, "c": 0.30, "d": 0.20, "only_ours": 0.0}) + _runs({"a": 0.1}, delay="fix4")
    theirs = _runs({"a": 0.01, "b": 0.02, "c": 0.40, "d": 0.25}, seeds=(0, 1, 2))
    (row,) = replicate_rows(ours, theirs)  # fix4 ran from one start only: not compared
    assert (row["task"], row["delay"], row["n_methods"]) == ("long", "fix256", 4)
    methods = {m[0]: m[1:] for m in row["methods"]}
    assert methods["b"] == pytest.approx((0.10, 2, 0.02, 3))
    assert methods["only_ours"][:2] == pytest.approx((0.0, 2)) and math.isnan(methods["only_ours"][2])
    assert methods["only_ours"][3] == 0
    assert row["rho"] == pytest.approx(1.0)  # same order of a < b < d < c in both starts


def test_a_reversed_ranking_reads_minus_one_and_too_few_methods_no_rho():
    (row,) = replicate_rows(_runs({"a": 0.1, "b": 0.2, "c": 0.3}), _runs({"a": 0.3, "b": 0.2, "c": 0.1}))
    assert row["rho"] == pytest.approx(-1.0)
    (few,) = replicate_rows(_runs({"a": 0.1, "b": 0.2}), _runs({"a": 0.3, "b": 0.2}))
    assert few["n_methods"] == 2 and math.isnan(few["rho"]) and math.isnan(few["rho_p"])


def _sweep(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    cli = [
        sys.executable,
        "-m",
        "research.study.delay_sweep",
        "--design",
        "powered_long",
        "--algos",
        "gepo",
        "vespo",
        "grpo_paper",
        "--lrs",
        "gepo=5e-5",
        "vespo=5e-5",
        "grpo_paper=5e-5",
        "--rows",
        str(tmp_path / "rows.csv"),
        "--out",
        str(tmp_path / "o"),
        "--no-figures",
    ]
    return subprocess.run([*cli, *extra], capture_output=True, text=True, timeout=300)


def test_the_command_line_tabulates_both_starts_and_fills_the_page_block(tmp_path):
    did = design_id(Plan(**DESIGNS["powered_long"]))
    for sha, drops in (
        (POWERED_LONG_WARM_START, {"gepo": 0.03, "vespo": 0.08, "grpo_paper": 0.19}),
        (OTHER, {"gepo": 0.02, "vespo": 0.05, "grpo_paper": 0.18}),
    ):
        for r in _runs(drops):
            append_row(
                tmp_path / "rows.csv",
                {**r, "lr": 5e-5, "design_id": did, "ws_sha256": sha, "steps": 600, "seconds": 1.0},
            )
    page = tmp_path / "page.md"
    page.write_text("before\n<!-- study:long_powered_long:replicate -->\nold\n<!-- /study -->\nafter\n")
    proc = _sweep(tmp_path, "--table-only", "--replicate", f"powered_long={OTHER}", "--update-doc", str(page))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"--replicate powered_long: 12 runs from the weights {OTHER[:16]}" in proc.stdout
    text = (tmp_path / "o" / "replicate_long.md").read_text()
    assert f"drop, `{POWERED_LONG_WARM_START[:8]}...` (seeds) | drop, `{OTHER[:8]}...` (seeds)" in text
    assert "| gepo | +0.030 (2) | +0.020 (2) |" in text and "rho of the 3 methods' mean drops" in text
    assert "**1.00**" in text
    new_page = page.read_text()
    assert "old" not in new_page and "| vespo | +0.080 (2) | +0.050 (2) |" in new_page
    assert new_page.startswith("before\n") and new_page.endswith("after\n")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--table-only", "--replicate", f"powered={OTHER}"], "--replicate 'powered=bbbb"),  # not this command's design
        (["--table-only", "--replicate", "powered_long=abc"], "HEX a sha256"),
        (["--replicate", f"powered_long={OTHER}"], "--replicate: only with --table-only"),
    ],
)
def test_the_command_line_refuses_a_replicate_it_cannot_make(tmp_path, extra, message):
    proc = _sweep(tmp_path, *extra)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-1000:]
    assert not (tmp_path / "o").exists()  # refused before anything was written
