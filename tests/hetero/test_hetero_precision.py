"""Bounds calibrated from a sample of honest groups (``verl_ext.hetero.precision.calibrate``), the
bounds file that carries them, and whose bounds a group gets (:class:`TrustBounds`)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from verl_ext.hetero.precision import (
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
