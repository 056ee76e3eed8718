"""``research/testbeds/wan/sync_bench.py``'s command line: ``--behind`` (the offline delta-size table) refuses
the link benchmark's options instead of ignoring them. Argument parsing only: nothing here
measures, trains or touches the network."""

from __future__ import annotations

import pytest

from tests.research.testbeds.wan.wan_scripts import load


@pytest.fixture(scope="module")
def sync():
    return load("sync_bench")


@pytest.mark.parametrize(
    "extra, named",
    [
        (["--rates", "10"], ["--rates"]),
        (["--trials", "1"], ["--trials"]),
        (["--out", "runs/wan/sync.json"], ["--out"]),
        (["--out", ""], ["--out"]),  # given, even if empty: still not honoured, so refused
        (["--rates", "10,100", "--trials", "2", "--out", "x.json"], ["--rates", "--trials", "--out"]),
    ],
)
def test_behind_refuses_the_link_benchmarks_options(sync, extra, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sync.main(["--behind", "1,2", *extra])  # refused while parsing: main never reaches the measurement
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "with --behind 1,2" in err
    for flag in named:
        assert flag in err
    for flag in {"--rates", "--trials", "--out"} - set(named):
        assert flag not in err.split("error:")[-1]


@pytest.mark.parametrize(
    "behind, message",
    [
        ("1,a", "--behind '1,a': expected comma-separated integers"),
        ("", "--behind '': expected"),
        ("0,2", "--behind 0,2: each k must be in [1, 64]"),
        ("65", "--behind 65: each k must be in [1, 64]"),
    ],
)
def test_bad_behind_values_are_named(sync, behind, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sync.parse_args(["--behind", behind])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_behind_alone_and_the_benchmarks_defaults_parse(sync):
    _, args = sync.parse_args(["--behind", "1,2,8", "--lr", "1e-6", "--model-path", "m"])
    assert (args.behind, args.lr, args.model_path) == ([1, 2, 8], 1e-6, "m")
    _, args = sync.parse_args([])
    assert (args.behind, args.rates, args.trials, args.out) == (None, [10.0, 100.0, 1000.0], 3, None)
    _, args = sync.parse_args(["--rates", "10,1gbit", "--trials", "2", "--out", "o.json"])
    assert (args.rates, args.trials, args.out) == ([10.0, 1000.0], 2, "o.json")


@pytest.mark.parametrize(
    "argv, message", [(["--trials", "11"], "--trials 11: must be in [1, 10]"), (["--rates", "fast"], "rate 'fast'")]
)
def test_the_benchmarks_own_checks_still_apply(sync, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sync.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
