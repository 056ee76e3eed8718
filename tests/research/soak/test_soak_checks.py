"""The soak's pieces that need no run (``research/soak``): its damaged exchange files are
never loadable, and its accounting by uid and its fault judges say what they should. The soak
itself is ``test_soak_slow.py``."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from verl_ext.hetero.transport import CorruptMessage, FsspecTransport


from research.soak.checks import (  # noqa: E402
    FinalState,
    RunEnd,
    StepCheck,
    account_uids,
    check_steps,
    honest_rejected,
    judge_faults,
    liar_figures,
)
from research.soak.faults import ExchangeDamage, Fault, fault_weights  # noqa: E402


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "half_written"])
def test_damaged_files_are_never_loaded(tmp_path, damage):
    transport = FsspecTransport(str(tmp_path))
    payload = bytes(range(256)) * 4
    transport.put("rollouts", "good", payload)
    for nonce in range(4):  # half_written: a temporary or an uncommitted payload, at random
        ExchangeDamage(tmp_path, random.Random(nonce)).write("rollouts", f"fault-{nonce}", payload, damage, nonce)
    assert transport.get("rollouts", "good") == payload
    for nonce in range(4):
        with pytest.raises((KeyError, CorruptMessage)):
            transport.get("rollouts", f"fault-{nonce}")
    if damage == "half_written":
        assert transport.keys("rollouts") == ["good"] and transport.incomplete("rollouts")


def test_fault_kinds_across_the_link_leave_out_the_file_faults():
    kinds = set(fault_weights(wan=True))
    assert {"link_cut", "link_slow", "worker_gone", "sampler_kill"} <= kinds
    assert not any(k.startswith(("rollout_", "weights_")) for k in kinds)
    assert not {"link_cut"} & set(fault_weights(wan=False))


def test_accounting_by_uid_counts_lost_reused_and_unknown_keys():
    seen = {"s0-b1-0": {"a"}, "s1-b1-1": {"b", "c"}, "s2-b1-2": {"d"}, "s0-b2-0": {"e"}, "fault-x-1": {"f"}}
    ledger = {
        "s0-b1-0": "consumed",
        "s1-b1-1": "dropped:stale",
        "s2-r1-b3-0": "rejected:future_version",
        "weird": "consumed",
    }
    account = account_uids(seen, ledger, in_transport={"s2-b1-2"})
    assert account.generated == {"s0-b1-0", "s1-b1-1", "s2-b1-2", "s0-b2-0", "s2-r1-b3-0"}
    assert account.outcome == Counter(
        {
            "consumed": 1,
            "dropped": 1,
            "dropped:stale": 1,
            "rejected": 1,
            "rejected:future_version": 1,
            "in_transport": 1,
        }
    )
    assert account.lost_uids == ["s0-b2-0"] and account.reused == {"s1-b1-1": 2} and account.lost == 2
    assert len(account.errors) == 1 and "weird" in account.errors[0]


def test_step_metrics_against_the_ledger():
    final = FinalState({f"s0-b1-{i}": "consumed" for i in range(8)}, {}, 2, "live learner")
    rows = [{"step": 1, "hetero/consumed": 4.0}, {"step": 1, "eval/x": 0.5}, {"step": 2, "hetero/consumed": 4.0}]
    assert check_steps(rows, final, 4, {"s0-b1-0"}) == StepCheck(2, 2, 8, 8)
    twice = check_steps(rows + [{"step": 3, "hetero/consumed": 4.0, "actor/loss": float("nan")}], final, 4, set())
    assert twice.consumed_twice == 4 and len(twice.errors) == 3  # no group seen; mismatch; NaN loss


def test_fault_judges():
    faults = [
        Fault("sampler_kill", 10.0, "sampler-0-0", {"segment": 0, "restart_name": "sampler-0-1"}),
        Fault("sampler_kill", 58.0, "sampler-1-0", {"segment": 0, "restart_name": "sampler-1-1"}),
        Fault("learner_crash", 20.0, "learner", {"segment": 0}),
        Fault("bad_group_size", 5.0, "fault-badgroupsize-1"),
        Fault("rollout_corrupt", 5.0, "fault-rolloutcorrupt-2"),
        Fault("weights_truncated", 5.0, "v3", {"version_at_fault": 2}),
        Fault("duplicate_message", 5.0, "s0-b1-0"),
        Fault("clock_skew_rollout", 5.0, "fault-clockskewrollout-3"),
        # a sampler's group re-sent with a skewed clock, refused as future_version: its version was
        # lost when the learner of its segment crashed (the next segment resumed from a checkpoint),
        # not when no crash ended its segment
        Fault("clock_skew_rollout", 5.0, "s1-b2-0", {"segment": 0}),
        Fault("clock_skew_rollout", 65.0, "s1-b9-0", {"segment": 1}),
    ]
    end = RunEnd(
        ledger={
            "fault-badgroupsize-1": "rejected:group_size",
            "fault-rolloutcorrupt-2": "consumed",
            "s0-b1-0": "consumed",
            "s1-b2-0": "rejected:future_version",
            "s1-b9-0": "rejected:future_version",
        },
        in_transport={"fault-clockskewrollout-3"},
        final_version=6,
        max_delay=4,
        seen_names={"0:sampler-0-1"},
        segment_end={0: 60.0},
        segments=2,
        end_s=70.0,
    )
    judge_faults(faults, end)
    assert [f.outcome for f in faults] == [
        "survived",
        "not judged: run ended before the restart",
        "survived",
        "survived",
        "NOT SURVIVED: accepted as 'consumed'",
        "NOT SURVIVED: learner stuck below version 7",
        "survived",
        "survived (still in transport)",
        "survived (future_version: its version was lost in the learner crash that ended its segment)",
        "NOT SURVIVED: ledger says 'rejected:future_version'",
    ]


def test_liar_accounting_counts_poisoned_groups_false_alarms_and_time_to_quarantine(tmp_path):
    """--liars: a lying group consumed is poisoned; an honest uid refused by a trust reason or
    purged by a quarantine is a false alarm (other refusals, e.g. future_version after a crash, are not)."""
    from research.soak.liars import liar_id
    from verl_ext.rundir import append_event

    ledger = {
        "s0-ab12-b1-0": "consumed",
        "s1-ab12-b1-1": "rejected:bad_logprobs",
        "s2-ab12-b1-2": "dropped:quarantined",
        "s0-ab12-b2-0": "rejected:future_version",
        "s0-ab12-b3-0": "dropped:stale",
        "sampler-60-qscaled-liars-b0-0": "rejected:bad_logprobs",
        "sampler-60-qscaled-liars-b1-0": "rejected:quarantined",
        "sampler-64-rewardflip-liars-b2-0": "consumed",
        "sampler-67-forgedsignature-liars-b3-0": "rejected:unenrolled",
        "s50-bf16-b1-0": "consumed",
        "s50-bf16-b1-1": "rejected:token_mismatch",
        "s50-bf16-b2-0": "dropped:stale",
    }
    assert honest_rejected(ledger) == ["s1-ab12-b1-1", "s2-ab12-b1-2", "s50-bf16-b1-1"]
    lied = {
        uid: kind
        for uid, kind in [
            ("sampler-60-qscaled-liars-b0-0", "q_scaled"),
            ("sampler-60-qscaled-liars-b1-0", "q_scaled"),
            ("sampler-64-rewardflip-liars-b2-0", "reward_flip"),
            ("sampler-67-forgedsignature-liars-b3-0", "forged_signature"),
            ("sampler-60-qscaled-liars-b9-0", "q_scaled"),
        ]
    }  # the last one never read
    append_event(tmp_path, {"step": 3, "event": "quarantined", "sampler_id": liar_id("q_scaled"), "time": 110.5})
    figures = liar_figures(ledger, {"lied": lied, "first_sent": {"q_scaled": 100.0, "reward_flip": 105.0}}, tmp_path)
    assert figures["poisoned_trained"] == 1 and figures["poisoned_by_lie"] == {"reward_flip": 1}
    assert figures["outcomes"]["q_scaled"] == {"rejected:bad_logprobs": 1, "rejected:quarantined": 1, "not read": 1}
    assert figures["seconds_to_quarantine"]["q_scaled"] == 10.5
    assert figures["seconds_to_quarantine"]["reward_flip"] is None  # never quarantined
    assert figures["honest_bf16"] == {"consumed": 1, "dropped": 1, "rejected": 1}  # the honest bf16 sampler's
    account = account_uids({}, ledger, in_transport=set())
    assert account.errors == []  # liar uids are known keys, not unaccounted ones


def test_a_reward_lie_that_changes_nothing_is_not_sent():
    """reward_inflate on a group whose every response already earned 1 is the truth: the crew sends
    nothing rather than count an honest group as a poisoned one (a soak once failed on exactly that)."""
    import numpy as np

    from research.soak.liars import LiarCrew
    from verl_ext.hetero.records import RolloutGroup

    crew = LiarCrew.__new__(LiarCrew)  # the reward branch reads the group only, until it changes a reward
    group = RolloutGroup(
        "u",
        np.array([1, 2]),
        np.array([[3, 4], [5, 6]]),
        np.ones((2, 2), np.int8),
        np.full((2, 2), -0.5, np.float32),
        np.ones(2, np.float32),
        np.zeros(2, np.float32),
        0,
        "s",
    )
    assert crew._lie("reward_inflate", group) is False
    assert group.rewards.tolist() == [1.0, 1.0]


def test_poisoned_groups_are_judged_against_the_bound_of_their_lie(tmp_path):
    """A lie each check catches (q x 1.5, malformed) may get nothing trained on; a token lie, which a
    check catches with p < 1, as many as the bound allows at 1% (docs/reliability.md): the soak
    fails only beyond it."""
    from research.soak.checks import TOKEN_LIE_CATCH, poison_bound
    from research.soak.report import SoakResult

    assert poison_bound("q_scaled", 0.1) == poison_bound("malformed", 0.1) == poison_bound("patient_replay", 0.1) == 0
    k = poison_bound("patient_other_weights", 0.1)
    assert (
        (1 - 0.1 * TOKEN_LIE_CATCH["other_weights"]) ** k
        <= 0.01
        < (1 - 0.1 * TOKEN_LIE_CATCH["other_weights"]) ** (k - 1)
    )
    assert poison_bound("truncated", 0.5) < poison_bound("truncated", 0.1)  # checked more often: fewer get in
    ledger = {"sampler-70-patientotherweights-liars-b0-0": "consumed", "sampler-60-qscaled-liars-b0-0": "consumed"}
    within = liar_figures(
        ledger, {"lied": {"sampler-70-patientotherweights-liars-b0-0": "patient_other_weights"}}, tmp_path
    )
    beyond = liar_figures(
        ledger, {"lied": {k: v for k, v in [("sampler-60-qscaled-liars-b0-0", "q_scaled")]}}, tmp_path
    )
    assert within["poisoned_trained"] == 1 and within["poisoned_beyond_bound"] == {}
    assert beyond["poisoned_beyond_bound"] == {"q_scaled": 1}

    def result(liars):
        return SoakResult(5, 5, [], {}, 0, 0, [], 1.0, str(tmp_path), liars=liars)

    assert result(within).ok and not result(beyond).ok
