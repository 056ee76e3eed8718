"""Delay models: quantile parameterisation, clipping, reproducibility, traces, CLI."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from verl_ext.hetero.delay import (
    DelaySchedule,
    LogNormalDelay,
    WeibullDelay,
    main,
    make_delay_model,
    to_steps,
)
from verl_ext.hetero.delay_channel import DelayChannel
from verl_ext.hetero.protocol import version_key
from verl_ext.hetero.seeding import sampler_stream
from verl_ext.hetero.transport import make_transport

REPO = Path(__file__).resolve().parents[2]
PAPER_SETTINGS = [(60.0, 1920.0, 400.0), (400.0, 3600.0, 400.0)]


@pytest.mark.parametrize("dist", ["lognormal", "weibull"])
@pytest.mark.parametrize("low,high,offset", PAPER_SETTINGS)
@pytest.mark.parametrize("confidence", [0.995, 0.9])
def test_low_high_are_the_tail_quantiles(dist, low, high, offset, confidence):
    model = make_delay_model(dist, low=low, high=high, confidence=confidence, offset=offset)
    p_lo, p_hi = (1 - confidence) / 2, 1 - (1 - confidence) / 2
    # independent check: scipy's own distribution objects built from the fitted parameters
    if dist == "lognormal":
        frozen = stats.lognorm(s=model.sigma, scale=math.exp(model.mu))
    else:
        frozen = stats.weibull_min(c=model.shape, scale=model.scale)
    assert frozen.ppf(p_lo) == pytest.approx(low, rel=1e-9)
    assert frozen.ppf(p_hi) == pytest.approx(high, rel=1e-9)
    # and the sampler really draws from it: empirical tail quantiles of T
    draws = model.sample_underlying(400_000, np.random.default_rng(1))
    assert np.quantile(draws, p_lo) == pytest.approx(low, rel=0.04)
    assert np.quantile(draws, p_hi) == pytest.approx(high, rel=0.04)


def test_lognormal_matches_the_paper_closed_form():
    model = LogNormalDelay(low=60, high=1920, confidence=0.995)
    z = stats.norm.ppf(1 - 0.005 / 2)
    assert model.mu == pytest.approx((math.log(60) + math.log(1920)) / 2)
    assert model.sigma == pytest.approx((math.log(1920) - math.log(60)) / (2 * z))


@pytest.mark.parametrize("cls", [LogNormalDelay, WeibullDelay])
@pytest.mark.parametrize("low,high,offset", PAPER_SETTINGS)
def test_delay_is_clipped_shifted_underlying(cls, low, high, offset):
    model = cls(low=low, high=high, offset=offset)
    draws = model.sample(200_000, np.random.default_rng(2))
    assert draws.shape == (200_000,) and draws.dtype == np.float64
    assert draws.min() >= low and draws.max() <= high
    # P(delay == low) = P(T <= low + offset): check the clip mass against the exact cdf
    if cls is LogNormalDelay:
        underlying = stats.lognorm(s=model.sigma, scale=math.exp(model.mu))
    else:
        underlying = stats.weibull_min(c=model.shape, scale=model.scale)
    expected_at_low = float(underlying.cdf(low + offset))
    assert np.mean(draws == low) == pytest.approx(expected_at_low, abs=0.01)
    summary = model.summary(n_samples=50_000, seed=3)
    assert low <= summary.median <= summary.p95 <= summary.max <= high
    assert summary.frac_at_low == pytest.approx(expected_at_low, abs=0.02)


def test_same_seed_same_draws_and_each_sampler_its_own_stream():
    model = make_delay_model("lognormal", low=60, high=1920, offset=400)
    first = [[DelaySchedule(model, seed=7).delay(k, stream) for k in range(64)] for stream in range(3)]
    again = [[DelaySchedule(model, seed=7).delay(k, stream) for k in range(64)] for stream in range(3)]
    assert first == again
    # the reference code gave every sampler the same list; here streams differ
    assert first[0] != first[1] and first[1] != first[2]
    assert first[0] != [DelaySchedule(model, seed=8).delay(k, 0) for k in range(64)]
    # a draw does not depend on which draws were asked for before it (resume continues exactly)
    assert DelaySchedule(model, seed=7).delay(40, 2) == first[2][40]


def test_sampler_speed_factors_scale_that_samplers_delays():
    model = make_delay_model("weibull", low=400, high=3600, offset=400)
    schedule = DelaySchedule(model, seed=5)
    for k in range(20):
        assert schedule.delay(k, 2, speed_factor=2.5) == pytest.approx(2.5 * schedule.delay(k, 2))
    with pytest.raises(ValueError, match="speed_factor=0.0"):
        schedule.delay(0, 1, speed_factor=0.0)
    with pytest.raises(ValueError, match="stream=-1"):
        schedule.delay(0, -1)


def test_none_constant_and_steps():
    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(make_delay_model("none").sample(5, rng), np.zeros(5))
    np.testing.assert_array_equal(make_delay_model("constant", value=3.5).sample(3, rng), [3.5, 3.5, 3.5])
    schedule = DelaySchedule(make_delay_model("lognormal", low=1, high=64), seed=0)
    steps = [schedule.steps(k, 1, cap=8) for k in range(2000)]
    assert min(steps) >= 1 and max(steps) == 8
    assert [to_steps(x) for x in (0.5, 1.5, 2.5, 2.6)] == [0, 2, 2, 3]  # half to even, like round()
    with pytest.raises(ValueError, match="cap=-1"):
        to_steps(1.0, cap=-1)


def test_one_delay_rule_for_replay_the_delay_channel_and_delayed_sync(tmp_path):
    """Version v's delay for sampler 0 is one number whoever asks: replay mode's staleness draw,
    the async delay channel of sampler 0 (seconds) and the verl engine's delayed weight sync."""
    from recipe.gepo.embedded.replay import draw_staleness
    from recipe.gepo.verl_engine.delayed_sync import DelayedSyncSchedule

    model = make_delay_model("lognormal", low=1, high=30)
    schedule = DelaySchedule(model, seed=11)
    channel = DelayChannel(make_transport("fsspec", url=str(tmp_path)), model, seed=11, stream=sampler_stream(0))
    sync_seconds = DelayedSyncSchedule(model, "seconds", max_pending=4, seed=11)
    sync_steps = DelayedSyncSchedule(model, "steps", max_pending=4, seed=11)
    for v in range(1, 30):
        d = schedule.delay(v, sampler_stream(0))
        assert channel.delay_for("weights", version_key(v)) == d
        assert sync_seconds.draw(v) == d
        assert sync_steps.draw(v) == float(round(d))
        assert draw_staleness(schedule, step=v, max_delay=8, available=v) == min(round(d), 8, v)


def test_trace_from_text_and_csv(tmp_path):
    text = tmp_path / "delays.txt"
    text.write_text("# measured upload delays\n12.5\n\n30  # slow link\n7\n")
    model = make_delay_model("trace", path=str(text), order="sequential")
    cycle = model.sample(7, np.random.default_rng(0))
    values = [12.5, 30.0, 7.0]
    start = values.index(cycle[0])
    assert list(cycle) == [values[(start + i) % 3] for i in range(7)]
    resampled = make_delay_model("trace", path=str(text)).sample(1000, np.random.default_rng(1))
    assert set(np.unique(resampled)) == set(values)

    table = tmp_path / "delays.csv"
    table.write_text("host,delay_ms\na,100\nb,250\n")
    by_name = make_delay_model("trace", path=str(table), column="delay_ms", scale=1e-3)
    by_index = make_delay_model("trace", path=str(table), column=1, scale=1e-3)
    np.testing.assert_allclose(by_name.values, [0.1, 0.25])
    np.testing.assert_allclose(by_index.values, by_name.values)


def test_trace_bad_input_names_the_line(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("1.0\nfast\n")
    with pytest.raises(ValueError, match=r"entry 2: 'fast' is not a number"):
        make_delay_model("trace", path=str(bad))
    bad.write_text("1.0\n-3\n")
    with pytest.raises(ValueError, match=r"entry 2: delay -3.0 must be finite and >= 0"):
        make_delay_model("trace", path=str(bad))
    table = tmp_path / "t.csv"
    table.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="pass column="):
        make_delay_model("trace", path=str(table))
    with pytest.raises(ValueError, match=r"column='c' not in"):
        make_delay_model("trace", path=str(table), column="c")


def test_uniform_integer_is_replays_uniform_staleness_draw_for_draw(tmp_path):
    """``uniform`` with integer=True covers low..high evenly, and gives the same delay for every
    (seed, key, stream) as the trace file of the values 0..K the study's ``uni<K>`` resamples."""
    K = 64
    trace = tmp_path / "uniform_0_64.txt"
    trace.write_text("".join(f"{i}\n" for i in range(K + 1)))
    named = DelaySchedule(make_delay_model("uniform", low=0, high=K, integer=True), seed=3)
    traced = DelaySchedule(make_delay_model("trace", path=str(trace)), seed=3)
    keys = range(2000)
    draws = [named.steps(k, stream=1) for k in keys]
    assert draws == [traced.steps(k, stream=1) for k in keys]
    counts = np.bincount(draws, minlength=K + 1)
    assert len(counts) == K + 1 and counts.min() > 0
    assert stats.chisquare(counts).pvalue > 1e-3  # flat over 0..64


def test_uniform_continuous_bounds_and_mean():
    draws = make_delay_model("uniform", low=2.0, high=6.0).sample(100_000, np.random.default_rng(0))
    assert draws.min() >= 2.0 and draws.max() <= 6.0 and abs(draws.mean() - 4.0) < 0.02
    assert not np.all(draws == np.round(draws))


@pytest.mark.parametrize(
    "dist,params,message",
    [
        ("uniform", dict(low=5, high=3), "uniform: low=5, high=3 must be finite with 0 <= low <= high"),
        ("uniform", dict(low=0, high=2.5, integer=True), "uniform: integer=True needs whole bounds"),
        ("lognormal", dict(low=5, high=3), "lognormal: low=5 must be < high=3"),
        ("weibull", dict(low=0, high=3), "weibull: low=0 must be finite and > 0"),
        ("lognormal", dict(low=1, high=3, confidence=1.0), "confidence=1.0 must be in"),
        ("constant", dict(value=-1), "constant: value=-1 must be finite and >= 0"),
        ("gamma", dict(), "unknown delay dist='gamma'"),
        ("lognormal", dict(low=1, high=3, scale=2), "lognormal: bad parameters"),
    ],
)
def test_bad_parameters_raise_naming_the_value(dist, params, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        make_delay_model(dist, **params)


def test_cli_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "hist.png"
    assert (
        main(
            [
                "--dist",
                "lognormal",
                "--low",
                "60",
                "--high",
                "1920",
                "--offset",
                "400",
                "--n",
                "20000",
                "--json",
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    model = make_delay_model("lognormal", low=60, high=1920, offset=400)
    assert report["summary"] == pytest.approx(model.summary(20000, 0).__dict__)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_arguments_exit_with_the_message(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--dist", "lognormal", "--low", "5", "--high", "3"])
    assert exit_info.value.code == 2
    assert "lognormal: low=5.0 must be < high=3.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--dist", "weibull", "--low", "5"])
    assert "--low and --high are required" in capsys.readouterr().err


def test_cli_module_entry_point():
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_ext.hetero.delay",
            "--dist",
            "weibull",
            "--low",
            "400",
            "--high",
            "3600",
            "--offset",
            "400",
            "--n",
            "1000",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert "dist: weibull" in ok.stdout and "median" in ok.stdout and "p95" in ok.stdout
