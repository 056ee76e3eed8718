"""Staleness-bounded buffer: exact bound, exactly-once, drop/wait policies, threads, checkpoints."""

import io
import pickle
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_ext.hetero.buffer import BufferTimeout, RolloutBuffer
from verl_ext.hetero.records import RecordSpec

from .factories import build_group


def test_take_respects_bound_and_order(make_group):
    buffer = RolloutBuffer(max_delay=2, order="oldest")
    for uid, version in [("a", 0), ("b", 3), ("c", 1), ("d", 2), ("e", 3)]:
        buffer.set_learner_version(max(buffer.learner_version, version))
        assert buffer.add(make_group(uid, version))
    # at version 3: "a" (staleness 3) was dropped when the learner reached 3
    assert [g.group_uid for g in buffer.take(2, learner_version=3)] == ["c", "d"]
    metrics = buffer.metrics()
    assert metrics["hetero/dropped"] == 1 and metrics["hetero/dropped/stale"] == 1
    assert metrics["hetero/staleness_mean"] == 1.5 and metrics["hetero/staleness_max"] == 2
    assert metrics["hetero/staleness_hist/1"] == 1 and metrics["hetero/staleness_hist/2"] == 1
    assert metrics["hetero/queue_depth"] == 2

    newest_first = RolloutBuffer(max_delay=5, order="newest")
    for uid, version in [("x", 1), ("y", 3), ("z", 2), ("w", 3)]:
        newest_first.set_learner_version(3)
        newest_first.add(make_group(uid, version))
    assert [g.group_uid for g in newest_first.take(3, learner_version=3)] == ["w", "y", "z"]


def test_bound_is_exact_never_two_n(make_group):
    # the reference code let staleness reach 2N; here a group at exactly N+1 is never served
    buffer = RolloutBuffer(max_delay=4)
    buffer.set_learner_version(4)
    buffer.add(make_group("edge", 0))  # staleness 4 == N: usable
    buffer.set_learner_version(5)  # now 5 > N
    assert len(buffer) == 0
    assert buffer.ledger.status["edge"] == "dropped:stale"
    buffer.add(make_group("late", 0))  # arrives already stale
    assert buffer.ledger.status["late"] == "dropped:stale"
    with pytest.raises(BufferTimeout):
        buffer.take(1, learner_version=5, timeout_s=0.01)


def test_rejections_are_counted_never_raised(make_group):
    buffer = RolloutBuffer(max_delay=3, spec=RecordSpec(group_size=4))
    bad = make_group("s2-bad", 0, sampler="s2")
    bad.sampler_logprobs = np.where(bad.response_mask, np.nan, 0).astype(np.float32)
    assert buffer.add(bad) is False
    assert "s2" in str(buffer.last_rejection) and "sampler_logprobs" in str(buffer.last_rejection)
    assert buffer.add(make_group("future", 2)) is False  # learner is at 0
    assert buffer.add(make_group("small", 0, group_size=3)) is False
    assert buffer.add("not a group") is False
    assert buffer.add(make_group("ok", 0)) is True
    assert buffer.add(make_group("ok", 0)) is False  # duplicate
    assert buffer.add(make_group("s2-bad", 0, sampler="s2")) is True  # fixed re-send is accepted
    metrics = buffer.metrics()
    assert metrics["hetero/rejected"] == 5
    assert metrics["hetero/rejected/nonfinite_logprob"] == 1 and metrics["hetero/rejected/future_version"] == 1
    assert metrics["hetero/rejected/group_size"] == 1 and metrics["hetero/rejected/duplicate"] == 1
    assert buffer.ledger.status["future"] == "rejected:future_version"
    assert buffer.ledger.status["ok"] == "buffered" and buffer.ledger.status["s2-bad"] == "buffered"
    assert buffer.ledger.counts()["duplicates"] == 1


def test_a_sampler_over_its_quota_is_dropped_on_arrival_and_the_others_are_not(make_group):
    """sampler_capacity bounds what one sampler holds: its next group is recorded and dropped
    (over_quota), its older groups stay, other samplers still get in; a take makes room."""
    buffer = RolloutBuffer(max_delay=3, sampler_capacity=2)
    for i in range(3):
        assert buffer.add(make_group(f"a{i}", 0, sampler="a"))  # recorded, as a stale arrival is
    assert buffer.add(make_group("b0", 0, sampler="b"))
    status = buffer.ledger.status
    assert [status[u] for u in ("a0", "a1", "a2", "b0")] == ["buffered", "buffered", "dropped:over_quota", "buffered"]
    assert buffer.held_by("a") == 2
    assert not buffer.would_keep(make_group("a9", 0, sampler="a")) and buffer.would_keep(
        make_group("b9", 0, sampler="b")
    )
    assert [g.group_uid for g in buffer.take(1, learner_version=0)] == ["a0"]
    assert buffer.would_keep(make_group("a3", 0, sampler="a")) and buffer.add(make_group("a3", 0, sampler="a"))
    assert status["a3"] == "buffered"
    forced = make_group("b1", 0, sampler="b")
    assert buffer.add(forced, drop="over_quota") and status["b1"] == "dropped:over_quota"  # the inbox's path
    assert buffer.add(make_group("a2", 0, sampler="a")) is False  # a dropped uid stays dropped: duplicate
    assert buffer.metrics()["hetero/dropped/over_quota"] == 2
    with pytest.raises(ValueError, match="sampler_capacity=0"):
        RolloutBuffer(max_delay=1, sampler_capacity=0)


def test_under_order_newest_the_quota_keeps_a_samplers_newest_groups(make_group):
    """At the quota, order="newest" keeps what take serves first: a newer arrival replaces the
    sampler's oldest group (dropped over_quota); one no newer than it is dropped on arrival."""
    buffer = RolloutBuffer(max_delay=5, order="newest", sampler_capacity=2)
    buffer.set_learner_version(2)
    for uid, version in [("a0", 0), ("a1", 1)]:
        assert buffer.add(make_group(uid, version, sampler="a"))
    assert not buffer.would_keep(make_group("a-old", 0, sampler="a"))
    assert buffer.would_keep(make_group("a2", 2, sampler="a"))
    assert buffer.add(make_group("a2", 2, sampler="a"))
    status = buffer.ledger.status
    assert (status["a0"], status["a1"], status["a2"]) == ("dropped:over_quota", "buffered", "buffered")
    assert buffer.add(make_group("a2b", 1, sampler="a")) and status["a2b"] == "dropped:over_quota"  # not newer than a1
    assert [g.group_uid for g in buffer.take(2, learner_version=2)] == ["a2", "a1"]


def test_add_validates_unless_the_caller_already_did(make_group):
    """Every caller of add but the inbox (which validates before its trust gate) is validated by
    the buffer; validated=True skips only the record checks, not the duplicate rule."""
    buffer = RolloutBuffer(max_delay=3)
    bad = make_group("bad", 0)
    bad.rewards = bad.rewards + np.float32(np.inf)
    assert buffer.add(bad) is False
    assert buffer.ledger.status["bad"] == "rejected:nonfinite_reward"
    good = make_group("good", 0)
    assert buffer.add(good, validated=True) is True
    assert buffer.add(good, validated=True) is False  # still a duplicate
    assert buffer.metrics()["hetero/rejected/duplicate"] == 1


def test_capacity_drops_oldest_as_overflow(make_group):
    buffer = RolloutBuffer(max_delay=10, capacity=2)
    for uid in "abc":
        buffer.add(make_group(uid, 0))
    assert buffer.ledger.status["a"] == "dropped:overflow"
    assert [g.group_uid for g in buffer.take(2, 0)] == ["b", "c"]
    with pytest.raises(ValueError, match="n=3 exceeds the buffer capacity=2"):
        buffer.take(3, 0)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(max_delay=-1), "max_delay=-1 must be an int >= 0"),
        (dict(max_delay=2.5), "max_delay=2.5"),
        (dict(max_delay=1, stale_policy="skip"), "stale_policy='skip'"),
        (dict(max_delay=1, order="random"), "order='random'"),
        (dict(max_delay=1, capacity=0), "capacity=0"),
    ],
)
def test_bad_config_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutBuffer(**kwargs)


def test_learner_version_cannot_go_backwards(make_group):
    buffer = RolloutBuffer(max_delay=1)
    buffer.set_learner_version(3)
    with pytest.raises(ValueError, match="learner_version=2 went backwards"):
        buffer.take(1, learner_version=2)


def test_drop_policy_times_out_with_clear_message(make_group):
    buffer = RolloutBuffer(max_delay=1, stale_policy="drop")
    buffer.add(make_group("only", 0))
    start = time.monotonic()
    with pytest.raises(BufferTimeout, match=r"for 2 groups at learner_version=0 .* have 1 fresh groups"):
        buffer.take(2, 0, timeout_s=0.2)
    assert 0.15 < time.monotonic() - start < 2.0
    assert buffer.metrics()["hetero/wait_s"] >= 0.15


def test_take_unblocks_when_a_producer_thread_adds(make_group):
    buffer = RolloutBuffer(max_delay=1)
    threading.Timer(0.1, lambda: buffer.add(make_group("late", 0))).start()
    groups = buffer.take(1, 0, timeout_s=5)
    assert [g.group_uid for g in groups] == ["late"]
    assert buffer.metrics()["hetero/wait_s"] >= 0.05


def test_wait_policy_waits_for_expected_groups_before_they_go_stale(make_group):
    buffer = RolloutBuffer(max_delay=1, stale_policy="wait")
    buffer.set_learner_version(1)
    buffer.add(make_group("fresh", 1))
    buffer.expect("slow", policy_version=0, sampler_id="s3")  # at v=1 it is usable, at v=2 it is not
    with pytest.raises(BufferTimeout, match=r"still waiting for 1 expected groups: slow \(v0, s3\)"):
        buffer.take(1, 1, timeout_s=0.1)
    threading.Timer(0.1, lambda: buffer.add(make_group("slow", 0, sampler="s3"))).start()
    assert [g.group_uid for g in buffer.take(2, 1, timeout_s=5)] == ["slow", "fresh"]
    # an announced group already past the bound is not worth waiting for
    buffer.add(make_group("fresh2", 1))
    buffer.expect("hopeless", policy_version=0)
    assert [g.group_uid for g in buffer.take(1, 2, timeout_s=5)] == ["fresh2"]
    # the same schedule under "drop" does not wait: the slow group is lost once the learner moves on
    dropping = RolloutBuffer(max_delay=1, stale_policy="drop")
    dropping.set_learner_version(1)
    dropping.add(make_group("fresh", 1))
    dropping.expect("slow", policy_version=0)
    assert [g.group_uid for g in dropping.take(1, 1, timeout_s=0.1)] == ["fresh"]
    dropping.set_learner_version(2)
    dropping.add(make_group("slow", 0))
    assert dropping.ledger.status["slow"] == "dropped:stale"


def test_state_dict_survives_a_checkpoint(make_group):
    buffer = RolloutBuffer(max_delay=3)
    buffer.set_learner_version(2)
    for i in range(4):
        buffer.add(make_group(f"g{i}", i % 3))
    consumed = [g.group_uid for g in buffer.take(2, 2)]
    blob = io.BytesIO()
    torch.save(buffer.state_dict(), blob)  # what a learner checkpoint does
    resumed = RolloutBuffer(max_delay=3)
    resumed.load_state_dict(torch.load(io.BytesIO(blob.getvalue()), weights_only=False))
    assert resumed.learner_version == 2 and len(resumed) == 2
    for uid in consumed:  # consumed before the checkpoint: never again
        assert resumed.add(make_group(uid, 2)) is False
    left = resumed.take(2, 3)
    assert sorted(g.group_uid for g in left + []) == sorted(set(f"g{i}" for i in range(4)) - set(consumed))
    original = {g.group_uid: g for g in buffer.take(2, 3)}
    for group in left:
        np.testing.assert_array_equal(group.sampler_logprobs, original[group.group_uid].sampler_logprobs)
    # a smaller bound after resume applies at once
    tighter = RolloutBuffer(max_delay=0)
    state = pickle.loads(pickle.dumps(buffer.state_dict()))
    tighter.load_state_dict(
        {
            **state,
            "groups": [make_group("h", 1).to_bytes()],
            "ledger": {"status": {**state["ledger"]["status"], "h": "buffered"}, "duplicates": {}},
        }
    )
    assert tighter.ledger.status["h"] == "dropped:stale"


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 3), st.integers(0, 6)),  # sampler, lag behind learner
        st.tuples(st.just("take"), st.integers(1, 4), st.integers(0, 2)),  # n, learner steps to advance first
        st.tuples(st.just("resume"), st.just(0), st.just(0)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, max_delay=st.integers(0, 4), order=st.sampled_from(["oldest", "newest"]))
def test_bound_and_exactly_once_under_random_arrivals(ops, max_delay, order):
    buffer = RolloutBuffer(max_delay=max_delay, order=order)
    version, counter = 0, 0
    generated, consumed = {}, []  # generated: uid -> policy version
    for kind, a, b in ops:
        if kind == "add":
            uid = f"s{a}-{counter}"
            counter += 1
            group_version = max(0, version - b)
            generated[uid] = group_version
            buffer.add(build_group(uid, group_version, group_size=2, response_len=3, sampler=f"s{a}"))
        elif kind == "take":
            version += b
            fresh_before = {
                uid: g.policy_version for uid, g in buffer._groups.items() if version - g.policy_version <= max_delay
            }
            try:
                taken = buffer.take(a, version, timeout_s=0)
            except BufferTimeout:
                assert len(fresh_before) < a  # only times out when there really is not enough
                continue
            for group in taken:
                assert version - group.policy_version <= max_delay
            versions = [g.policy_version for g in taken]
            rest = [v for uid, v in fresh_before.items() if uid not in {g.group_uid for g in taken}]
            if rest:  # order: nothing left behind is older (newer) than what was served
                assert max(versions) <= min(rest) if order == "oldest" else min(versions) >= max(rest)
            consumed += [g.group_uid for g in taken]
        else:
            state = pickle.loads(pickle.dumps(buffer.state_dict()))
            buffer = RolloutBuffer(max_delay=max_delay, order=order)
            buffer.load_state_dict(state)
    assert len(consumed) == len(set(consumed))
    ledger = buffer.ledger
    assert ledger.uids("consumed") == set(consumed)
    assert ledger.uids("consumed") | ledger.uids("dropped") | ledger.uids("buffered") == set(generated)
    counts = ledger.counts()
    assert counts["consumed"] + counts["dropped"] + counts["buffered"] == counts["generated"] == len(generated)
    for uid in ledger.uids("dropped"):  # only groups really past the bound are dropped (staleness only grows)
        assert ledger.status[uid] == "dropped:stale"
        assert version - generated[uid] > max_delay
    for uid in ledger.uids("buffered"):
        assert version - buffer._groups[uid].policy_version <= max_delay


def test_threads_add_while_learner_takes():
    buffer = RolloutBuffer(max_delay=2)
    n_producers, per_producer, batch = 4, 60, 5
    learner_version = [0]
    errors = []

    def produce(sampler):
        rng = np.random.default_rng(sampler)
        for i in range(per_producer):
            lag = int(rng.integers(0, 5))
            version = max(0, learner_version[0] - lag)
            buffer.add(build_group(f"s{sampler}-{i}", version, group_size=2, response_len=3, sampler=f"s{sampler}"))
            if rng.random() < 0.2:
                time.sleep(0.001)

    threads = [threading.Thread(target=produce, args=(s,)) for s in range(n_producers)]
    for thread in threads:
        thread.start()
    consumed = []
    while any(t.is_alive() for t in threads) or len(buffer) >= batch:
        try:
            groups = buffer.take(batch, learner_version[0], timeout_s=0.05)
        except BufferTimeout:
            continue
        for group in groups:
            if learner_version[0] - group.policy_version > 2:
                errors.append(group.group_uid)
        consumed += [g.group_uid for g in groups]
        learner_version[0] += 1
        buffer.set_learner_version(learner_version[0])
    for thread in threads:
        thread.join()
    assert not errors
    assert len(consumed) == len(set(consumed)) > 0
    counts = buffer.ledger.counts()
    assert counts["generated"] == n_producers * per_producer
    assert counts["consumed"] == len(consumed)
    assert counts["consumed"] + counts["dropped"] + counts["buffered"] == counts["generated"]


def test_the_timeout_names_the_rejections_when_every_group_was_refused():
    """A learner whose samplers are alive but not accepted (e.g. unenrolled) says so when it gives up."""
    from verl_ext.hetero.records import RecordRejected

    buffer = RolloutBuffer(max_delay=2, wait_timeout_s=0.2)
    for i in range(3):
        buffer.reject(RecordRejected("sampler_id", "unenrolled", "no key", sampler_id="s9", group_uid=f"g{i}"))
    with pytest.raises(BufferTimeout, match=r"rejected so far by reason: \{'unenrolled': 3\}"):
        buffer.take(1, learner_version=0)


def test_withheld_groups_wait_for_a_vouch_and_go_stale_as_unvouched(make_group):
    """A group added withheld (a trust gate's: no check vouched for it yet) counts as buffered but
    is not taken until vouch() names it; one the bound overtakes first is dropped as
    stale_unvouched; the withheld set survives a checkpoint."""
    buffer = RolloutBuffer(max_delay=1, wait_timeout_s=0.2)
    assert buffer.add(make_group("held", 0), withheld=True)
    assert buffer.add(make_group("free", 0))
    assert buffer.add(make_group("late", 0), withheld=True)
    assert len(buffer) == 3 and buffer.metrics()["hetero/withheld"] == 2
    assert [g.group_uid for g in buffer.take(1, learner_version=0)] == ["free"]
    with pytest.raises(BufferTimeout, match="2 withheld until a check vouches"):
        buffer.take(1, learner_version=0)
    assert buffer.vouch(["held", "free", "unknown"]) == 1  # only what is withheld is released
    restored = RolloutBuffer(max_delay=1, wait_timeout_s=0.2)
    restored.load_state_dict(pickle.loads(pickle.dumps(buffer.state_dict())))
    for b in (buffer, restored):
        assert [g.group_uid for g in b.take(1, learner_version=1)] == ["held"]
        b.set_learner_version(2)  # "late" (v0) is past the bound, never vouched for
        assert b.ledger.status["late"] == "dropped:stale_unvouched"
        assert b.metrics()["hetero/dropped/stale_unvouched"] == 1 and b.metrics()["hetero/withheld"] == 0


def test_a_take_waiting_while_groups_are_withheld_is_seen(make_group):
    """waits_on_withheld: a take() is blocked now and withheld groups exist (the trust gate then
    draws that sampler's arrivals for a check more often, to vouch for them sooner)."""
    buffer = RolloutBuffer(max_delay=2)
    assert buffer.add(make_group("held", 0), withheld=True)
    assert not buffer.waits_on_withheld()  # nobody waits
    taker = threading.Thread(target=lambda: buffer.take(1, learner_version=0, timeout_s=30))
    taker.start()
    deadline = time.monotonic() + 10
    while not buffer.waits_on_withheld() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert buffer.waits_on_withheld()
    assert buffer.vouch(["held"]) == 1
    taker.join(timeout=10)
    assert not taker.is_alive() and not buffer.waits_on_withheld()


def test_a_consumer_that_declares_its_demand_is_waiting_on_withheld_groups(make_group):
    """set_demand: the verl engine's pool ingress takes one group at a time between its reads, so
    no take() blocks while its slots wait; its declared demand counts as waiting all the same."""
    buffer = RolloutBuffer(max_delay=2)
    buffer.set_demand(3)
    assert not buffer.waits_on_withheld()  # nothing withheld: nothing to vouch for sooner
    assert buffer.add(make_group("held", 0), withheld=True)
    assert buffer.waits_on_withheld()
    buffer.set_demand(0)
    assert not buffer.waits_on_withheld()
