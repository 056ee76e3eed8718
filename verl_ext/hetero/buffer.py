"""Staleness-bounded rollout buffer with an exactly-once ledger.

The learner at version v calls ``take(n, v)`` and receives n whole prompt groups, each with
``v - policy_version <= max_delay`` (an exact bound), each at most once, ever (uids are remembered
across checkpoints). Groups past the bound (``stale_policy``): ``"drop"`` removes and counts them
(reason ``"stale"``); ``"wait"`` (dropless, like verl's ``max_off_policy_strategy=wait``) also waits,
before a step, for the groups announced with :meth:`RolloutBuffer.expect` that the step would put
past the bound, and drops only those that still arrive too late: the bound is never relaxed.
``take`` blocks until enough fresh data is there, up to a timeout (:class:`BufferTimeout`, saying
what was missing). A group added ``withheld`` (not yet vouched for by a trust check) is not taken
until :meth:`RolloutBuffer.vouch` releases it; the bound drops it as ``"stale_unvouched"``.
Thread-safe. Every uid has one status: buffered, consumed, dropped or rejected (with a reason);
``state_dict()`` saves the ledger and the buffered groups: a resume neither loses nor repeats one.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Callable

import numpy as np

from verl_ext.hetero.records import RecordRejected, RecordSpec, RolloutGroup, validate_group
from verl_ext.hetero.staleness import check_max_delay, is_stale, staleness_metrics

STALE_POLICIES = ("drop", "wait")
ORDERS = ("oldest", "newest")

BUFFERED, CONSUMED, DROPPED, REJECTED = "buffered", "consumed", "dropped", "rejected"


class BufferTimeout(TimeoutError):
    """``take`` waited ``timeout_s`` without getting the groups it needs."""


class Ledger:
    """Status of every group uid seen: generated = consumed + dropped + rejected + buffered.

    Status strings: ``"buffered"``, ``"consumed"``, ``"dropped:<reason>"``,
    ``"rejected:<reason>"``. Duplicate arrivals of a known uid do not change its status; they
    are counted in ``duplicates``.
    """

    def __init__(self):
        self.status: dict[str, str] = {}
        self.duplicates: Counter[str] = Counter()

    def mark(self, uid: str, status: str) -> None:
        self.status[uid] = status

    def counts(self) -> dict[str, int]:
        """Totals: generated, buffered, consumed, dropped, rejected, duplicates, and one entry per
        reason (``dropped:stale``, ``rejected:positive_logprob``, ...)."""
        by_status = Counter(self.status.values())
        out: dict[str, int] = {"generated": len(self.status), "duplicates": sum(self.duplicates.values())}
        for kind in (BUFFERED, CONSUMED, DROPPED, REJECTED):
            out[kind] = sum(count for status, count in by_status.items() if status.split(":", 1)[0] == kind)
        out.update({status: count for status, count in by_status.items() if ":" in status})
        return out

    def uids(self, kind: str) -> set[str]:
        """All uids whose status starts with ``kind`` (buffered, consumed, dropped, rejected)."""
        return {uid for uid, status in self.status.items() if status.split(":", 1)[0] == kind}

    def state_dict(self) -> dict:
        return {"status": dict(self.status), "duplicates": dict(self.duplicates)}

    def load_state_dict(self, state: dict) -> None:
        self.status = dict(state["status"])
        self.duplicates = Counter(state["duplicates"])


class RolloutBuffer:
    """Holds whole prompt groups; hands them to the learner within a staleness bound.

    Args:
        max_delay: N, the largest allowed ``learner_version - policy_version`` (>= 0; 0 means
            strictly on-policy).
        stale_policy: ``"drop"`` or ``"wait"`` (see module docstring).
        order: which fresh groups ``take`` returns first: ``"oldest"`` (lowest policy version,
            then arrival order; default, so groups are used before they go stale) or
            ``"newest"``.
        spec: validation rules for arriving groups (group size, reward range, ...).
        capacity: most groups held at once; when full, the oldest buffered group is dropped with
            reason ``"overflow"``. None = unbounded.
        sampler_capacity: most groups of one sampler held at once. At it, the buffer keeps the
            sampler's groups ``take`` would serve first: under ``order="oldest"`` an arriving group
            is dropped on arrival; under ``"newest"`` one newer than the sampler's oldest buffered
            group replaces it (that one is dropped), else it is dropped on arrival. Reason
            ``"over_quota"``. None = unbounded.
        wait_timeout_s: default seconds ``take`` blocks before raising :class:`BufferTimeout`
            (real ``time.monotonic`` seconds: waiting is real even in tests).
    """

    def __init__(
        self,
        max_delay: int,
        stale_policy: str = "drop",
        order: str = "oldest",
        spec: RecordSpec = RecordSpec(),
        capacity: int | None = None,
        wait_timeout_s: float = 600.0,
        sampler_capacity: int | None = None,
    ):
        try:
            check_max_delay(max_delay)
        except ValueError:
            raise ValueError(f"RolloutBuffer: max_delay={max_delay!r} must be an int >= 0") from None
        if stale_policy not in STALE_POLICIES:
            raise ValueError(f"RolloutBuffer: stale_policy={stale_policy!r} must be one of {STALE_POLICIES}")
        if order not in ORDERS:
            raise ValueError(f"RolloutBuffer: order={order!r} must be one of {ORDERS}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"RolloutBuffer: capacity={capacity} must be >= 1 or None")
        if sampler_capacity is not None and sampler_capacity < 1:
            raise ValueError(f"RolloutBuffer: sampler_capacity={sampler_capacity} must be >= 1 or None")
        if not wait_timeout_s > 0:
            raise ValueError(f"RolloutBuffer: wait_timeout_s={wait_timeout_s} must be > 0")
        self.max_delay, self.stale_policy, self.order = int(max_delay), stale_policy, order
        self.spec, self.capacity, self.wait_timeout_s = spec, capacity, wait_timeout_s
        self.sampler_capacity = sampler_capacity

        self._cond = threading.Condition()
        self._groups: dict[str, RolloutGroup] = {}  # uid -> group, insertion order = arrival order
        self._withheld: set[str] = set()  # buffered uids take() may not return until vouch()ed
        self._short_takes = 0  # take() calls waiting now while groups they could use are withheld
        self._demand = 0  # groups a consumer outside take() waits for now (set_demand)
        self._expected: dict[str, tuple[int, str]] = {}  # uid -> (policy_version, sampler_id)
        self._learner_version = 0
        self.ledger = Ledger()
        # per-reporting-window statistics (reset by metrics(reset=True))
        self._window_staleness: list[int] = []
        self._window_wait_s = 0.0
        self._window_dropped: Counter[str] = Counter()
        self._window_rejected: Counter[str] = Counter()
        self.last_rejection: RecordRejected | None = None
        self.on_stale: Callable[[RolloutGroup], None] | None = None
        """Called (under the buffer's lock: keep it cheap) with each group dropped as stale, e.g.
        to give its prompt back to the samplers."""
        self.on_reject: Callable[[RecordRejected], None] | None = None
        """Called (under the buffer's lock: keep it cheap) with each refusal counted, e.g. to name
        the first of each kind in the learner's log."""

    # ---------------------------------------------------------------- producers
    def add(
        self, group: RolloutGroup, validated: bool = False, drop: str | None = None, withheld: bool = False
    ) -> bool:
        """Validate and store one group. Returns True if accepted, False if rejected (counted under
        ``hetero/rejected/<reason>``, reason kept in the ledger and ``last_rejection``). Never
        raises on bad data.

        ``validated=True`` skips :func:`validate_group` (not the duplicate and staleness rules):
        only for a caller that has just validated ``group`` against this buffer's ``spec`` and
        ``learner_version`` (the inbox does, before its trust gate; versions only grow, so the
        group is still not from the future). Every other caller leaves it False. ``drop``: record
        the group and drop it on arrival with this reason, room or not (the inbox, for a group over
        its sampler's quota that it does not pay to check).

        A group whose ``policy_version`` is newer than the learner's version is rejected
        (``future_version``), so the learner must call :meth:`set_learner_version` with v before
        it publishes weights v. A uid that was already buffered, consumed or dropped is rejected
        as ``duplicate`` and keeps its status; a uid that was rejected before may be re-sent.
        A group already past the bound on arrival is accepted and immediately dropped as stale;
        one whose sampler already holds ``sampler_capacity`` groups is accepted and dropped as
        ``over_quota``, or (``order="newest"``) replaces the sampler's oldest group (see the class).
        """
        with self._cond:
            try:
                if not validated:
                    validate_group(group, self.spec, learner_version=self._learner_version)
                previous = self.ledger.status.get(group.group_uid, REJECTED)
                if not previous.startswith(REJECTED):
                    self.ledger.duplicates[group.group_uid] += 1
                    raise RecordRejected(
                        "group_uid",
                        "duplicate",
                        f"uid already {previous}",
                        sampler_id=str(group.sampler_id),
                        group_uid=group.group_uid,
                    )
            except RecordRejected as err:
                self._reject_locked(err)
                return False
            uid = group.group_uid
            displaced = self._displaced_locked(group)
            self._expected.pop(uid, None)
            self._groups[uid] = group
            if withheld:
                self._withheld.add(uid)
            self.ledger.mark(uid, BUFFERED)
            if is_stale(self._learner_version, group.policy_version, self.max_delay):
                self._drop(uid, "stale")  # past the bound on arrival: it can never be used
            elif drop is not None or displaced == uid:
                self._drop(uid, drop or "over_quota")
            elif displaced is not None:
                self._drop(displaced, "over_quota")
            elif self.capacity is not None and len(self._groups) > self.capacity:
                self._drop(next(iter(self._groups)), "overflow")
            self._cond.notify_all()
            return True

    def purge(self, uids, reason: str) -> int:
        """Drop the buffered groups among ``uids`` (counted under ``hetero/dropped/<reason>``);
        uids not buffered are left as they are. Returns how many were dropped."""
        with self._cond:
            dropped = [uid for uid in uids if uid in self._groups]
            for uid in dropped:
                self._drop(uid, reason)
            self._cond.notify_all()
            return len(dropped)

    def vouch(self, uids) -> int:
        """Release the withheld groups among ``uids`` to :meth:`take`; returns how many."""
        with self._cond:
            released = self._withheld.intersection(uids)
            self._withheld -= released
            self._cond.notify_all()
            return len(released)

    def takeable(self) -> int:
        """How many buffered groups :meth:`take` may return now (those not withheld)."""
        with self._cond:
            return len(self._groups) - len(self._withheld)

    def waits_on_withheld(self) -> bool:
        """Whether a :meth:`take` (or a consumer's :meth:`set_demand`) is waiting now, and withheld
        groups would serve it."""
        with self._cond:
            return self._short_takes > 0 or (self._demand > 0 and bool(self._withheld))

    def set_demand(self, n: int) -> None:
        """``n`` groups are waited for by a consumer that takes them one at a time between other
        work (the verl engine's pool ingress: its unfilled prompt slots), so it is waiting even when
        no :meth:`take` blocks at this moment."""
        with self._cond:
            self._demand = max(0, int(n))

    def withheld_by(self, sampler_id: str) -> int:
        """How many of ``sampler_id``'s buffered groups are withheld."""
        with self._cond:
            return sum(str(self._groups[uid].sampler_id) == sampler_id for uid in self._withheld)

    def reject(self, err: RecordRejected) -> None:
        """Count a record refused before it could be decoded or validated here (e.g. by the
        transport's signature check): as :meth:`add` counts its own rejections."""
        with self._cond:
            self._reject_locked(err)

    def _reject_locked(self, err: RecordRejected) -> None:
        self.last_rejection = err
        if self.on_reject is not None:
            self.on_reject(err)
        self._window_rejected[err.reason] += 1
        if err.reason != "duplicate":
            previous = self.ledger.status.get(err.group_uid, REJECTED)
            if previous.startswith(REJECTED):  # never overwrite a real status with a rejection
                self.ledger.mark(err.group_uid, f"{REJECTED}:{err.reason}")
            else:
                self.ledger.duplicates[err.group_uid] += 1
            self._expected.pop(err.group_uid, None)
        self._cond.notify_all()

    def expect(self, uid: str, policy_version: int, sampler_id: str = "?") -> None:
        """Announce a group being generated (``stale_policy="wait"`` waits for it before letting
        it go stale). Harmless under ``"drop"``. Cancel with :meth:`forget`."""
        with self._cond:
            if uid not in self.ledger.status:
                self._expected[uid] = (int(policy_version), str(sampler_id))

    def sync_expected(self, announced: dict[str, tuple[int, str]]) -> None:
        """Make the announced groups exactly ``announced`` (uid -> (policy_version, sampler_id)):
        new ones are expected, withdrawn ones (their sampler died, or the announcement was
        cleared) forgotten. Uids the ledger already knows are ignored."""
        with self._cond:
            for uid in [uid for uid in self._expected if uid not in announced]:
                del self._expected[uid]
            for uid, (version, sampler) in announced.items():
                if uid not in self.ledger.status:
                    self._expected[uid] = (int(version), str(sampler))
            self._cond.notify_all()

    def forget(self, uid: str) -> None:
        """Withdraw an :meth:`expect` (the sampler gave up on the group)."""
        with self._cond:
            self._expected.pop(uid, None)
            self._cond.notify_all()

    # ---------------------------------------------------------------- learner
    @property
    def learner_version(self) -> int:
        return self._learner_version

    def set_learner_version(self, version: int) -> None:
        """Tell the buffer the learner's current version (also done by ``take``). Versions only
        grow; groups past the bound are dropped at once."""
        with self._cond:
            self._advance(version)
            self._cond.notify_all()

    def take(self, n: int, learner_version: int, timeout_s: float | None = None) -> list[RolloutGroup]:
        """Remove and return ``n`` groups with ``learner_version - policy_version <= max_delay``.

        Blocks until they are available (and, under ``"wait"``, until expected groups that would
        go stale after this step have arrived), at most ``timeout_s`` (default
        ``wait_timeout_s``) seconds; then raises :class:`BufferTimeout`.
        """
        if n < 1:
            raise ValueError(f"take: n={n} must be >= 1")
        if self.capacity is not None and n > self.capacity:
            raise ValueError(f"take: n={n} exceeds the buffer capacity={self.capacity}; it could never be served")
        timeout_s = self.wait_timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        with self._cond:
            self._advance(learner_version)
            while True:
                blocking = self._blocking_expected()
                if len(self._groups) - len(self._withheld) >= n and not blocking:
                    break
                remaining = timeout_s - (time.monotonic() - start)
                if remaining <= 0:
                    self._window_wait_s += time.monotonic() - start
                    raise BufferTimeout(self._timeout_message(n, timeout_s, blocking))
                short = not blocking and bool(self._withheld)
                self._short_takes += short
                try:
                    self._cond.wait(timeout=min(remaining, 1.0))
                finally:
                    self._short_takes -= short
                # a blocked learner may see stale arrivals; keep the bound exact while waiting
                self._advance(learner_version)
            chosen = self._select(n)
            for group in chosen:
                del self._groups[group.group_uid]
                self.ledger.mark(group.group_uid, CONSUMED)
                self._window_staleness.append(learner_version - group.policy_version)
            self._window_wait_s += time.monotonic() - start
            return chosen

    def _advance(self, version: int) -> None:
        if version < self._learner_version:
            raise ValueError(f"learner_version={version} went backwards (buffer is at {self._learner_version})")
        self._learner_version = int(version)
        for uid in [uid for uid, g in self._groups.items() if is_stale(version, g.policy_version, self.max_delay)]:
            self._drop(uid, "stale_unvouched" if uid in self._withheld else "stale")

    def _blocking_expected(self) -> list[tuple[str, int, str]]:
        if self.stale_policy != "wait":
            return []
        # Worth waiting for: groups usable now (version >= v - N) that are stale after this step
        # (version <= v - N), i.e. exactly at the edge. Older ones are lost whatever we do.
        edge = self._learner_version - self.max_delay
        return [(uid, version, sampler) for uid, (version, sampler) in self._expected.items() if version == edge]

    def _select(self, n: int) -> list[RolloutGroup]:
        arrival = {uid: i for i, uid in enumerate(self._groups)}
        sign = 1 if self.order == "oldest" else -1
        takeable = [g for g in self._groups.values() if g.group_uid not in self._withheld]
        ranked = sorted(takeable, key=lambda g: (sign * g.policy_version, sign * arrival[g.group_uid]))
        return ranked[:n]

    def _drop(self, uid: str, reason: str) -> None:
        group = self._groups.pop(uid, None)
        if group is not None and reason.startswith("stale") and self.on_stale is not None:
            self.on_stale(group)
        self._withheld.discard(uid)
        self.ledger.mark(uid, f"{DROPPED}:{reason}")
        self._window_dropped[reason] += 1

    def _timeout_message(self, n: int, timeout_s: float, blocking: list) -> str:
        versions = [g.policy_version for g in self._groups.values()]
        newest = max(versions) if versions else None
        msg = (
            f"RolloutBuffer.take: waited {timeout_s:.1f}s for {n} groups at learner_version="
            f"{self._learner_version} (max_delay={self.max_delay}, stale_policy={self.stale_policy}); "
            f"have {len(self._groups)} fresh groups ({len(self._withheld)} withheld until a check vouches for "
            f"them), newest policy_version={newest}, "
            f"dropped so far={self.ledger.counts()[DROPPED]}"
        )
        if blocking:
            shown = ", ".join(f"{uid} (v{version}, {sampler})" for uid, version, sampler in blocking[:5])
            msg += f"; still waiting for {len(blocking)} expected groups: {shown}"
        rejected = {k.split(":", 1)[1]: v for k, v in self.ledger.counts().items() if k.startswith(f"{REJECTED}:")}
        if rejected:  # e.g. every group refused as unenrolled: the samplers are alive but not accepted
            msg += f"; rejected so far by reason: {dict(sorted(rejected.items()))}"
        return msg + ". Are the samplers alive, receiving weights, and (hetero.trust) enrolled?"

    # ---------------------------------------------------------------- reporting
    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def held_by(self, sampler_id: str) -> int:
        """How many buffered groups ``sampler_id`` sent."""
        with self._cond:
            return len(self._held_locked(sampler_id))

    def would_keep(self, group: RolloutGroup, also_held: int = 0) -> bool:
        """Whether ``group`` arriving now would be kept by its sampler's quota
        (``sampler_capacity``), counting ``also_held`` more of its sampler's groups as held (the
        inbox's: those awaiting a trust verdict, not buffered yet). Only :meth:`take` and drops
        remove groups, and a removal leaves room, so a True stays True for the one thread that adds
        groups (:meth:`add` applies the quota itself in any case)."""
        with self._cond:
            return self._displaced_locked(group, also_held) != group.group_uid

    def _displaced_locked(self, group: RolloutGroup, also_held: int = 0) -> str | None:
        """The uid the sampler's quota drops if ``group`` is added now (with ``also_held`` more of
        its sampler's groups counted as held): None (room), the group's own uid, or
        (``order="newest"``) the sampler's oldest buffered group when ``group`` is newer."""
        if self.sampler_capacity is None:
            return None
        held = self._held_locked(str(group.sampler_id))
        if len(held) + also_held < self.sampler_capacity:
            return None
        if not held or also_held >= self.sampler_capacity:
            # all its room awaits verdicts: nothing buffered to displace, or as many awaiting as
            # it may hold (so what awaits a verdict stays bounded under order=newest too)
            return group.group_uid
        oldest = min(held, key=lambda g: g.policy_version)  # the first arrival among equals
        if self.order == "newest" and group.policy_version > oldest.policy_version:
            return oldest.group_uid
        return group.group_uid

    def _held_locked(self, sampler_id: str) -> list[RolloutGroup]:
        return [group for group in self._groups.values() if str(group.sampler_id) == sampler_id]

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """Scalars under ``hetero/``. Window values cover what happened since the last
        ``metrics(reset=True)``: ``staleness_mean``/``_max``/``_min`` and
        ``staleness_hist/<k>`` (k = 0..max_delay) over consumed groups, ``wait_s`` (seconds
        blocked in take), ``dropped``/``rejected`` with per-reason ``dropped/<reason>``,
        ``rejected/<reason>``. Gauges: ``queue_depth``, ``withheld`` (of those, not takeable until
        vouched for), ``expected``. Run totals: ``consumed_total``,
        ``dropped_total``, ``rejected_total``, ``generated_total``."""
        with self._cond:
            stats = staleness_metrics(self._window_staleness, self.max_delay)
            hist = {k: v for k, v in stats.items() if k.startswith("hetero/staleness_hist/")}
            out: dict[str, float] = {
                "hetero/queue_depth": float(len(self._groups)),
                "hetero/withheld": float(len(self._withheld)),
                "hetero/expected": float(len(self._expected)),
                **{k: v for k, v in stats.items() if k not in hist},
                "hetero/wait_s": float(self._window_wait_s),
                "hetero/dropped": float(sum(self._window_dropped.values())),
                "hetero/rejected": float(sum(self._window_rejected.values())),
                **hist,
            }
            out.update({f"hetero/dropped/{r}": float(c) for r, c in self._window_dropped.items()})
            out.update({f"hetero/rejected/{r}": float(c) for r, c in self._window_rejected.items()})
            totals = self.ledger.counts()
            for kind in ("generated", CONSUMED, DROPPED, REJECTED):
                out[f"hetero/{kind}_total"] = float(totals[kind])
            if reset:
                self._window_staleness.clear()
                self._window_wait_s = 0.0
                self._window_dropped.clear()
                self._window_rejected.clear()
            return out

    def staleness_histogram(self) -> np.ndarray:
        """int64 (max_delay + 1,): consumed-group counts by staleness in the current window."""
        with self._cond:
            return np.bincount(np.asarray(self._window_staleness, dtype=np.int64), minlength=self.max_delay + 1)

    # ---------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict:
        """Everything needed to resume: config, learner version, the ledger, and the buffered
        groups as safetensors bytes (so the dict pickles or goes into torch.save)."""
        with self._cond:
            return {
                "max_delay": self.max_delay,
                "learner_version": self._learner_version,
                "ledger": self.ledger.state_dict(),
                "groups": [g.to_bytes() for g in self._groups.values()],
                "withheld": sorted(self._withheld),
            }

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`; replaces the current contents. Expected (in-flight)
        announcements are not restored: samplers re-announce after a resume."""
        with self._cond:
            groups = [RolloutGroup.from_bytes(b) for b in state["groups"]]
            self._learner_version = int(state["learner_version"])
            self.ledger.load_state_dict(state["ledger"])
            self._groups = {g.group_uid: g for g in groups}
            self._withheld = set(state.get("withheld", ())) & set(self._groups)
            self._expected.clear()
            for uid in self._groups:
                if self.ledger.status.get(uid) != BUFFERED:
                    raise ValueError(
                        f"load_state_dict: buffered group {uid!r} has ledger status "
                        f"{self.ledger.status.get(uid)!r}, state is inconsistent"
                    )
            self._advance(self._learner_version)  # a smaller max_delay after resume drops at once
            self._cond.notify_all()
