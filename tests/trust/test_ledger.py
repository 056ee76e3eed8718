"""TrustLedger (verl_ext.trust.ledger): argument checks, which groups are checked (probation, then
a fraction drawn under the learner's secret), the trust score and quarantine with its purge, the divergence bound, metrics,
events and the state_dict round trip. Expectations come from the module's documented rules."""

import copy
import math

import numpy as np
import pytest

from verl_ext.trust.ledger import TrustLedger


def ledger(**kw):
    # by default no group is checked by chance, so only probation decides
    kw.setdefault("verify_fraction", 0.0)
    kw.setdefault("probation_groups", 0)
    return TrustLedger(**kw)


@pytest.mark.parametrize(
    "param,value",
    [
        ("verify_fraction", -0.1),
        ("verify_fraction", 1.1),
        ("probation_groups", -1),
        ("penalty", -0.5),
        ("recovery", -0.1),
        ("quarantine_below", 1.5),
        ("quarantine_below", -0.1),
        ("max_divergence", -0.1),
        ("divergence_window", 0),
    ],
)
def test_constructor_rejects_bad_values(param, value):
    with pytest.raises(ValueError, match=param):
        TrustLedger(**{param: value})


def test_the_ranges_are_checked_once_under_the_callers_names():
    """TrustLedger.check_arguments owns the ranges: hetero.trust's validation calls it with its
    hydra keys (TrustConfig maps every constructor argument), the constructor without."""
    from verl_ext.trust.config import TrustConfig

    assert set(TrustConfig._LEDGER_FIELDS) == set(TrustLedger.RANGES)
    with pytest.raises(ValueError, match=r"^hetero\.trust\.trust_penalty=-1\.0 must be >= 0$"):
        TrustLedger.check_arguments({"penalty": -1.0}, names={"penalty": "hetero.trust.trust_penalty"})
    with pytest.raises(ValueError, match=r"^hetero\.trust\.trust_penalty=-1\.0 must be >= 0$"):
        TrustConfig(trust_penalty=-1.0).validate()
    with pytest.raises(ValueError, match=r"^max_divergence=nan must be >= 0"):
        TrustLedger(max_divergence=float("nan"))


def test_edge_values_are_accepted():
    # the documented ranges are closed: [0, 1] and >= 0 / >= 1
    TrustLedger(
        verify_fraction=0.0,
        probation_groups=0,
        penalty=0.0,
        recovery=0.0,
        quarantine_below=0.0,
        max_divergence=0.0,
        divergence_window=1,
    )
    TrustLedger(verify_fraction=1.0, quarantine_below=1.0)


def test_probation_checks_every_group_then_none():
    t = ledger(probation_groups=3)
    seen = []
    for i in range(6):
        check = t.should_check("s", f"g{i}")
        seen.append(check)
        if check:  # probation counts recorded checks, not draws
            t.record("s", f"g{i}", passed=True)
    assert seen == [True, True, True, False, False, False]


def test_probation_is_per_sampler():
    t = ledger(probation_groups=1)
    assert t.should_check("a", "g0")
    t.record("a", "g0", passed=True)
    assert not t.should_check("a", "g1")
    assert t.should_check("b", "g1")  # b has not been checked yet


def test_verify_fraction_is_binomial_and_keyed_by_the_secret():
    n, p = 4000, 0.25
    keys = [f"g{i}" for i in range(n)]
    t = ledger(verify_fraction=p, secret=b"a")
    draws = [t.should_check("s", k) for k in keys]
    tol = 5 * math.sqrt(p * (1 - p) / n)  # 5 standard deviations of the sample fraction
    assert abs(np.mean(draws) - p) < tol
    # the same group draws the same way, whatever came before it
    assert [t.should_check("s", k) for k in reversed(keys)] == draws[::-1]
    assert [ledger(verify_fraction=p, secret=b"a").should_check("s", k) for k in keys] == draws
    assert [ledger(verify_fraction=p, secret=b"b").should_check("s", k) for k in keys] != draws


def test_no_sampler_can_predict_the_draw_from_the_config():
    """Two learners with the same config (nothing secret in it) draw differently: the key of the
    draw is made at start, not derived from the config, the seed or what the exchange lists."""
    keys = [f"g{i}" for i in range(200)]
    first, second = ledger(verify_fraction=0.5), ledger(verify_fraction=0.5)
    assert first.secret != second.secret and len(first.secret) == 32
    assert [first.should_check("s", k) for k in keys] != [second.should_check("s", k) for k in keys]


def test_one_failure_quarantines_and_purges_since_last_pass():
    t = ledger(penalty=1.0, quarantine_below=0.5)
    t.accepted("a", "u1")
    t.accepted("a", "u2")
    t.record("a", "c1", passed=True)  # vouches for u1, u2
    t.accepted("a", "u3")
    t.accepted("a", "u4")
    assert t.refusal("a") is None
    buffered = {"u4", "x"}  # u3 was already taken by a step: it cannot be dropped any more

    def drop(uids):
        gone = buffered & set(uids)
        buffered.difference_update(gone)
        return len(gone)

    assert t.record("a", "c2", passed=False, reason="logprob", drop=drop) == ["u3", "u4"]
    assert t.refusal("a") == "quarantined" and buffered == {"x"}

    m = t.metrics()
    assert m["trust/quarantined"] == 1
    assert m["trust/failed/logprob"] == 1 and m["trust/failed"] == 1
    assert m["trust/purged"] == 1  # only what was dropped, not the group already trained on
    assert m["trust/checked"] == 2
    assert m["trust/a/score"] == 0.0  # 1 - 1.0, floored at 0

    # already quarantined: nothing more to purge, no second event, still counted as a failure
    t.accepted("a", "u5")
    assert t.record("a", "c3", passed=False, reason="reward") == []
    events = t.drain_events()
    assert len(events) == 1
    ev = events[0]
    assert (ev["event"], ev["sampler_id"], ev["reason"], ev["purged"]) == ("quarantined", "a", "logprob", 1)
    assert ev["unchecked_since_last_pass"] == 2
    assert t.drain_events() == []
    m = t.metrics()
    assert m["trust/quarantined"] == 1 and m["trust/purged"] == 1
    assert m["trust/failed/reward"] == 1 and m["trust/failed"] == 2


def test_lenient_rules_need_repeated_failures():
    penalty, recovery, below = 0.3, 0.1, 0.5
    # consecutive failures from score 1 until score < below: smallest k with 1 - k*penalty < below
    k = math.floor((1 - below) / penalty) + 1
    assert k == 2
    t = ledger(penalty=penalty, recovery=recovery, quarantine_below=below)
    for i in range(1, k + 1):
        t.record("s", f"f{i}", passed=False, reason="x")
        assert (t.refusal("s") == "quarantined") == (i == k)
    assert t.metrics()["trust/s/score"] == pytest.approx(1 - k * penalty)


def test_passes_recover_score_capped_at_one():
    t = ledger(penalty=0.3, recovery=0.1, quarantine_below=0.5)
    t.record("s", "f1", passed=False)  # 0.7
    t.record("s", "p1", passed=True)  # 0.8
    t.record("s", "p2", passed=True)  # 0.9
    t.record("s", "f2", passed=False)  # 0.6: recovery kept it above the bound
    assert t.refusal("s") is None
    assert t.metrics()["trust/s/score"] == pytest.approx(0.6)
    for i in range(10):
        t.record("s", f"p{i + 3}", passed=True)
    assert t.metrics()["trust/s/score"] == 1.0  # capped, not 1.6
    t.record("s", "f3", passed=False)
    assert t.refusal("s") is None  # from the cap, one failure leaves 0.7


def test_other_samplers_unaffected_by_quarantine():
    t = ledger(probation_groups=2)
    t.accepted("b", "ub1")
    t.accepted("a", "ua1")
    assert t.record("a", "c", passed=False, reason="x") == ["ua1"]  # none of b's groups
    assert t.refusal("a") == "quarantined"
    assert t.refusal("b") is None
    assert t.should_check("b", "g9")  # b is still on probation
    m = t.metrics()
    assert m["trust/b/score"] == 1.0 and m["trust/quarantined"] == 1
    # b's own books are intact: its accepted group is purged only if b itself is quarantined
    assert t.record("b", "c", passed=False, reason="x") == ["ub1"]


def test_divergence_window_bound_and_events():
    t = ledger(max_divergence=0.1, divergence_window=3)
    values = []

    def observe(v):
        values.append(v)
        t.observe_divergence("s", v)

    for v in (0.05, 0.05, 0.05):
        observe(v)
        assert t.refusal("s") is None
    observe(0.5)  # window [0.05, 0.05, 0.5], mean 0.2 > 0.1
    assert t.refusal("s") == "divergent"
    observe(0.5)
    observe(0.5)
    observe(0.0)  # window [0.5, 0.5, 0.0]
    observe(0.0)  # window [0.5, 0.0, 0.0]
    assert t.refusal("s") == "divergent"
    observe(0.0)  # window [0, 0, 0]: under, though the mean over all values is still above 0.1
    assert np.mean(values) > 0.1
    assert t.refusal("s") is None
    assert [e["event"] for e in t.drain_events()] == ["divergence_over_bound", "divergence_back_under_bound"]
    assert t.metrics()["trust/s/divergence"] == pytest.approx(np.mean(values[-3:]))
    assert t.refusal("other") is None


def test_divergence_off_when_bound_zero():
    t = ledger(max_divergence=0.0, divergence_window=2)
    for _ in range(5):
        t.observe_divergence("s", 100.0)
    assert t.refusal("s") is None
    assert t.drain_events() == []
    assert "trust/s/divergence" not in t.metrics()


def test_state_dict_round_trip():
    kw = dict(verify_fraction=0.3, probation_groups=1, max_divergence=0.1, divergence_window=2)
    old = TrustLedger(**kw)
    for i in range(20):
        old.should_check("b", f"k{i}")
    old.record("b", "c0", passed=True)
    old.accepted("a", "ua")
    assert old.record("a", "c1", passed=False, reason="logprob") == ["ua"]
    old.observe_divergence("d", 1.0)  # d is over the divergence bound
    old.refused("quarantined")

    new = TrustLedger(**kw)  # another secret of its own: the run's must come from the state
    new.load_state_dict(copy.deepcopy(old.state_dict()))
    assert new.refusal("a") == "quarantined"
    assert new.refusal("d") == "divergent"
    assert new.refusal("b") is None
    assert new.metrics() == old.metrics()
    # quarantine happens once, also across a resume
    assert new.record("a", "c2", passed=False, reason="logprob") == []
    assert new.drain_events() == []
    keys = [f"later{i}" for i in range(50)]
    assert [new.should_check("b", k) for k in keys] == [old.should_check("b", k) for k in keys]


def test_purge_list_survives_resume():
    """The buffer is restored with the unchecked groups: a quarantine after the resume purges them."""
    old = ledger()
    old.accepted("a", "u1")  # unchecked, in the buffer that the checkpoint also saves
    new = ledger()
    new.load_state_dict(old.state_dict())
    assert new.record("a", "c", passed=False, reason="x") == old.record("a", "c", passed=False, reason="x") == ["u1"]


def test_a_pass_vouches_only_for_groups_that_arrived_before_the_checked_one():
    """A group sent after the checked one (it may reach the buffer before the check's verdict) is
    not vouched for by it: a liar cannot ride on an honest group's check it did not know of. What
    is not vouched for stays purgeable, also across a resume (older checkpoints: bare uids)."""
    t = ledger()
    released = []
    t.accepted("a", "before", arrival=1)
    t.accepted("a", "after", arrival=3)  # accepted while the group that arrived 2nd was checked
    t.record("a", "checked", passed=True, arrival=2, release=lambda uids: released.extend(uids) or len(uids))
    assert released == ["before"] and t.metrics()["trust/vouched"] == 1
    new = ledger()
    state = t.state_dict()
    state["samplers"]["a"]["since_good_check"].append("bare-uid")
    new.load_state_dict(state)
    assert new.record("a", "lie", passed=False, reason="x") == ["after", "bare-uid"]
