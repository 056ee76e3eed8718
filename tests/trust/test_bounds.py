"""Bounds calibrated from a sample of honest groups (``verl_ext.trust.bounds.calibrate``), the
bounds file that carries them, and whose bounds a group gets (:class:`TrustBounds`)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from verl_ext.trust.bounds import (
    BOUND_FIELDS,
    TIE_MARGINS,
    TOLERANCES,
    Mismatch,
    MismatchCusum,
    Tolerance,
    TrustBounds,
    bounds_file_payload,
    calibrate,
    read_bounds_file,
)


def _honest(n: int, seed: int, scale: float = 0.004) -> list[Mismatch]:
    """Groups whose mean |Δ| is log-normal around ``scale`` and whose signed mean is zero-mean noise."""
    rng = np.random.default_rng(seed)
    mean_abs = scale * rng.lognormal(0.0, 0.6, n)
    return [
        Mismatch(token_max=20 * m, mean_abs=m, kl=m * m / 2, tokens=40, mean_signed=float(rng.normal(0.0, m / 3)))
        for m in mean_abs
    ]


def _first_alarm(tol: Tolerance, groups: list[Mismatch]) -> int | None:
    cusum = MismatchCusum()
    for i, m in enumerate(groups, start=1):
        over = m.token_max > tol.token_max or m.mean_abs > tol.group_mean_abs or m.kl > tol.group_kl
        if over or cusum.add("s", m, tol, "bf16") is not None:
            return i
    return None


def test_calibrated_bounds_keep_a_fresh_honest_sampler_at_rest_and_catch_a_small_shift():
    sample = _honest(128, seed=0)
    tol = calibrate(sample, horizon=2000, trials=100)
    assert tol.token_max > max(m.token_max for m in sample) and tol.group_mean_abs > max(m.mean_abs for m in sample)
    assert tol.reference > np.mean([m.mean_abs for m in sample])  # honest sums drift down
    # a sampler the calibration never saw, from the same arithmetic: no alarm over the horizon
    assert _first_alarm(tol, _honest(2000, seed=1)) is None
    # q biased by 0.01 a token (2.5x the honest mean |Δ|): under every per-group bound, caught by the sums
    shifted = [replace(m, mean_abs=m.mean_abs + 0.01, mean_signed=m.mean_signed + 0.01) for m in _honest(200, seed=2)]
    assert max(m.mean_abs for m in shifted[:3]) < tol.group_mean_abs
    caught = _first_alarm(tol, shifted)
    assert caught is not None and 1 < caught <= 20, caught
    # the table's bf16 bounds (SmolLM2's spread) do not see it
    assert _first_alarm(TOLERANCES["bf16"], shifted) is None


def test_a_sample_of_mostly_exact_groups_still_gives_sums_that_drift_down():
    """bf16 against bf16 on one machine: most groups match to the bit, a few do not."""
    exact = [Mismatch(0.0, 0.0, 0.0, 40, 0.0)] * 120
    rare = [Mismatch(0.03, 0.0015, 1e-5, 40, 0.001 * (-1) ** i) for i in range(8)]
    tol = calibrate(exact + rare, horizon=2000, trials=100)
    assert tol.reference > 0 and tol.bias_reference > 0
    rng = np.random.default_rng(3)
    fresh = [rare[i % 8] if rng.random() < 8 / 128 else exact[0] for i in range(5000)]
    assert _first_alarm(tol, fresh[:2000]) is None


@pytest.mark.parametrize(
    "sample, match",
    [
        (_honest(15, seed=0), "at least 16"),
        ([*_honest(20, seed=0), Mismatch(float("nan"), 0.0, 0.0, 1)], "NaN"),
    ],
)
def test_calibrate_refuses_a_sample_it_cannot_use(sample, match):
    with pytest.raises(ValueError, match=match):
        calibrate(sample)


MEASURED = {"model": "m", "scorer_precision": "fp32", "temperature": 1.0}


def _fields(**changed):
    return {**{name: 0.1 for name in BOUND_FIELDS}, **changed}


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "cannot be read"),
        ("{not json", "not JSON"),
        (json.dumps({"measured": MEASURED}), "expected an object with 'bounds'"),
        (json.dumps({"bounds": {"fp32": _fields()}, "measured": MEASURED}), "bounds for 'fp32'"),
        (json.dumps({"bounds": {"bf16": _fields(reference=0)}, "measured": MEASURED}), r"bf16.reference=0 must be"),
        (json.dumps({"bounds": {"bf16": _fields(tie_margin=True)}, "measured": MEASURED}), "tie_margin=True"),
        (json.dumps({"bounds": {"bf16": {"token_max": 1.0}}, "measured": MEASURED}), "missing .'group_mean_abs'"),
        (json.dumps({"bounds": {"bf16": _fields(extra=1.0)}, "measured": MEASURED}), r"unknown \['extra'\]"),
        (json.dumps({"bounds": {"bf16": _fields()}, "measured": {"model": "m"}}), "must record model"),
        (json.dumps({"bounds": {"bf16": _fields(near_tie_rate=None)}, "measured": MEASURED}), "both null or both set"),
    ],
)
def test_a_bad_bounds_file_is_refused_naming_the_key_and_the_bad_part(tmp_path, content, match):
    path = tmp_path / "bounds.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=rf"hetero.trust.bounds_file='{path}'.*{match}"):
        read_bounds_file(str(path))


def test_bounds_written_are_the_bounds_read(tmp_path):
    tol = calibrate(_honest(64, seed=4), horizon=500, trials=50)
    path = tmp_path / "bounds.json"
    path.write_text(json.dumps(bounds_file_payload("bf16", tol, MEASURED)))
    bounds, measured = read_bounds_file(str(path))
    assert bounds == {"bf16": tol} and measured == MEASURED
    # the table's tolerance has no margin of its own: the file gets the table's
    path.write_text(json.dumps(bounds_file_payload("bf16", TOLERANCES["bf16"], MEASURED)))
    assert read_bounds_file(str(path))[0]["bf16"].tie_margin == TIE_MARGINS["bf16"]


def test_whose_bounds_a_group_gets():
    mine = replace(TOLERANCES["bf16"], token_max=0.5, tie_margin=0.4)
    bounds = TrustBounds(logprob_tolerance=2e-3, calibrated={"bf16": mine})
    assert bounds.tolerance("fp32", "bf16") == mine and bounds.tie_margin("fp32", "bf16") == 0.4
    assert bounds.tolerance("bf16", "fp32") == mine  # a bf16 scorer holds every sampler to bf16's bounds
    fp32 = bounds.tolerance("fp32", "fp32")
    assert fp32.token_max == 2e-3 and fp32.reference == TOLERANCES["fp32"].reference
    assert bounds.tie_margin("fp32", "fp32") == TIE_MARGINS["fp32"]
    table = TrustBounds()
    assert table.tolerance("fp32", "bf16") == TOLERANCES["bf16"] and table.tie_margin("fp32", "bf16") == 1.2


def _margins(n_groups: int, rate: float, seed: int, tokens: int = 40) -> list[np.ndarray]:
    """Per group, its checked tokens' noised margins: 0 (the noised best) but for near ties drawn at ``rate``."""
    rng = np.random.default_rng(seed)
    return [np.where(rng.random(tokens) < rate, rng.uniform(0.01, 0.2, tokens), 0.0) for _ in range(n_groups)]


def _first_near_tie_alarm(tol: Tolerance, margins: list[np.ndarray], sample: list[Mismatch]) -> int | None:
    cusum = MismatchCusum()
    for i, (m, mis) in enumerate(zip(margins, sample), start=1):
        ties = int(((m > 0) & (m <= tol.tie_margin)).sum())
        detail = cusum.add("s", mis, tol, "bf16", near_ties=(len(m), ties))
        if detail is not None:
            assert "near ties" in detail, detail
            return i
    return None


def test_the_near_tie_test_keeps_the_honest_rate_at_rest_and_catches_a_higher_one():
    """A sampler drawing from slightly other weights picks, where the best two tokens are close,
    another token than its seed's noise selects under the declared weights: near ties at a higher rate."""
    sample = _honest(128, seed=0)
    tol = calibrate(sample, horizon=2000, trials=100, token_margins=_margins(128, 0.005, seed=1))
    assert 0.002 < tol.near_tie_rate < 0.01 and tol.near_tie_limit >= np.log(2000 / 0.01)
    quiet = _honest(2000, seed=2)
    assert _first_near_tie_alarm(tol, _margins(2000, 0.005, seed=3), quiet) is None
    caught = _first_near_tie_alarm(tol, _margins(2000, 0.03, seed=4), quiet)
    assert caught is not None and caught <= 60, caught
    # without a token check in the calibration there is no near-tie test
    assert calibrate(sample, horizon=200, trials=20).near_tie_rate is None


def test_a_sample_without_a_near_tie_still_has_a_rate_above_zero():
    tol = calibrate(_honest(64, seed=0), horizon=500, trials=20, token_margins=_margins(64, 0.0, seed=1))
    assert 0 < tol.near_tie_rate <= 1 / (64 * 40)
    cusum = MismatchCusum()
    assert cusum.add("s", _honest(1, seed=5)[0], tol, "bf16", near_ties=(40, 0)) is None  # honest: nothing adds up


def test_the_near_tie_sums_survive_a_checkpoint():
    tol = calibrate(_honest(64, seed=0), horizon=500, trials=20, token_margins=_margins(64, 0.005, seed=1))
    cusum = MismatchCusum()
    cusum.add("s", _honest(1, seed=5)[0], tol, "bf16", near_ties=(40, 3))
    assert cusum.ties["s"] > 0
    restored = MismatchCusum()
    restored.load_state_dict(json.loads(json.dumps(cusum.state_dict())))
    assert restored.ties == cusum.ties
