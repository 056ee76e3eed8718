"""``perf/learner_verdict_block_s_total`` (:class:`~recipe.gepo.embedded.checker.VerdictBlockClock`):
the time the learner waits for a batch that the groups it holds -- buffered, or awaiting a trust
verdict -- would fill, i.e. what slow verdicts cost it; the learner's cores are lent to the
checker for exactly those spans."""

from __future__ import annotations

import pytest

from recipe.gepo.embedded.checker import VerdictBlockClock


class FakeTime:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    now, changes = FakeTime(), []
    return VerdictBlockClock(changes.append, now=now), now, changes


def test_only_the_wait_the_held_groups_could_fill_is_counted(clock):
    clock, now, changes = clock
    clock.waits(4, held=2)  # two groups short: the samplers, not the verdicts, keep it waiting
    now.t += 1.0
    clock.update(held=3)
    now.t += 1.0
    assert not clock.blocked and clock.total_s == 0 and changes == []
    clock.update(held=4)  # the fourth group is read: only its verdict is missing now
    now.t += 0.5
    clock.update(held=3)  # a verdict refused one: short again
    now.t += 2.0
    clock.update(held=5)
    now.t += 0.25
    clock.fed()
    assert clock.total_s == pytest.approx(0.75) and clock.episodes == 2
    assert changes == [True, False, True, False]  # each span lends the learner's cores, then takes them back


def test_waiting_for_groups_already_held_counts_from_the_start_and_training_never_counts(clock):
    clock, now, changes = clock
    clock.update(held=10)  # the learner is training: nothing waits on verdicts
    now.t += 3.0
    clock.waits(2, held=2)  # both read, one still awaiting its verdict
    now.t += 0.1
    clock.fed()
    clock.update(held=10)
    now.t += 3.0
    assert clock.total_s == pytest.approx(0.1) and changes == [True, False] and not clock.blocked
