"""The trust checks off the learner's process (``hetero.trust.check_process``).

:class:`TrustChecker` is a Ray actor the learner starts on its node that runs the gate's checks
(:class:`~verl_ext.trust.verifier.GroupVerifier`: re-score under the claimed version, token check,
rewards) on the system cores (``hetero.system_cpus``) at nice :data:`CHECKER_NICE`, with its own
policy copy (in the samplers' precision) and task. :class:`OffloadedChecks` is the learner's side,
the deferring gate the inbox asks: :meth:`TrustGate.begin` in the poll thread, the group awaiting its
verdict outside the buffer (against its sampler's quota), :meth:`TrustGate.finish` when the verdict
is back. No group is admitted before its checks ran; every rule of :mod:`verl_ext.trust.gate` holds.
One batch is at the checker at a time; while the learner is blocked on verdicts
(:class:`VerdictBlockClock`) its cores are lent to the checker (:meth:`OffloadedChecks.lend_cores`),
and while it waits for groups, a group due only its rewards check is judged in the poll thread.
A version reaches the checker as the SHA-256 it was published with, read from the transport (else
the learner's copy, once, through Ray's object store). Costs and evidence: docs/reliability.md.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from typing import Any, Callable, Optional

import numpy as np
import ray

from .async_shared import system_cores
from .trust_wiring import embedded_verifier
from verl_ext.hetero.affinity import pin_process, thread_ids
from verl_ext.hetero.exchange import DEFERRED
from verl_ext.hetero.protocol import WEIGHTS_TOPIC, TransportSpec, version_key
from verl_ext.hetero.transport import CorruptMessage
from verl_ext.hetero.records import RecordRejected, RolloutGroup
from verl_ext.torch_threads import set_torch_threads
from verl_ext.trust.gate import Admission, TrustGate
from verl_ext.trust.verifier import CheckResult, GroupVerifier, KeptVersions


# The checker's nice level: a CPU-bound process at nice 0 gets about 9x its CPU when they share a
# core (Linux's weights: 1024 against 110), so the checks give way to training and sampling, yet
# always get a share. Not SCHED_IDLE: it gets none while other work keeps the cores busy, so
# verdicts, and with them quarantines, would wait on the load (docs/reliability.md, "Numbers").
CHECKER_NICE = 10


def run_at_low_priority(cpus: list[int], nice: int = CHECKER_NICE) -> None:
    """Every thread of this process (and every thread it starts later: they inherit it) at
    ``nice``, allowed on ``cpus`` (every core when empty), with one torch thread."""
    for tid in thread_ids():
        try:
            if cpus:
                os.sched_setaffinity(tid, cpus)
            os.setpriority(os.PRIO_PROCESS, tid, nice)  # on Linux, a tid: that thread
        except (ProcessLookupError, PermissionError):
            pass  # the thread ended since listing
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)  # the calling thread, whatever the listing
    set_torch_threads(1)


class TrustChecker:
    """Ray actor: a :class:`~verl_ext.trust.verifier.GroupVerifier` of its own (model copy, tokenizer, task) that
    answers batches of checks for the learner's :class:`OffloadedChecks`, on the system cores at
    nice :data:`CHECKER_NICE`.

    Args:
        engine: the run's validated configs (the trust options, the task, the sampler precision).
        model_path: the policy's HF folder (the scorer's architecture; its weights come per version).
        spec: the run's transport, where the learner publishes its weights (None: every version
            comes from the learner through the object store).
    """

    def __init__(self, engine: Any, model_path: str, spec: Optional[TransportSpec] = None):
        self.hetero = engine.hetero
        run_at_low_priority(system_cores(self.hetero))
        self.store = spec.open() if spec is not None else None
        # the version being checked; the learner holds the others
        self.verifier = embedded_verifier(engine, model_path, None, keep_versions=1)

    def describe(self) -> dict[str, Any]:
        """Where and how it runs: ``pid``, ``node_id`` (Ray's), ``nice`` (the distinct nice levels of
        its threads, this one's included), ``cpus`` (the distinct core sets its threads may run on)."""
        levels, core_sets = set(), set()
        for tid in set(thread_ids()) | {threading.get_native_id()}:
            try:
                levels.add(os.getpriority(os.PRIO_PROCESS, tid))
                core_sets.add(tuple(sorted(os.sched_getaffinity(tid))))
            except ProcessLookupError:
                pass  # the thread ended since listing
        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "nice": sorted(levels),
            "cpus": sorted(list(c) for c in core_sets),
        }

    def check(
        self, requests: list[tuple[RolloutGroup, bool, bool, bool]], weights: dict[int, Any]
    ) -> list[Optional[CheckResult]]:
        """:meth:`GroupVerifier.run` for each ``(group, rewards, logprobs, lost)``, in order.
        ``weights``: for each version the re-scored groups claim, where its message is: the
        SHA-256 the learner published it with (read from the transport's weight store and held to
        it), or ``[handle]`` of the learner's copy in the object store. A version absent there is
        not held (``held=False``). None in place of a result: the store did not have that
        version's message as published (pruned, not landed yet, or rewritten by someone else),
        so the learner sends its own copy."""
        order = sorted(range(len(requests)), key=lambda i: int(requests[i][0].policy_version))  # one load a version
        results: list[Optional[CheckResult]] = [None] * len(requests)
        for i in order:
            group, rewards, logprobs, lost = requests[i]
            version = int(group.policy_version)
            rescore = logprobs and version in weights
            fetch_s = 0.0
            if rescore and not self.verifier.holds(version):
                start = time.perf_counter()
                message = self._message(version, weights[version])
                if message is None:
                    continue
                self.verifier.remember(version, message)
                fetch_s = time.perf_counter() - start
            results[i] = self.verifier.run(group, rewards=rewards, logprobs=rescore, lost=lost)
            results[i].fetch_s = fetch_s
            if logprobs and version not in weights:
                results[i].held = False
        return results

    def _message(self, version: int, source: Any) -> Optional[bytes]:
        """The message of ``version`` from ``source`` (:meth:`check`'s ``weights`` entry), or None
        when the store does not hold it as the learner published it."""
        if not isinstance(source, str):
            return ray.get(source[0]).tobytes()
        if self.store is None:
            return None
        try:
            # verified against the digest it was committed with (one hash of a whole model copy)
            message, sha256 = self.store.get_with_sha256(WEIGHTS_TOPIC, version_key(version))
        except (KeyError, CorruptMessage):
            return None
        # the transport is writable by samplers too: only the learner's digest says whose it is
        return message if sha256 == source else None

    @ray.method(concurrency_group="control")
    def lend_cores(self, cores: list[int]) -> list[int]:
        """Run on ``cores`` too (the learner's, lent while it is blocked on this checker's
        verdicts: idle then), or on the system cores alone again (``cores`` empty); every thread,
        the one checking now included (this call has a thread of its own). Returns the cores it
        may run on now (every core when it is not pinned)."""
        own = system_cores(self.hetero)
        return pin_process(sorted(set(own) | set(cores)) if own else [], "lend_cores", set_threads=False)


def launch_checker(engine: Any, model_path: str, spec: Optional[TransportSpec] = None) -> Any:
    """A :class:`TrustChecker` actor on the learner's node (``hetero.learner_ray_resources``),
    fate-shared with the calling learner actor (its owner): a learner that dies takes its checker
    with it, and its resumed successor starts a fresh one. ``spec``: the transport it reads
    published weights from (:class:`TrustChecker`)."""
    hetero = engine.hetero
    options: dict[str, Any] = {"resources": dict(hetero.learner_ray_resources)} if hetero.learner_ray_resources else {}
    if hetero.device.startswith("cuda"):
        # no GPU reservation: it re-scores on the learner's GPU (cuda:N as the learner names it)
        options["runtime_env"] = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
    # "control": lend_cores runs beside a batch of checks (it moves the thread checking it)
    checker = ray.remote(num_cpus=0, max_restarts=0, concurrency_groups={"control": 1})(TrustChecker)
    return checker.options(**options).remote(engine, model_path, spec)


class OffloadedChecks:
    """The learner's deferring gate (:class:`~verl_ext.hetero.exchange.RolloutInbox`'s
    ``gate``): :class:`~verl_ext.trust.gate.TrustGate`'s books here, its checks in a :class:`TrustChecker`.

    Threads: the inbox's poll thread calls :meth:`admit`, :meth:`flush`, :meth:`settled`,
    :meth:`wait`, :meth:`accepted`, :meth:`passed_over`; the learner's thread :meth:`remember`.

    Args:
        gate: the learner's gate, built with ``local_checks=False``.
        launch: starts a checker actor (:func:`launch_checker`); called again if one dies (its
            outstanding checks are sent to the new one).
        keep_versions: versions whose weights are kept for re-scoring (``max_delay + 1``).
        published_sha256: version -> the SHA-256 its message was published with while the weight
            store keeps it, else None (:meth:`WeightStore.published_sha256`): the checker reads
            such a version from the store, and the learner's copy goes to it only when the store
            no longer has it. Default: never (every version from the learner).
        learner_cores: the learner's cores (``hetero.learner_cpus``), lent to the checker while
            the learner is blocked on its verdicts (:meth:`lend_cores`). Empty: never lent.
        rewards_here: a :class:`~verl_ext.trust.verifier.GroupVerifier` without a model (the learner's tokenizer
            and task): a group due only its rewards check that arrives while ``learner_waits()``
            (the learner blocked for groups: its core idle) is checked here at once, instead of
            waiting a round trip to the checker that the learner would wait out. None: never.
        learner_waits: whether the learner is waiting for groups now.
    """

    def __init__(
        self,
        gate: TrustGate,
        launch: Callable[[], Any],
        keep_versions: int,
        published_sha256: Callable[[int], Optional[str]] = lambda version: None,
        learner_cores: list[int] = (),
        rewards_here: Optional[GroupVerifier] = None,
        learner_waits: Callable[[], bool] = lambda: False,
    ):
        self.gate, self._launch, self._published_sha256 = gate, launch, published_sha256
        self.rewards_here, self._learner_waits = rewards_here, learner_waits
        self.learner_cores = list(learner_cores)
        self.lent = False  # the checker may run on the learner's cores now
        self._start_checker()
        self.weights = KeptVersions(keep_versions)  # version -> its message (no copy)
        self._handles: dict[int, list] = {}  # version -> [ObjectRef of its message], once a check needed it
        self._not_in_store: set[int] = set()  # versions the checker could not read from the store as published
        self._queued: list[Admission] = []  # begun, weights at hand (or not needed): to send
        self._waiting: list[tuple[Admission, float]] = []  # (begun, deadline): its version's weights may still come
        # the batch at the checker (one at a time: groups begun meanwhile queue and go as the next
        # batch, so a busy checker gets fewer, larger calls): (its future, batch, weights)
        self._in_flight: Optional[tuple[Any, list[Admission], dict[int, Any]]] = None
        # set by Ray's thread when the batch's verdicts are in, or by interrupt(): wakes wait()
        self._wake = threading.Event()
        self._sampler_awaiting: Counter[str] = Counter()
        self._uids_awaiting: set[str] = set()
        self.stats: Counter[str] = Counter()  # batches sent, versions put in the object store, checker restarts
        self.verdict_wait_s = 0.0  # summed over groups: from begin to verdict
        self.round_trip_s = 0.0  # summed over batches: from sending to the verdicts' return
        self.fetch_s = 0.0  # summed: the checker fetching versions' weights it did not hold
        self._sent_at = 0.0
        self._began: dict[str, float] = {}

    # ---------------------------------------------------------------- weights (learner's thread)
    def remember(self, version: int, message: bytes) -> None:
        """A published version's message, kept (no copy; only when q is re-scored at all): it goes
        into the object store only when a check needs it (:meth:`_handle`, the poll thread), not
        on the learner's thread at every publish."""
        if self.gate.rescoring:
            self.weights.remember(version, message)

    def _source(self, version: int) -> Any:
        """Where the checker gets a kept version's message (:meth:`TrustChecker.check`'s
        ``weights``): its published SHA-256 while the store keeps it (nothing for the learner to
        copy), else :meth:`_handle`; None when the version is not kept."""
        if not self.weights.holds(version):
            return None
        digest = None if version in self._not_in_store else self._published_sha256(version)
        return digest if digest is not None else self._handle(version)

    def _handle(self, version: int) -> list | None:
        """[ObjectRef] of a kept version's message, put once (as a uint8 array: one copy, read in
        place by the checker; in a list, so it reaches the checker as a handle, fetched only when
        it loads that version); None when the version is not kept. A put costs this thread about
        4 ms for the toy's 4 MB."""
        message = self.weights.get(version)
        if message is None:
            return None
        if version not in self._handles:
            self._handles[version] = [ray.put(np.frombuffer(message, dtype=np.uint8))]
            self.stats["versions_put"] += 1
            for old in [v for v in self._handles if not self.weights.holds(v)]:
                del self._handles[old]  # pruned from the kept versions: its object may go
            self._not_in_store = {v for v in self._not_in_store if self.weights.holds(v)}
        return self._handles[version]

    # ---------------------------------------------------------------- the deferring gate
    def admit(self, group: RolloutGroup):
        """:meth:`TrustGate.begin` (raises its refusals); then the group awaits its verdict:
        returns :data:`~verl_ext.hetero.exchange.DEFERRED` -- or the verdict (raising a refusal),
        with no check configured, or for a group due only its rewards check while the learner
        waits for groups (checked here)."""
        admission = self.gate.begin(group)
        if not admission.checks:
            return self.gate.finish(admission, CheckResult(held=False))
        if self.rewards_here is not None and not admission.wants_weights and self._learner_waits():
            # the learner waits for groups, its core idle: a rewards check (~0.4 ms on the toy)
            # here beats the round trip to the checker (~10-20 ms) it would wait out
            return self.gate.finish(admission, self._check_rewards_here(group))
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
        if not self._queued or self._in_flight is not None:
            return  # sent when the batch out now comes back (settled)
        batch, self._queued = self._queued, []
        weights = {}
        for admission in batch:
            if admission.wants_weights and admission.version not in weights:
                source = self._source(admission.version)
                if source is not None:
                    weights[admission.version] = source
        self._send(batch, weights)

    def _send(self, batch: list[Admission], weights: dict[int, Any]) -> None:
        requests = [(a.group, a.checks, a.wants_weights, a.lost) for a in batch]
        # a future's callback wakes the poll thread: no ray.wait polling, which cost the learner's
        # core more than the checks' books
        future = self.checker.check.remote(requests, weights).future()
        future.add_done_callback(lambda _: self._wake.set())
        self._in_flight = (future, batch, weights)
        self._sent_at = time.monotonic()
        self.stats["batches"] += 1

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for the batch's verdicts or :meth:`interrupt` (the poll
        thread's sleep while checks are out); True when woken (then :meth:`settled` says whether
        verdicts came)."""
        if self._in_flight is None:
            if self._waiting:
                time.sleep(min(timeout_s, 0.02))
            return False
        woken = self._wake.wait(timeout_s)
        self._wake.clear()  # a verdict that came meanwhile is still seen: settled() asks its future
        return woken

    def interrupt(self) -> None:
        """Wake :meth:`wait` now (another thread: the learner starts or stops waiting)."""
        self._wake.set()

    def _start_checker(self) -> None:
        self.checker, self.lent = self._launch(), False
        # where it runs, once it has started (lend_cores moves its threads itself when it can)
        self._where = self.checker.describe.remote().future()

    def lend_cores(self, lend: bool) -> None:
        """Let the checker run on the learner's cores too (``lend``: the learner is blocked on its
        verdicts, so they are idle) or not (it trains again). A checker on this node has every
        thread moved from here at once (a few ``sched_setaffinity`` calls); otherwise, or while it
        is still starting, it is asked to (:meth:`TrustChecker.lend_cores`, on a thread of its own
        that has to get a share of the busy system cores first)."""
        if lend == self.lent or not self.learner_cores:
            return
        self.lent = lend
        self.stats["cores_lent"] += int(lend)
        threads = self._checker_threads()
        if threads is not None:
            own, tids = threads
            cores = sorted(set(own) | set(self.learner_cores)) if lend else own
            try:
                for tid in tids:
                    try:
                        os.sched_setaffinity(tid, cores)
                    except ProcessLookupError:
                        pass  # that thread ended since listing
                self.stats["lent_here"] += int(lend)
                return
            except OSError:  # not ours to move after all: ask it
                self._where = None
        self.checker.lend_cores.remote(self.learner_cores if lend else [])

    def _checker_threads(self) -> Optional[tuple[list[int], list[int]]]:
        """(the checker's system cores, its thread ids) when it runs on this node and has
        started, else None."""
        if self._where is None or not self._where.done():
            return None
        try:
            where = self._where.result()
            if where["node_id"] != ray.get_runtime_context().get_node_id():
                return None
            with open(f"/proc/{where['pid']}/cmdline", "rb") as f:
                if not f.read().startswith(b"ray::TrustChecker"):
                    return None  # that pid is someone else's now
            return where["cpus"][0], thread_ids(where["pid"])
        except (ray.exceptions.RayError, OSError):
            return None

    def settled(self) -> list[tuple[RolloutGroup, "bool | RecordRejected"]]:
        """The groups whose verdict came back since the last call: ``(group, vouched)`` to add
        to the buffer (then :meth:`accepted`), or ``(group, RecordRejected)``. While the learner
        waits for groups, those due only their rewards check, queued or at the checker, are
        judged here (:meth:`_check_here`). The groups queued meanwhile then go to the checker."""
        out: list[tuple[RolloutGroup, bool | RecordRejected]] = []
        if self._in_flight is not None and self._in_flight[0].done():
            future, batch, weights = self._in_flight
            self._in_flight = None
            try:
                results = future.result()
            except ray.exceptions.RayActorError:
                # the checker died (killed, out of memory): a new one checks the same groups
                self.stats["checker_restarts"] += 1
                self._start_checker()
                self._send(batch, weights)
                return out
            self.round_trip_s += time.monotonic() - self._sent_at
            self.fetch_s += sum(r.fetch_s for r in results if r is not None)
            for admission, result in zip(batch, results):
                if not self.awaits(admission.group.group_uid):
                    continue  # judged here while the batch was out
                if result is None:  # its version was not in the store as published: our copy goes
                    self._not_in_store.add(admission.version)
                    self._queued.append(admission)
                    continue
                out.append(self._verdict(admission, result))
        if self.rewards_here is not None and self._learner_waits():
            out += self._check_here()
        self.flush()
        return out

    def _verdict(self, admission: Admission, result: CheckResult) -> tuple[RolloutGroup, "bool | RecordRejected"]:
        """A begun group's checks are done: out of the awaiting books, and its verdict."""
        group = admission.group
        self._sampler_awaiting[str(group.sampler_id)] -= 1
        self._uids_awaiting.discard(group.group_uid)
        now = time.monotonic()
        self.verdict_wait_s += now - self._began.pop(group.group_uid, now)
        try:
            return group, self.gate.finish(admission, result)
        except RecordRejected as err:
            return group, err

    def _check_here(self) -> list[tuple[RolloutGroup, "bool | RecordRejected"]]:
        """The groups due only their rewards check that still await a verdict, queued or in the
        batch at the checker, judged here: the learner waits for groups (its core idle), and
        would otherwise wait out their round trip. The checker's answer for them is ignored when
        it comes."""
        at_checker = self._in_flight[1] if self._in_flight is not None else []
        out = []
        for admission in [*self._queued, *at_checker]:
            if admission.wants_weights or not self.awaits(admission.group.group_uid):
                continue
            out.append(self._verdict(admission, self._check_rewards_here(admission.group)))
        self._queued = [a for a in self._queued if self.awaits(a.group.group_uid)]
        return out

    def _check_rewards_here(self, group: RolloutGroup) -> CheckResult:
        """``group``'s rewards check, in this thread (``rewards_here``), counted."""
        self.stats["checked_here"] += 1
        return self.rewards_here.run(group, rewards=True, logprobs=False)

    def accepted(self, group: RolloutGroup, vouched: bool = False) -> None:
        self.gate.accepted(group, vouched)

    def withholds(self, vouched: bool) -> bool:
        return self.gate.withholds(vouched)

    def checks_over_quota(self, group: RolloutGroup) -> bool:
        return self.gate.checks_over_quota(group)

    def malformed(self, refusal: RecordRejected) -> None:
        self.gate.malformed(refusal)

    def passed_over(self, group: RolloutGroup) -> None:
        self.gate.passed_over(group)

    def metrics(self) -> dict[str, float]:
        """``trust/awaiting_verdict`` (groups out of the buffer awaiting one now),
        ``perf/trust_verdict_wait_s_total`` (their waits, summed),
        ``perf/trust_check_round_trip_s_total`` (the batches', from sending to the verdicts'
        return), ``perf/trust_checker_fetch_s_total`` (of which the checker fetching versions'
        weights), ``trust/check_batches``, ``trust/checked_in_learner`` (rewards checks done here
        while the learner waited), ``trust/checker_restarts``."""
        return {
            "trust/awaiting_verdict": float(self.outstanding()),
            "perf/trust_verdict_wait_s_total": self.verdict_wait_s,
            "perf/trust_check_round_trip_s_total": self.round_trip_s,
            "perf/trust_checker_fetch_s_total": self.fetch_s,
            "trust/check_batches": float(self.stats["batches"]),
            "trust/checked_in_learner": float(self.stats["checked_here"]),
            "trust/checker_restarts": float(self.stats["checker_restarts"]),
        }

    def close(self) -> None:
        try:
            ray.kill(self.checker)
        except Exception:  # noqa: BLE001 - already gone
            pass


class VerdictBlockClock:
    """How long the learner was blocked on trust verdicts (``perf/learner_verdict_block_s_total``):
    the time it waited for ``n`` groups while the buffered ones and those awaiting a verdict were
    ``n`` or more -- with instant verdicts it would have been served. That is what the checker
    process costs the learner's critical path, beside its poll thread's CPU. (An upper bound under
    ``hetero.stale_policy=wait``, where the learner may also be waiting for an announced group.)

    Threads: the learner's calls :meth:`waits` before it blocks and :meth:`fed` once served; the
    poll thread :meth:`update` after each change it makes to the counts. ``on_change(blocked)``
    runs in the thread that changed it, at each start and end (:meth:`OffloadedChecks.lend_cores`).
    """

    def __init__(
        self,
        on_change: Callable[[bool], None] = lambda blocked: None,
        now: Callable[[], float] = time.monotonic,
    ):
        self._lock, self._now = threading.Lock(), now
        self._need = 0  # groups the learner waits for; 0 while it trains
        self._since: Optional[float] = None  # the learner has been blocked on verdicts since
        self.total_s = 0.0
        self.episodes = 0
        self._on_change = on_change

    @property
    def blocked(self) -> bool:
        return self._since is not None

    def waits(self, n: int, held: int) -> None:
        """The learner starts waiting for ``n`` groups; ``held``: buffered + awaiting a verdict."""
        with self._lock:
            self._need = n
            self._set(held >= n)

    def update(self, held: int) -> None:
        with self._lock:
            self._set(self._need > 0 and held >= self._need)

    def fed(self) -> None:
        with self._lock:
            self._need = 0
            self._set(False)

    def _set(self, blocked: bool) -> None:
        if blocked == self.blocked:
            return
        now = self._now()
        if blocked:
            self._since, self.episodes = now, self.episodes + 1
        else:
            self.total_s += now - self._since
            self._since = None
        self._on_change(blocked)
