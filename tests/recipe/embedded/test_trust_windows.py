"""The trust gate where its books and its timing meet the buffer: what a quarantine counts as
purged, groups that claim a version at the moment the learner publishes it, and copies with their
rows moved or their numbers nudged. Real groups of the
tiny toy model, async mode's TrustGate and the real buffer, in the order the learner's calls make."""

from __future__ import annotations

import threading
import time

import numpy as np

from verl_ext.hetero.weights import serialize_state_dict

from .test_trust_gate import Lab, _with_rewards


def test_purged_counts_only_the_groups_a_quarantine_actually_dropped(tiny_model_path, tmp_path):
    """Three unchecked groups in, a step takes two, then the sampler is caught: one is dropped, and
    trust/purged says 1 (it said 3, counting the two already trained on)."""
    lab = Lab(tiny_model_path, tmp_path, "hetero.trust.verify_fraction=0", "hetero.trust.probation_groups=0")
    unchecked = lab.groups("sampler-1", n=3)
    for group in unchecked:
        assert lab.offer(group) is None
    taken = lab.buffer.take(2, learner_version=1)
    assert len(taken) == 2
    liar = lab.groups("sampler-1", n=1)[0]
    _with_rewards(lab, liar, 1.0 - liar.rewards)
    assert lab.offer(liar) == "bad_rewards"
    assert len(lab.buffer) == 0
    left = [g for g in unchecked if g.group_uid not in {t.group_uid for t in taken}]
    assert lab.buffer.ledger.status[left[0].group_uid] == "dropped:quarantined"
    assert lab.gate.metrics()["trust/purged"] == 1
    event = lab.gate.drain_events()[0]
    assert (event["purged"], event["unchecked_since_last_pass"]) == (1, 3)
    assert lab.buffer.metrics()["hetero/dropped/quarantined"] == 1


def _publish_v2_after(lab, delay_s: float, weights) -> threading.Thread:
    """The learner's _publish, spread out: the buffer accepts version 2 at once, the gate gets
    version 2's weights ``delay_s`` later (the weight store's publish in between)."""
    lab.buffer.set_learner_version(2)
    wire = "bf16" if lab.engine.hetero.weights_bf16 else None
    message = serialize_state_dict(weights.state_dict(), 2, wire)

    def publish():
        time.sleep(delay_s)
        lab.gate.remember(2, message)

    thread = threading.Thread(target=publish)
    thread.start()
    return thread


def test_false_logprobs_claiming_a_version_being_published_do_not_get_in(tiny_model_path, tmp_path):
    """A sampler on probation sends four groups with q x 1.5 claiming version 2 between the buffer
    accepting version 2 and the gate holding its weights: the first waits for the weights, is
    re-scored and refused, its sender quarantined; none reaches the learner (before: 4 of 4 admitted
    with 0 checks)."""
    lab = Lab(tiny_model_path, tmp_path)
    lies = lab.groups("sampler-5", n=4, model=lab.v1)
    for group in lies:
        group.policy_version = 2
        group.sampler_logprobs = group.sampler_logprobs * 1.5
    publishing = _publish_v2_after(lab, 0.3, lab.v1)
    t0 = time.perf_counter()
    reasons = [lab.offer(g) for g in lies]
    waited = time.perf_counter() - t0
    publishing.join()
    assert reasons == ["bad_logprobs"] + ["quarantined"] * 3
    assert waited >= 0.25  # it did wait for the weights: the check was made against them
    assert len(lab.buffer) == 0 and lab.gate.ledger.refusal("sampler-5") == "quarantined"
    assert lab.gate.metrics()["trust/checked"] == 1


def test_honest_groups_in_that_gap_wait_and_pass_and_a_check_that_cannot_be_made_refuses(tiny_model_path, tmp_path):
    lab = Lab(tiny_model_path, tmp_path)
    honest = lab.groups("sampler-6", n=2, model=lab.v1)
    for group in honest:
        group.policy_version = 2
    publishing = _publish_v2_after(lab, 0.2, lab.v1)
    assert [lab.offer(g) for g in honest] == [None, None]
    publishing.join()
    assert lab.gate.metrics()["trust/checked"] == 2  # both re-scored (probation), both passed
    # weights that never come in time: refused by name, without blame
    lab.gate.version_wait_s = 0.05
    lab.buffer.set_learner_version(3)
    late = lab.groups("sampler-7", n=1, model=lab.v1)[0]
    late.policy_version = 3
    assert lab.offer(late) == "unverifiable_version"
    assert lab.gate.ledger.refusal("sampler-7") is None and lab.gate.metrics()["trust/failed"] == 0
    # a version older than the newest held, not held (as after a resume): not waited for, refused
    lab.gate.version_wait_s = 30.0
    fresh = Lab(tiny_model_path, tmp_path)
    fresh.gate.verifier.kept.versions.pop(0)  # the resumed learner holds only the version it resumed at
    old = fresh.groups("sampler-8", n=1)[0]  # version 0, within the bound
    t0 = time.perf_counter()
    assert fresh.offer(old) == "unverifiable_version"
    assert time.perf_counter() - t0 < 5
    # ... but a group already past the staleness bound is left to the buffer, which drops it unused
    # (an async run's honest samplers send such groups all the time)
    fresh.buffer.set_learner_version(fresh.engine.hetero.max_delay + 1)
    stale = fresh.groups("sampler-8", n=1)[0]
    checked = fresh.gate.metrics()["trust/checked"]
    assert fresh.offer(stale) is None and fresh.buffer.ledger.status[stale.group_uid] == "dropped:stale"
    assert fresh.gate.metrics()["trust/checked"] == checked and len(fresh.buffer) == 0


def _copy(group, sampler: str, uid: str):
    from verl_ext.hetero.records import RolloutGroup

    copy = RolloutGroup.from_bytes(group.to_bytes())
    copy.sampler_id, copy.group_uid = sampler, uid
    return copy


def test_near_copies_are_replays_and_honest_distinct_groups_are_not(tiny_model_path, tmp_path):
    """An accepted group re-published by another sampler with its rows rotated, with one log q off
    by 1e-5, or claiming another version, is refused as replayed (before: 8 of 8 admitted each);
    distinct honest groups keep passing."""
    lab = Lab(tiny_model_path, tmp_path, "hetero.trust.verify_fraction=1")
    honest = lab.groups("sampler-0", n=6)
    assert [lab.offer(g) for g in honest] == [None] * 6
    rotated = _copy(honest[0], "sampler-9", "sampler-9-rot")
    for name in ("response_ids", "response_mask", "sampler_logprobs", "rewards", "advantages"):
        setattr(rotated, name, np.roll(getattr(rotated, name), 1, axis=0))
    assert not np.array_equal(rotated.response_ids, honest[0].response_ids)  # the rows did move
    nudged = _copy(honest[1], "sampler-9", "sampler-9-nudged")
    row, col = map(int, np.argwhere(nudged.response_mask)[0])
    nudged.sampler_logprobs[row, col] += 1e-5
    other_version = _copy(honest[2], "sampler-9", "sampler-9-v0")
    other_version.policy_version = 1
    assert [lab.offer(g) for g in (rotated, nudged, other_version)] == ["replayed"] * 3
    assert lab.gate.ledger.refusal("sampler-9") is None  # without blame
    assert [lab.offer(g) for g in lab.groups("sampler-0", n=6)] == [None] * 6


def test_a_copy_that_arrives_first_is_kept_and_earns_its_copier_nothing(tiny_model_path, tmp_path):
    """The learner cannot tell which of two equal groups was copied: the first to arrive is kept,
    the second refused, and the credit the first earned by its check is withdrawn (both without
    blame), so front-running an honest sampler gains a copier no trust and no probation."""
    lab = Lab(tiny_model_path, tmp_path, "hetero.trust.verify_fraction=1")
    original = lab.groups("sampler-0", n=1)[0]
    front_run = _copy(original, "sampler-9", "sampler-9-first")
    # in a slot of sampler-9's that is assigned the same prompt (else it fails as prompt_not_assigned)
    front_run.batch_index, front_run.batch_slot = lab.batch_assigned("sampler-9", original), 0
    front_run.response_ids, front_run.response_mask = (
        front_run.response_ids[::-1].copy(),
        front_run.response_mask[::-1].copy(),
    )
    front_run.sampler_logprobs = front_run.sampler_logprobs[::-1].copy()
    front_run.rewards, front_run.advantages = front_run.rewards[::-1].copy(), front_run.advantages[::-1].copy()
    assert lab.offer(front_run) is None  # checked: its q is right, it is someone's honest group
    assert lab.gate.ledger.samplers["sampler-9"].checks == 1
    assert lab.offer(original) == "replayed"
    books = lab.gate.ledger.samplers["sampler-9"]
    assert books.checks == 0 and books.score < 1.0  # still on probation, the check's credit gone
    assert lab.gate.metrics()["trust/withdrawn"] == 1
    assert lab.gate.ledger.refusal("sampler-9") is None and lab.gate.ledger.refusal("sampler-0") is None
    # a third copy takes nothing more
    assert lab.offer(_copy(original, "sampler-8", "sampler-8-third")) == "replayed"
    assert lab.gate.metrics()["trust/withdrawn"] == 1
