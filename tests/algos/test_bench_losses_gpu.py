"""scripts/bench/bench_losses_gpu.py runs on a CPU (--quick, so the GPU lane that calls it cannot
rot): its rows cover every loss it lists in eager and compiled form, with ratios to vanilla in the
same mode, and its compiled results equal the eager ones."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "bench_losses_gpu", REPO / "scripts" / "bench" / "bench_losses_gpu.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_cpu_run_gives_every_row(bench, tmp_path, capsys):
    """Three of its losses (every variant's compiled graph is checked in test_compiled_losses.py),
    the default CPU backend, and the floor from a given bandwidth."""
    torch.compiler.reset()
    out = tmp_path / "rows.json"
    labels = ["vanilla", "gepo", "gepo_tc_ess"]
    rows = bench.main(
        [
            "--quick",
            "--device",
            "cpu",
            "--repeats",
            "1",
            "--warmup",
            "1",
            "--losses",
            ",".join(labels),
            "--bandwidth-tbs",
            "2.0",
            "--json",
            str(out),
        ]
    )
    table = capsys.readouterr().out
    assert [r["loss"] for r in rows] == labels * len(bench.QUICK_SHAPES)
    assert {(r["B"], r["T"]) for r in rows} == set(bench.QUICK_SHAPES)
    ((batch, length),) = bench.QUICK_SHAPES
    floor_ms = 20 * batch * length / 2.0e12 * 1e3
    for r in rows:
        assert "error" not in r, r
        assert r["backend"] == "aot_eager"  # the CPU default: graph capture, no C++ compile
        assert r["floor_ms"] == pytest.approx(floor_ms)
        for mode in ("eager", "compiled"):
            assert r[f"{mode}_ms"] > 0
            assert r[f"{mode}_x_vanilla"] == pytest.approx(r[f"{mode}_ms"] / rows[0][f"{mode}_ms"])
            assert r[f"{mode}_x_floor"] == pytest.approx(r[f"{mode}_ms"] / floor_ms)
        # the compiled graph computes what eager does (aot_eager runs the same aten ops)
        assert r["loss_rel_err"] < 1e-6 and r["grad_rel_err"] < 1e-6
        assert f"| {r['B']} | {r['T']} | {r['loss']} |" in table
    assert rows[0]["eager_x_vanilla"] == 1.0 and rows[0]["compiled_x_vanilla"] == 1.0
    assert f"target at B={batch}, T={length}: gepo compiled x vanilla compiled" in table
    assert json.loads(out.read_text()) == rows


def test_no_floor_without_a_bandwidth(bench):
    assert bench.bandwidth_tbs(torch.device("cpu")) == (None, "cpu")


def test_bandwidth_table_names_the_issue_cards(bench):
    """First match wins, so the H100's variants and the GH200 come before the plain names."""

    def lookup(name):
        return next(tbs for key, tbs in bench.BANDWIDTH_TBS if key in name)

    assert lookup("NVIDIA H100 80GB HBM3") == 3.35
    assert lookup("NVIDIA H200") == 4.8
    assert lookup("NVIDIA H100 PCIe") == 2.0
    assert lookup("NVIDIA GH200 480GB") == 4.0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--losses", "gepo"], "vanilla"),
        (["--losses", "vanilla,nope"], "nope"),
        (["--shapes", "12x64"], "multiple of 8"),
        (["--shapes", "64"], "BxT"),
    ],
)
def test_bad_arguments_are_refused(bench, argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--quick", *argv])
    assert message in capsys.readouterr().err
