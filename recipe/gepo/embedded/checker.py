"""The trust checks off the learner's process (``hetero.trust.check_process=true``; off by default).

The gate's checks (:class:`~.verify.GroupVerifier`: re-scoring a group under its claimed version,
the token check, the rewards' recomputation) cost the learner CPU on its own cores, measured at
+19% wall time per step on the toy model (docs/reliability.md, "Cost"). Here they run in a
:class:`TrustChecker`, a Ray actor of their own that the learner starts on its node: one thread
at ``SCHED_IDLE`` priority, allowed on every core of the node, so it takes only cycles no other
process wants (the faster of learner and samplers idles: that is where the checks go). It holds
its own copy of the policy (in the samplers' precision, as the learner's verifier did) and the
task; the learner no longer holds one.

:class:`OffloadedChecks` is the learner's side, the gate the inbox asks
(:class:`~verl_ext.hetero.exchange.RolloutInbox`, a deferring gate): :meth:`TrustGate.begin`
(cheap books: quarantine, replays, the draw) runs in the inbox's poll thread, the group then
awaits its verdict out of the buffer, counted against its sampler's quota, and
:meth:`TrustGate.finish` (ledger, CUSUM, quarantine) runs when the verdict is back. A group is
never admitted before its checks ran; every rule of :mod:`.verify` holds as in the one-call gate.

Weights: the learner keeps the ``max_delay + 1`` newest versions' messages, as the gate did
(:meth:`OffloadedChecks.remember`: no copy); a version goes into Ray's object store once, when a
check first needs it (by the poll thread, not the learner's training thread at every publish); a
batch of checks carries handles to the versions it needs, and the checker fetches a version only
to load it into its scorer, holding one at a time. A group claiming a version not published yet waits for it in the learner
(:attr:`~.verify.TrustGate.VERSION_WAIT_S` at most, without blocking the poll thread).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from typing import Any, Callable, Optional

import numpy as np
import ray

from .verify import Admission, CheckResult, GroupVerifier, KeptVersions, TrustGate
from verl_ext.hetero.affinity import machine_cpus
from verl_ext.hetero.exchange import DEFERRED
from verl_ext.hetero.records import RecordRejected, RolloutGroup
from verl_ext.torch_threads import set_torch_threads


def run_at_idle_priority(cpus: list[int]) -> None:
    """Every thread of this process (and every thread it starts later: they inherit it) at Linux's
    ``SCHED_IDLE`` policy, allowed on ``cpus``, with one torch thread: it runs only when a core has
    nothing else to run (a process at any nice level preempts it)."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except FileNotFoundError:  # no procfs: the calling thread only
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (ProcessLookupError, PermissionError):
            pass  # the thread ended since listing
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # the calling thread, whatever the listing
    set_torch_threads(1)


class TrustChecker:
    """Ray actor: a :class:`~.verify.GroupVerifier` of its own (model copy, tokenizer, task) that
    answers batches of checks for the learner's :class:`OffloadedChecks`, at idle priority on all
    of the node's cores.

    Args:
        engine: the run's validated configs (the trust options, the task, the sampler precision).
        model_path: the policy's HF folder (the scorer's architecture; its weights come per version).
    """

    def __init__(self, engine: Any, model_path: str):
        run_at_idle_priority(machine_cpus())
        from .placement import Placement
        from .tasks import Task

        hetero, trust = engine.hetero, engine.hetero.trust
        self.verifier = GroupVerifier(
            model_path,
            None,  # the task needs the scorer's tokenizer: set below
            engine.settings.temperature,
            engine.algorithm,
            keep_versions=1,  # the version being checked; the learner holds the others
            bounds=trust.bounds(),
            check_rewards=trust.check_rewards,
            placement=Placement.of(hetero),
            checkable_sampling=trust.checkable_sampling,
        )
        self.verifier.task = Task(engine.task, hetero.seed, self.verifier.tokenizer)

    def describe(self) -> dict[str, Any]:
        """Where and how it runs: ``pid``, ``policy`` (``os.sched_getscheduler``), ``cpus``."""
        return {
            "pid": os.getpid(),
            "policy": os.sched_getscheduler(0),
            "cpus": sorted(os.sched_getaffinity(0)),
        }

    def check(
        self, requests: list[tuple[RolloutGroup, bool, bool, bool]], weights: dict[int, Any]
    ) -> list[CheckResult]:
        """:meth:`GroupVerifier.run` for each ``(group, rewards, logprobs, lost)``, in order;
        ``weights``: version -> a handle to its message in the object store, for the versions the
        re-scored groups claim (a version absent there is not held: ``held=False``)."""
        order = sorted(range(len(requests)), key=lambda i: int(requests[i][0].policy_version))  # one load a version
        results: list[Optional[CheckResult]] = [None] * len(requests)
        for i in order:
            group, rewards, logprobs, lost = requests[i]
            version = int(group.policy_version)
            if logprobs and version in weights and not self.verifier.holds(version):
                self.verifier.remember(version, ray.get(weights[version][0]).tobytes())
            results[i] = self.verifier.run(group, rewards=rewards, logprobs=logprobs and version in weights, lost=lost)
            if logprobs and version not in weights:
                results[i].held = False
        return results


def launch_checker(engine: Any, model_path: str) -> Any:
    """A :class:`TrustChecker` actor on the learner's node (``hetero.learner_ray_resources``),
    fate-shared with the calling learner actor (its owner): a learner that dies takes its checker
    with it, and its resumed successor starts a fresh one."""
    hetero = engine.hetero
    options: dict[str, Any] = {"resources": dict(hetero.learner_ray_resources)} if hetero.learner_ray_resources else {}
    if hetero.device.startswith("cuda"):
        # no GPU reservation: it re-scores on the learner's GPU (cuda:N as the learner names it)
        options["runtime_env"] = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
    return ray.remote(num_cpus=0, max_restarts=0)(TrustChecker).options(**options).remote(engine, model_path)


class OffloadedChecks:
    """The learner's deferring gate (:class:`~verl_ext.hetero.exchange.RolloutInbox`'s
    ``gate``): :class:`~.verify.TrustGate`'s books here, its checks in a :class:`TrustChecker`.

    Threads: the inbox's poll thread calls :meth:`admit`, :meth:`flush`, :meth:`settled`,
    :meth:`wait`, :meth:`accepted`, :meth:`passed_over`; the learner's thread :meth:`remember`.

    Args:
        gate: the learner's gate, built with ``local_checks=False``.
        launch: starts a checker actor (:func:`launch_checker`); called again if one dies (its
            outstanding checks are sent to the new one).
        keep_versions: versions whose weights are kept for re-scoring (``max_delay + 1``).
    """

    def __init__(self, gate: TrustGate, launch: Callable[[], Any], keep_versions: int):
        self.gate, self._launch = gate, launch
        self.checker = launch()
        self.weights = KeptVersions(keep_versions)  # version -> its message (no copy)
        self._handles: dict[int, list] = {}  # version -> [ObjectRef of its message], once a check needed it
        self._queued: list[Admission] = []  # begun, weights at hand (or not needed): to send
        self._waiting: list[tuple[Admission, float]] = []  # (begun, deadline): its version's weights may still come
        self._in_flight: dict[Any, tuple[list[Admission], dict[int, Any]]] = {}  # ObjectRef -> its batch
        self._sampler_awaiting: Counter[str] = Counter()
        self._uids_awaiting: set[str] = set()
        self.stats: Counter[str] = Counter()  # batches sent, checker restarts
        self.verdict_wait_s = 0.0  # summed over groups: from begin to verdict
        self._began: dict[str, float] = {}

    # ---------------------------------------------------------------- weights (learner's thread)
    def remember(self, version: int, message: bytes) -> None:
        """A published version's message, kept (no copy; only when q is re-scored at all): it goes
        into the object store only when a check needs it (:meth:`_handle`, the poll thread), not
        on the learner's thread at every publish."""
        if self.gate.rescoring:
            self.weights.remember(version, message)

    def _handle(self, version: int) -> list | None:
        """[ObjectRef] of a kept version's message, put once (as a uint8 array: one copy, read in
        place by the checker; in a list, so it reaches the checker as a handle, fetched only when
        it loads that version); None when the version is not kept."""
        message = self.weights.get(version)
        if message is None:
            return None
        if version not in self._handles:
            self._handles[version] = [ray.put(np.frombuffer(message, dtype=np.uint8))]
            for old in [v for v in self._handles if not self.weights.holds(v)]:
                del self._handles[old]  # pruned from the kept versions: its object may go
        return self._handles[version]

    # ---------------------------------------------------------------- the deferring gate
    def admit(self, group: RolloutGroup):
        """:meth:`TrustGate.begin` (raises its refusals); then the group awaits its verdict:
        returns :data:`~verl_ext.hetero.exchange.DEFERRED` (or, with no check configured, the verdict)."""
        admission = self.gate.begin(group)
        if not admission.checks:
            return self.gate.finish(admission, CheckResult(held=False))
        sampler = str(group.sampler_id)
        self._sampler_awaiting[sampler] += 1
        self._uids_awaiting.add(group.group_uid)
        self._began[group.group_uid] = time.monotonic()
        if admission.wants_weights and self.weights.may_come(admission.version):
            # the buffer takes version v before the learner hands v's weights here: wait for them
            self._waiting.append((admission, time.monotonic() + self.gate.version_wait_s))
        else:
            self._queued.append(admission)
        return DEFERRED

    def awaiting(self, sampler_id: str) -> int:
        """Groups of ``sampler_id`` awaiting their verdict (they count against its quota)."""
        return self._sampler_awaiting[str(sampler_id)]

    def awaits(self, uid: str) -> bool:
        return uid in self._uids_awaiting

    def outstanding(self) -> int:
        return len(self._uids_awaiting)

    def flush(self) -> None:
        """Send the queued checks to the checker, one batch (waiting ones whose weights came, or
        whose wait is over, first join the queue)."""
        now = time.monotonic()
        still = []
        for admission, deadline in self._waiting:
            if self.weights.may_come(admission.version) and now < deadline:
                still.append((admission, deadline))
            else:
                self._queued.append(admission)
        self._waiting = still
        if not self._queued:
            return
        batch, self._queued = self._queued, []
        weights = {}
        for admission in batch:
            handle = self._handle(admission.version) if admission.wants_weights else None
            if handle is not None:
                weights[admission.version] = handle
        self._send(batch, weights)

    def _send(self, batch: list[Admission], weights: dict[int, Any]) -> None:
        requests = [(a.group, a.checks, a.wants_weights, a.lost) for a in batch]
        self._in_flight[self.checker.check.remote(requests, weights)] = (batch, weights)
        self.stats["batches"] += 1

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for a verdict (the poll thread's sleep while checks are out);
        True when one is ready."""
        if not self._in_flight:
            if self._waiting:
                time.sleep(min(timeout_s, 0.02))
            return False
        ready, _ = ray.wait(list(self._in_flight), num_returns=1, timeout=timeout_s)
        return bool(ready)

    def settled(self) -> list[tuple[RolloutGroup, "bool | RecordRejected"]]:
        """The groups whose verdict came back since the last call: ``(group, vouched)`` to add
        to the buffer (then :meth:`accepted`), or ``(group, RecordRejected)``."""
        self.flush()
        if not self._in_flight:
            return []
        ready, _ = ray.wait(list(self._in_flight), num_returns=len(self._in_flight), timeout=0)
        out: list[tuple[RolloutGroup, bool | RecordRejected]] = []
        for ref in ready:
            batch, weights = self._in_flight.pop(ref)
            try:
                results = ray.get(ref)
            except ray.exceptions.RayActorError:
                # the checker died (killed, out of memory): a new one checks the same groups
                self.stats["checker_restarts"] += 1
                self.checker = self._launch()
                self._send(batch, weights)
                continue
            now = time.monotonic()
            for admission, result in zip(batch, results):
                group = admission.group
                self._sampler_awaiting[str(group.sampler_id)] -= 1
                self._uids_awaiting.discard(group.group_uid)
                self.verdict_wait_s += now - self._began.pop(group.group_uid, now)
                try:
                    out.append((group, self.gate.finish(admission, result)))
                except RecordRejected as err:
                    out.append((group, err))
        return out

    def accepted(self, group: RolloutGroup, vouched: bool = False) -> None:
        self.gate.accepted(group, vouched)

    def passed_over(self, group: RolloutGroup) -> None:
        self.gate.passed_over(group)

    def metrics(self) -> dict[str, float]:
        """``trust/awaiting_verdict`` (groups out of the buffer awaiting one now),
        ``perf/trust_verdict_wait_s_total`` (their waits, summed), ``trust/checker_restarts``."""
        return {
            "trust/awaiting_verdict": float(self.outstanding()),
            "perf/trust_verdict_wait_s_total": self.verdict_wait_s,
            "trust/checker_restarts": float(self.stats["checker_restarts"]),
        }

    def close(self) -> None:
        try:
            ray.kill(self.checker)
        except Exception:  # noqa: BLE001 - already gone
            pass
