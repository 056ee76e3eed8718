"""Rollout groups over a transport, with nothing lost or repeated across a learner resume.

Sampler side: :func:`send_group` writes one group under its uid. Learner side:
:class:`RolloutInbox` moves groups from the transport into a
:class:`~verl_ext.hetero.buffer.RolloutBuffer` and keeps each message until
:meth:`RolloutInbox.acknowledge` gets the ledger of a saved checkpoint: a learner that dies before
checkpointing reads the group again after resuming, one that dies after does not. Loop::

    inbox.poll()                       # transport -> buffer
    groups = buffer.take(n, version)   # train on them
    ...
    state = buffer.state_dict()        # save it with the model checkpoint
    inbox.acknowledge(state)           # only after the checkpoint is durable
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Protocol

from verl_ext.trust.signing import Enrolment, SamplerKey, unverified_record
from verl_ext.hetero.buffer import REJECTED, RolloutBuffer
from verl_ext.hetero.protocol import EXPECTED_TOPIC, ROLLOUT_TOPIC, Announcement
from verl_ext.hetero.records import RecordRejected, RolloutGroup, validate_group
from verl_ext.hetero.transport import CorruptMessage, MessageInfo, Transport, check_name

__all__ = ["DEFERRED", "ROLLOUT_TOPIC", "RolloutInbox", "send_group"]

DEFERRED = "deferred"
"""What a deferring gate's :meth:`GroupGate.admit` returns for a group whose checks run elsewhere:
the verdict comes later, through :meth:`DeferringGate.settled`."""

logger = logging.getLogger(__name__)

BLAMELESS_REASONS = ("future_version",)
"""Validation failures that are not the sampler's fault (a version from a learner crash's lost
branch looks newer than the learner's); every other one counts against the sampler that signed it."""


def send_group(
    transport: Transport, group: RolloutGroup, topic: str = ROLLOUT_TOPIC, key: SamplerKey | None = None
) -> MessageInfo:
    """Write ``group`` under key = its uid (which must be a valid transport name: letters,
    digits, ``_ . = -``), signed with ``key`` when given (:mod:`verl_ext.trust.signing`).
    Re-sending the same uid replaces the message; the learner's ledger ensures it is used at most
    once."""
    check_name("group_uid", group.group_uid)
    data = group.to_bytes()
    if key is not None:
        if str(group.sampler_id) != key.sampler_id:
            raise ValueError(
                f"group {group.group_uid!r} names sampler {group.sampler_id!r} but the key is {key.sampler_id!r}'s"
            )
        data = key.seal(data)
    return transport.put(topic, group.group_uid, data)


class GroupGate(Protocol):
    """What a learner checks of a decoded group before it may enter the buffer
    (:class:`~verl_ext.trust.verifier.TrustGate` is one: trust, verification)."""

    def admit(self, group: RolloutGroup) -> bool:
        """Raise :class:`RecordRejected` to refuse ``group``; else True when a check vouched for it
        (the caller hands that to :meth:`accepted`, so nothing is remembered of a group the
        buffer then refuses)."""

    def accepted(self, group: RolloutGroup, vouched: bool = False) -> None:
        """``group`` entered the buffer; ``vouched``: what :meth:`admit` returned for it."""

    def withholds(self, vouched: bool) -> bool:
        """Whether a group :meth:`admit` judged ``vouched`` enters the buffer withheld (not taken
        until a later check of its sampler vouches for it: :meth:`RolloutBuffer.vouch`)."""

    def checks_over_quota(self, group: RolloutGroup) -> bool:
        """Whether ``group``, arriving over its sampler's quota, meets :meth:`admit` anyway
        (else it is passed over unchecked)."""

    def passed_over(self, group: RolloutGroup) -> None:
        """``group`` was dropped unchecked, over its sampler's quota: it never met :meth:`admit`,
        but a copy of it under another uid is still a replay."""

    def malformed(self, refusal: RecordRejected) -> None:
        """A signed record that does not decode, fails validation or makes a check raise: a failed
        check against the sampler ``refusal`` names (its signer)."""


class DeferringGate(GroupGate, Protocol):
    """A gate whose checks run elsewhere (:class:`~recipe.gepo.embedded.checker.OffloadedChecks`):
    :meth:`admit` may return :data:`DEFERRED`; the group then awaits its verdict out of the buffer,
    counted against its sampler's quota, and the inbox adds or refuses it when :meth:`settled`
    hands the verdict over."""

    def settled(self) -> list[tuple[RolloutGroup, bool | RecordRejected]]:
        """Verdicts that came back: ``(group, vouched)`` or ``(group, the refusal)``."""

    def awaiting(self, sampler_id: str) -> int:
        """Groups of ``sampler_id`` awaiting their verdict."""

    def awaits(self, uid: str) -> bool:
        """Whether the group ``uid`` awaits its verdict (the inbox does not read it again meanwhile)."""

    def flush(self) -> None:
        """Send the checks admitted since the last call (the inbox calls it after each read)."""


class RolloutInbox:
    """Reads rollout messages into a buffer (see module docstring).

    Args:
        transport: where samplers send groups (possibly a DelayChannel).
        buffer: the learner's RolloutBuffer (local object, not a Ray handle).
        topic: transport topic of rollouts.

    ``stats`` counters: ``received`` (handed to the buffer), ``corrupt`` (failed checksum or not
    decodable; counted once per message version, never handed over), ``uid_mismatch`` (payload
    uid differs from its key), ``unauthenticated`` (refused by the signature check: counted by
    the buffer under its reason), ``refused`` (refused by the gate), ``acknowledged`` (deleted
    after a checkpoint).

    With ``enrolment`` (:class:`~verl_ext.trust.signing.Enrolment`) only records signed by an
    enrolled, unrevoked sampler, and naming that sampler, are decoded and handed over; without
    it a signed record is read without checking its signature. With ``gate``, a decoded group
    also passes :meth:`GroupGate.admit` first (refusals counted by the buffer under their reason);
    a :class:`DeferringGate`'s verdicts are taken at the start of each :meth:`poll` (or by
    :meth:`settle`), and its groups awaiting one count against their sampler's quota.
    """

    def __init__(
        self,
        transport: Transport,
        buffer: RolloutBuffer,
        topic: str = ROLLOUT_TOPIC,
        announcements: Transport | None = None,
        enrolment: Enrolment | None = None,
        gate: GroupGate | None = None,
    ):
        self.transport, self.buffer, self.topic = transport, buffer, check_name("topic", topic)
        self.announcements = announcements
        self.enrolment, self.gate = enrolment, gate
        self.deferring = callable(getattr(gate, "settled", None))  # a DeferringGate
        self.stats: Counter[str] = Counter()
        # (key, sha256) handled this session whose uid the ledger has not settled (refused or
        # unreadable): a settled uid is skipped by its status, so its entry is dropped and the set
        # holds only what the learner refused, not every group of a long run
        self._processed: set[tuple[str, str]] = set()
        self._announced: dict[str, tuple[int, str]] = {}  # uid -> (version, sampler), parsed once

    def poll_announcements(self) -> int:
        """``stale_policy=wait``: mirror the ``expected`` topic into the buffer's expected groups
        (:meth:`RolloutBuffer.sync_expected`) and delete announcements of groups the ledger
        already knows. Returns how many groups are expected. A no-op without ``announcements``
        (the transport they are read from: undelayed, since an announcement is a few bytes)."""
        if self.announcements is None:
            return 0
        current: dict[str, tuple[int, str]] = {}
        for key in self.announcements.keys(EXPECTED_TOPIC):
            status = self.buffer.ledger.status.get(key)
            if status is not None and not status.startswith(REJECTED):
                self.announcements.delete(EXPECTED_TOPIC, key)  # arrived: nothing left to wait for
                self._announced.pop(key, None)
                continue
            if key not in self._announced:
                try:
                    record = Announcement.from_bytes(self.announcements.get(EXPECTED_TOPIC, key))
                except (KeyError, CorruptMessage, ValueError, TypeError):
                    continue  # gone, or not fully written yet: read it at the next poll
                self._announced[key] = (int(record.policy_version), str(record.sampler_id))
            current[key] = self._announced[key]
        for key in [k for k in self._announced if k not in current]:
            del self._announced[key]
        self.buffer.sync_expected(current)
        return len(current)

    def settle(self) -> int:
        """A deferring gate's verdicts that came back: each group added to the buffer or refused
        there (as :meth:`poll` does with an immediate verdict); returns how many were accepted."""
        accepted = 0
        for group, verdict in self.gate.settled() if self.deferring else ():
            if isinstance(verdict, RecordRejected):
                self.stats["refused"] += 1
                self.buffer.reject(verdict)
                continue
            # validated on arrival (versions only grow since: still not from the future)
            if self.buffer.add(group, validated=True, withheld=self.gate.withholds(verdict)):
                accepted += 1
                self.gate.accepted(group, verdict)
        return accepted

    def poll(self, max_groups: int | None = None, settle: bool = True) -> int:
        """Hand new messages to the buffer (at most ``max_groups`` new messages read); returns how
        many the buffer accepted (with ``settle``, a deferring gate's verdicts that came back
        included: :meth:`settle` first). Bad messages are counted and skipped, never raised. One
        listing and one read per call, however many groups arrived."""
        accepted = self.settle() if settle else 0
        fresh = []
        # one listing with checksums: messages already handled cost no further round trip
        for info in self.transport.infos(self.topic):
            key = info.key
            if max_groups is not None and len(fresh) >= max_groups:
                break
            if self.deferring and self.gate.awaits(key):
                continue  # read again (if re-sent) once its verdict is in
            status = self.buffer.ledger.status.get(key)
            if status is not None and not status.startswith(REJECTED):
                self._processed.discard((key, info.sha256))
                continue  # already buffered, consumed or dropped: never twice
            if (key, info.sha256) in self._processed:
                continue
            self._processed.add((key, info.sha256))
            fresh.append(key)
        # and one read for all new messages
        for key, data in self.transport.get_many(self.topic, fresh).items():
            if isinstance(data, KeyError):
                continue  # deleted or hidden since listing
            signer = None
            try:
                if isinstance(data, Exception):
                    raise data
                if self.enrolment is not None:
                    signer, data = self.enrolment.open(data, key)
                else:
                    data = unverified_record(data)
                group = RolloutGroup.from_bytes(data)
            except RecordRejected as err:
                self.stats["unauthenticated"] += 1
                self.buffer.reject(err)
                continue
            except CorruptMessage:
                self.stats["corrupt"] += 1
                continue
            except ValueError as err:  # signed (or unsigned) bytes that are not a rollout group
                self.stats["corrupt"] += 1
                if signer is not None and self.gate is not None:
                    refusal = RecordRejected("record", "undecodable", str(err)[:300], sampler_id=signer, group_uid=key)
                    self.gate.malformed(refusal)
                    self.buffer.reject(refusal)
                continue
            if group.group_uid != key:
                self.stats["uid_mismatch"] += 1
                continue
            if signer is not None and str(group.sampler_id) != signer:
                self.stats["unauthenticated"] += 1
                self.buffer.reject(
                    RecordRejected(
                        "sampler_id",
                        "sampler_mismatch",
                        f"record names sampler {group.sampler_id!r}, signed by {signer!r}",
                        sampler_id=signer,
                        group_uid=key,
                    )
                )
                continue
            self.stats["received"] += 1
            vouched = False
            if self.gate is not None:
                try:
                    # malformed first, with its named reason; only a well-formed group meets the gate
                    validate_group(group, self.buffer.spec, learner_version=self.buffer.learner_version)
                except RecordRejected as err:
                    self.stats["malformed"] += 1
                    if signer is not None and err.reason not in BLAMELESS_REASONS:
                        self.gate.malformed(err)  # its signer sent it: unsigned, anyone could have
                    self.buffer.reject(err)
                    continue
                try:
                    awaiting = self.gate.awaiting(str(group.sampler_id)) if self.deferring else 0
                    if not self.buffer.would_keep(group, also_held=awaiting) and not self.gate.checks_over_quota(group):
                        # its sampler's quota is full: dropped on arrival, no check paid for it (a
                        # flooding sampler costs a count); a kept group stays kept until the
                        # buffer.add below, so every group that enters was checked
                        self.buffer.add(group, validated=True, drop="over_quota")
                        self.gate.passed_over(group)
                        continue
                    verdict = self.gate.admit(group)
                except RecordRejected as err:
                    self.stats["refused"] += 1
                    self.buffer.reject(err)
                    continue
                except Exception as err:  # noqa: BLE001 - no record may stop the learner
                    refusal = RecordRejected(
                        "record",
                        "check_error",
                        f"its check raised {type(err).__name__}: {str(err)[:300]}",
                        sampler_id=str(group.sampler_id),
                        group_uid=key,
                    )
                    logger.warning("%s", refusal, exc_info=True)
                    self.stats["check_error"] += 1
                    if signer is not None:
                        self.gate.malformed(refusal)
                    self.buffer.reject(refusal)
                    continue
                if verdict is DEFERRED:
                    continue  # out of the buffer until settle() has its verdict
                vouched = bool(verdict)
            # validated just above when there is a gate: the buffer does not validate it again
            withheld = self.gate is not None and self.gate.withholds(vouched)
            if self.buffer.add(group, validated=self.gate is not None, withheld=withheld):
                accepted += 1
                if self.gate is not None:
                    self.gate.accepted(group, vouched)
        if self.deferring:
            self.gate.flush()
        return accepted

    def acknowledge(self, buffer_state: dict) -> int:
        """Delete messages whose uid appears in the ledger of ``buffer_state`` (a
        ``RolloutBuffer.state_dict()`` that has been saved durably). Returns how many."""
        known = buffer_state["ledger"]["status"]
        keys = [key for key in self.transport.keys(self.topic) if key in known]
        self.transport.delete_many(self.topic, keys)
        self.stats["acknowledged"] += len(keys)
        return len(keys)

    def metrics(self) -> dict[str, float]:
        """``hetero/inbox_<stat>`` for every counter of :attr:`stats` (received, corrupt,
        unauthenticated, uid_mismatch, malformed, refused, check_error, acknowledged): totals since
        this inbox was made."""
        return {f"hetero/inbox_{k}": float(v) for k, v in self.stats.items()}
