"""The trust checks in their own process (``hetero.trust.check_process``, :mod:`recipe.gepo.embedded.checker`):
a real :class:`TrustChecker` actor on a local Ray, the learner's gate and buffer behind a real
:class:`RolloutInbox` on a filesystem transport, groups of the tiny toy model. A lying group is
still refused and quarantines its sampler, honest groups get in, no group enters the buffer
before its verdict, groups awaiting one count against their sampler's quota, and the checks ran in
the checker's process at low priority on the system cores, none in the caller's; while the
learner is blocked on verdicts, its cores are lent to the checker, and taken back."""

from __future__ import annotations

import os
import time

import pytest
import ray

from recipe.gepo.embedded.checker import CHECKER_NICE, OffloadedChecks, VerdictBlockClock, launch_checker
from recipe.gepo.embedded.loop import build_buffer
from recipe.gepo.embedded.trust_wiring import embedded_gate, embedded_verifier
from verl_ext.hetero.exchange import RolloutInbox, send_group
from verl_ext.hetero.protocol import WEIGHTS_TOPIC, TransportSpec, version_key
from verl_ext.hetero.transport import FsspecTransport
from verl_ext.hetero.weights import WeightStore, serialize_state_dict

from .test_trust_gate import Lab

pytestmark = pytest.mark.slow  # a Ray instance and a checker process with its model: ~15 s on 2 cores


def _learner(model_path: str, run_dir, exchange, *overrides: str):
    """The learner's side as TransportSource builds it, at version 1: its buffer, a gate without a
    verifier of its own with the checks in a checker actor (versions 0 and 1 published), and an
    inbox on a filesystem exchange. Returns (lab, buffer, checks, transport, inbox)."""
    lab = Lab(model_path, run_dir, *overrides)
    buffer = build_buffer(lab.engine, lab.task)
    buffer.set_learner_version(1)
    checks = _offloaded(lab, model_path, buffer)
    transport = FsspecTransport(str(exchange))
    return lab, buffer, checks, transport, RolloutInbox(transport, buffer, gate=checks)


def _offloaded(lab: Lab, model_path: str, buffer) -> OffloadedChecks:
    gate = embedded_gate(lab.engine, model_path, lab.task, buffer, local_checks=False)
    assert gate.verifier is None  # no model copy here: the checker holds it
    checks = OffloadedChecks(
        gate, lambda: launch_checker(lab.engine, model_path), keep_versions=lab.engine.hetero.max_delay + 1
    )
    checks.remember(0, serialize_state_dict(lab.model.state_dict(), 0))
    checks.remember(1, serialize_state_dict(lab.v1.state_dict(), 1))
    return checks


def _drain(inbox: RolloutInbox, checks: OffloadedChecks, timeout_s: float = 120.0) -> None:
    """Poll as the learner's poll thread does until no verdict is outstanding."""
    inbox.poll()
    deadline = time.monotonic() + timeout_s
    while checks.outstanding():
        assert time.monotonic() < deadline, "verdicts did not come back"
        checks.wait(0.5)
        inbox.poll()


def test_lies_are_refused_and_honest_groups_admitted_by_a_checker_process_at_low_priority(
    local_ray, tiny_model_path, tmp_path
):
    system_core = os.cpu_count() - 1
    lab, buffer, checks, transport, inbox = _learner(
        tiny_model_path, tmp_path / "run", tmp_path / "exchange", f"hetero.system_cpus=[{system_core}]"
    )

    honest = lab.groups("sampler-0", n=3)
    lies = lab.groups("sampler-1", n=3)
    for group in lies:  # on probation: every group re-scored
        group.sampler_logprobs = group.sampler_logprobs * 1.5
    for group in honest + lies:
        send_group(transport, group)
    inbox.poll()
    # read and begun, none in the buffer before its verdict
    assert checks.outstanding() == 6 and len(buffer) == 0
    assert checks.awaiting("sampler-0") == 3 and checks.awaiting("sampler-1") == 3
    _drain(inbox, checks)

    status = buffer.ledger.status
    assert all(status[g.group_uid] == "buffered" for g in honest)
    refused = [status[g.group_uid] for g in lies]
    assert refused[0] == "rejected:bad_logprobs" and set(refused) <= {"rejected:bad_logprobs", "rejected:quarantined"}
    assert checks.gate.ledger.refusal("sampler-1") == "quarantined"
    assert checks.gate.ledger.refusal("sampler-0") is None
    metrics = checks.gate.metrics()
    assert metrics["trust/checked"] >= 4 and metrics["trust/failed"] >= 1

    # the verdicts came from another process, every thread at the checker's nice level on the
    # system cores, and no check ran here
    where = ray.get(checks.checker.describe.remote())
    assert where["pid"] != os.getpid()
    assert where["nice"] == [CHECKER_NICE]
    assert where["cpus"] == [[system_core]]
    assert metrics["perf/trust_check_cpu_s_total"] > 0
    assert metrics["perf/trust_check_learner_cpu_s_total"] == 0
    checks.close()


def test_groups_awaiting_a_verdict_count_against_their_samplers_quota(local_ray, tiny_model_path, tmp_path):
    lab, buffer, checks, transport, inbox = _learner(
        tiny_model_path, tmp_path / "run", tmp_path / "exchange", "hetero.max_buffered_per_sampler=2"
    )
    flood = lab.groups("sampler-2", n=4)
    for group in flood:
        send_group(transport, group)
    inbox.poll()
    # two await their verdict (the quota), the other two were dropped on arrival, unchecked
    assert checks.awaiting("sampler-2") == 2 and len(buffer) == 0
    assert sorted(buffer.ledger.status.get(g.group_uid, "awaiting") for g in flood) == [
        "awaiting",
        "awaiting",
        "dropped:over_quota",
        "dropped:over_quota",
    ]
    _drain(inbox, checks)
    assert len(buffer) == 2 and checks.gate.metrics()["trust/sampler-2/passed_over"] == 2
    checks.close()


def test_the_checker_reads_published_weights_from_the_store_and_not_a_copy_rewritten_there(
    local_ray, tiny_model_path, tmp_path
):
    """Versions the learner's weight store still keeps go to the checker as their published
    SHA-256 (the learner puts nothing in the object store); a message rewritten in the transport
    under a version's name (anyone who can send groups can write there) is not used: the learner's
    own copy goes instead, and groups are judged against the learner's weights."""
    lab = Lab(tiny_model_path, tmp_path / "run")
    buffer = build_buffer(lab.engine, lab.task)
    buffer.set_learner_version(1)
    exchange = tmp_path / "exchange"
    transport = FsspecTransport(str(exchange))
    store = WeightStore(transport, keep_last=4)
    gate = embedded_gate(lab.engine, tiny_model_path, lab.task, buffer, local_checks=False)
    spec = TransportSpec("fsspec", url=str(exchange))
    checks = OffloadedChecks(
        gate,
        lambda: launch_checker(lab.engine, tiny_model_path, spec),
        keep_versions=lab.engine.hetero.max_delay + 1,
        published_sha256=store.published_sha256,
    )
    checks.remember(0, store.publish(0, lab.model.state_dict()))
    checks.remember(1, store.publish(1, lab.v1.state_dict()))
    inbox = RolloutInbox(transport, buffer, gate=checks)

    honest, lies = lab.groups("sampler-0", n=2), lab.groups("sampler-1", n=2)
    for group in lies:  # on probation: every group re-scored
        group.sampler_logprobs = group.sampler_logprobs * 1.5
    for group in honest + lies:
        send_group(transport, group)
    _drain(inbox, checks)
    status = buffer.ledger.status
    assert [status[g.group_uid] for g in honest] == ["buffered", "buffered"]
    assert status[lies[0].group_uid] == "rejected:bad_logprobs"
    assert checks.stats["versions_put"] == 0  # version 0 came from the store

    # version 1 rewritten in the transport: version 0's weights under its name
    transport.put(WEIGHTS_TOPIC, version_key(1), serialize_state_dict(lab.model.state_dict(), 1))
    on_v1 = lab.groups("sampler-2", n=2, model=lab.v1)
    for group in on_v1:
        group.policy_version = 1
        send_group(transport, group)
    _drain(inbox, checks)
    # judged against the learner's version 1 (against the rewritten one they would fail)
    assert [status[g.group_uid] for g in on_v1] == ["buffered", "buffered"]
    assert checks.stats["versions_put"] == 1
    assert checks.gate.ledger.refusal("sampler-2") is None
    checks.close()


def _placed(checker, cpus: list[list[int]], timeout_s: float = 20.0) -> dict:
    """The checker's describe() once every thread of it may run on ``cpus`` (lend_cores is
    asynchronous and runs in its own thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        where = ray.get(checker.describe.remote())
        if where["cpus"] == cpus or time.monotonic() > deadline:
            return where
        time.sleep(0.05)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a learner core and a system core")
def test_the_learners_cores_are_lent_to_the_checker_while_the_learner_is_blocked_on_its_verdicts(
    local_ray, tiny_model_path, tmp_path
):
    learner_core, system_core = sorted(os.sched_getaffinity(0))[:2]
    lab = Lab(
        tiny_model_path,
        tmp_path / "run",
        f"hetero.learner_cpus=[{learner_core}]",
        f"hetero.system_cpus=[{system_core}]",
    )
    gate = embedded_gate(lab.engine, tiny_model_path, lab.task, lab.buffer, local_checks=False)
    checks = OffloadedChecks(
        gate, lambda: launch_checker(lab.engine, tiny_model_path), keep_versions=2, learner_cores=[learner_core]
    )
    clock = VerdictBlockClock(checks.lend_cores)
    assert _placed(checks.checker, [[system_core]])["cpus"] == [[system_core]]
    checks._where.result(timeout=60)  # started: on this node, its threads are moved from here

    clock.waits(2, held=1)  # the learner waits for a group not read yet: nothing lent
    assert not checks.lent
    clock.update(held=2)  # read, awaiting its verdict: the learner's idle core goes to the checker
    where = _placed(checks.checker, [sorted({learner_core, system_core})])
    assert where["cpus"] == [sorted({learner_core, system_core})] and where["nice"] == [CHECKER_NICE]
    clock.fed()  # served: it trains again, and the checker is back on the system cores alone
    assert _placed(checks.checker, [[system_core]])["cpus"] == [[system_core]]
    assert checks.stats["cores_lent"] == 1 and clock.episodes == 1 and clock.total_s > 0
    assert checks.stats["lent_here"] == 1  # the same node: no call the busy checker had to answer first

    # a checker elsewhere is asked instead: it moves its own threads
    both = sorted({learner_core, system_core})
    assert ray.get(checks.checker.lend_cores.remote([learner_core])) == both
    assert _placed(checks.checker, [both])["cpus"] == [both]
    assert ray.get(checks.checker.lend_cores.remote([])) == [system_core]
    assert _placed(checks.checker, [[system_core]])["cpus"] == [[system_core]]
    checks.close()


def test_while_the_learner_waits_a_rewards_check_runs_in_the_learner_at_once_and_still_refuses_lies(
    local_ray, tiny_model_path, tmp_path
):
    """A group due only its rewards check (nothing re-scored: verify_fraction 0) is checked in the
    learner's process, by a verifier without a model, when the learner waits for groups (its core
    idle): at once when it arrives then, and a group already sent to the checker or queued for it
    when the learner starts waiting -- no round trip the learner would wait out. A lie about the
    rewards is still refused there; while the learner trains, groups go to the checker."""
    lab = Lab(tiny_model_path, tmp_path / "run", "hetero.trust.verify_fraction=0")
    buffer = build_buffer(lab.engine, lab.task)
    buffer.set_learner_version(1)
    gate = embedded_gate(lab.engine, tiny_model_path, lab.task, buffer, local_checks=False)
    waits = [False]
    here = embedded_verifier(lab.engine, None, lab.task, keep_versions=0, tokenizer=lab.tokenizer)
    assert here.scorer is None
    checks = OffloadedChecks(
        gate,
        lambda: launch_checker(lab.engine, tiny_model_path),
        keep_versions=2,
        rewards_here=here,
        learner_waits=lambda: waits[0],
    )
    transport = FsspecTransport(str(tmp_path / "exchange"))
    inbox = RolloutInbox(transport, buffer, gate=checks)
    status = buffer.ledger.status

    # the learner trains: two groups go to the checker (still starting: seconds to load torch)
    sent = lab.groups("sampler-0", n=2)
    for group in sent:
        send_group(transport, group)
    inbox.poll()
    assert checks.outstanding() == 2 and checks.stats["batches"] == 1
    waits[0] = True  # the learner waits for groups: they are judged here, not waited for
    inbox.settle()
    assert checks.outstanding() == 0 and checks.stats["checked_here"] == 2
    assert [status[g.group_uid] for g in sent] == ["buffered", "buffered"]

    # arriving while it waits: judged as they are read, the lie refused
    honest, liar = lab.groups("sampler-0", n=2), lab.groups("sampler-1", n=1)[0]
    liar.rewards = 1.0 - liar.rewards  # every reward flipped
    for group in [*honest, liar]:
        send_group(transport, group)
    inbox.poll()
    assert checks.outstanding() == 0 and checks.stats["checked_here"] == 5
    assert [status[g.group_uid] for g in honest] == ["buffered", "buffered"]
    assert status[liar.group_uid] == "rejected:bad_rewards"
    assert checks.gate.metrics()["perf/trust_check_learner_cpu_s_total"] > 0

    # the checker's late answers for the first two change nothing (each group judged once)
    deadline = time.monotonic() + 120
    while checks._in_flight is not None:
        assert time.monotonic() < deadline, "the checker did not answer"
        checks.wait(0.5)
        inbox.settle()
    assert [status[g.group_uid] for g in sent] == ["buffered", "buffered"]
    assert checks.awaiting("sampler-0") == 0 and checks.outstanding() == 0  # not counted out twice

    waits[0] = False  # the learner trains again: the checker checks
    later = lab.groups("sampler-0", n=1)
    send_group(transport, later[0])
    inbox.poll()
    assert checks.outstanding() == 1 and checks.stats["batches"] == 2
    _drain(inbox, checks)
    assert status[later[0].group_uid] == "buffered" and checks.stats["checked_here"] == 5
    checks.close()
