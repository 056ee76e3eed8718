"""A trace's ``order="sequential"`` walks the file only inside one ``sample(n, rng)`` call; the
delay rule of every run (``DelaySchedule``: one draw per (seed, key, stream)) refuses it rather than
silently giving the draws of ``order="resample"``."""

import numpy as np
import pytest

from verl_ext.hetero.delay import DelaySchedule, make_delay_model

VALUES = [float(v) for v in range(50)]


def test_sequential_walks_the_trace_in_one_call():
    cycle = make_delay_model("trace", values=VALUES, order="sequential").sample(60, np.random.default_rng(0))
    start = int(cycle[0])
    assert list(cycle) == [VALUES[(start + i) % 50] for i in range(60)]


def test_the_run_delay_rule_refuses_sequential_and_keeps_resample():
    with pytest.raises(ValueError, match="order='sequential' cannot replay the trace in file order"):
        DelaySchedule(make_delay_model("trace", values=VALUES, order="sequential"), seed=3)
    schedule = DelaySchedule(make_delay_model("trace", values=VALUES), seed=3)
    draws = [schedule.delay(k, 1) for k in range(200)]
    assert set(draws) <= set(VALUES) and len(set(draws)) > 25  # i.i.d. from the measurements
    assert draws != sorted(draws)
