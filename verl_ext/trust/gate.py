"""The gate every arriving group passes on its way into the buffer: :class:`TrustGate`.

It owns the books: enrolment (the inbox checks signatures against it), quarantine and the divergence
bound (:class:`~.ledger.TrustLedger`), replays (``replayed``), slots taken and assigned seeds
(:mod:`.assignment`), the CUSUM of small lies, which groups are re-scored and which withheld.
The checks are a :class:`~verl_ext.trust.verifier.GroupVerifier`'s, run in the caller's thread
(:meth:`TrustGate.admit`) or elsewhere between :meth:`TrustGate.begin` and :meth:`TrustGate.finish`.

Contract: no group is admitted unchecked in place of a check that is due, and (``hold_unchecked``)
no unchecked group is taken before a passed check of a later group of its sampler vouches for it
(:meth:`TrustGate.withholds`). A due check whose version's weights are not held refuses the group
(``unverifiable_version``, no blame); a group claiming a version lost in a learner crash is always
re-scored (``lost_version``, no blame). No Ray and no engine import: a caller needs a
:class:`TrustConfig`-like config, the buffer and, for checks in its own thread, a verifier.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from verl_ext.hetero.buffer import RolloutBuffer
from verl_ext.hetero.records import RecordRejected, RolloutGroup
from verl_ext.hetero.staleness import is_stale
from verl_ext.trust.assignment import assigned_seed, gumbel_key
from verl_ext.trust.bounds import Mismatch, MismatchCusum, precision_refusal
from verl_ext.trust.signing import Enrolment
from verl_ext.trust.verifier import CheckResult, GroupVerifier


def content_digest(group: RolloutGroup) -> str:
    """What makes a group the same group whatever its uid, row order or reported numbers: its
    prompt's tokens and the multiset of its responses' tokens (padding left out). The log-probs,
    rewards, version and row order are not part of it, so a copy with its rows rotated, its q
    nudged or another version claimed is still a copy. Two honest groups coincide only by drawing
    the very same G responses for the same prompt (a confident model on a short answer does; such
    a group's responses all score alike, so its group advantages carry little or nothing)."""
    h = hashlib.blake2b(digest_size=16)
    prompt = np.asarray(group.prompt_ids, np.int64)
    if group.prompt_mask is not None:
        prompt = prompt[np.asarray(group.prompt_mask).astype(bool)]
    h.update(len(prompt).to_bytes(4, "little") + np.ascontiguousarray(prompt).tobytes())
    mask = np.asarray(group.response_mask).astype(bool)
    rows = sorted(
        np.ascontiguousarray(np.asarray(ids, np.int64)[keep]).tobytes() for ids, keep in zip(group.response_ids, mask)
    )
    for row in rows:
        h.update(len(row).to_bytes(4, "little") + row)
    return h.hexdigest()


@dataclass
class Admission:
    """A group between :meth:`TrustGate.begin` and :meth:`TrustGate.finish`: what the gate decided
    before any check. ``rescore``: its q is re-scored (probation or the fraction's draw); ``lost``:
    it claims a version lost in a learner crash (re-scored whatever ``rescore`` says); ``replayed``:
    its content was seen before (only a lost version's group gets this far so: the re-score
    decides which refusal it gets); ``checks``: any check is configured (the rewards' included);
    ``arrival``: its place in the gate's order of arrivals (a pass vouches for what came before)."""

    group: RolloutGroup
    digest: str
    rescore: bool
    lost: bool
    replayed: bool
    checks: bool
    arrival: int = 0

    @property
    def version(self) -> int:
        return int(self.group.policy_version)

    @property
    def wants_weights(self) -> bool:
        """Its claimed version's weights are needed (a re-score is due)."""
        return self.rescore or self.lost


class TrustGate:
    """``hetero.trust`` on the learner: every decoded, well-formed group passes :meth:`admit` (or
    :meth:`begin`, its checks, :meth:`finish`) before it may enter the buffer.

    Args:
        config: the trust options (``hetero.trust``: :class:`TrustConfig`).
        buffer: the buffer groups enter (its version and bound; a quarantine purges from it).
        verifier: runs the checks in :meth:`admit`; None when they run elsewhere.
        secret: the key of the draw of groups to re-score (None: a fresh random one; a resume
            restores the run's own with :meth:`load_state_dict`).
        precisions: the sampler precisions this run accepts (its config's); a group declaring
            another is refused, so no sampler widens its bounds by what it declares. None: any known.

    Threads: the inbox's poller calls :meth:`admit` (or :meth:`begin` and :meth:`finish`) /
    :meth:`accepted`, the learner's thread :meth:`trained` / :meth:`remember` / :meth:`metrics`,
    Ray's control thread :meth:`enrol`; the books are behind one lock, the checks run outside it.
    """

    VERSION_WAIT_S = 30.0
    """How long :meth:`admit` waits for the weights of a version the buffer already accepts (the
    learner publishes them between the two): the time one weight publication takes, with room.
    Only a group claiming the newest version waits, and only in that gap."""

    def __init__(
        self,
        config: Any,
        buffer: RolloutBuffer,
        verifier: Optional[GroupVerifier] = None,
        secret: Optional[bytes] = None,
        precisions: Optional[tuple[str, ...]] = None,
    ):
        self.config, self.buffer = config, buffer
        self.precisions = None if precisions is None else tuple(precisions)
        self.enrolment = Enrolment() if config.sign_records else None
        self._enrolment_stamp: Optional[tuple[float, int]] = None
        self.ledger = config.ledger(secret)
        self._lock = threading.Lock()
        # content digest of every accepted group and every group passed over -> the sampler whose
        # passed check it earned ("" when none: unchecked, passed over, or its credit withdrawn)
        self._contents: dict[str, str] = {}
        # ... and -> the uid it first came under: the same uid read again after a learner resume
        # (admitted, not yet trained at the checkpoint) is that group again, not a copy of it
        self._content_uids: dict[str, str] = {}
        self.passed_over_counts: Counter[str] = Counter()  # sampler -> groups dropped unchecked over its quota
        self.lost_versions: set[int] = set()  # version numbers a crashed learner published past its checkpoint
        self.check_cpu_s = 0.0  # CPU seconds of the verifier's checks, wherever they ran
        self.learner_check_cpu_s = 0.0  # ... of those, in this process (the learner's, in a run)
        self.token_counts: Counter[str] = Counter()  # the token check's counts, all checked groups
        self.version_wait_s = self.VERSION_WAIT_S
        self.cusum = MismatchCusum()  # per sampler: small lies in q, summed over its checked groups
        # the per-group bounds and the CUSUMs' (a calibration's, if given): the verifier's, when local
        self.bounds = verifier.bounds if verifier is not None else config.bounds()
        self.checking = config.verify_fraction > 0 or config.check_rewards  # any check at all
        self.rescoring = config.verify_fraction > 0
        self.withholding = self.rescoring and bool(config.hold_unchecked)
        self._arrivals = 0  # groups begun or accepted so far: the order a pass vouches by
        self._over_quota_checks: dict[str, int] = {}  # sampler -> learner version of its last one
        # digest -> whether a copy arrived: groups between begin and finish (awaiting their verdict)
        self._awaiting: dict[str, bool] = {}
        # (sampler, batch, slot) of every group accepted or passed over -> its uid; of those awaiting a verdict
        self._slots: dict[tuple[str, int, int], str] = {}
        self._slots_awaiting: set[tuple[str, int, int]] = set()
        # prompts, seeds and slots as the learner assigns them (verl_ext.trust.assignment); off only
        # in research benches that offer one pool of groups under many sampler ids
        self.check_assignment = True
        self.verifier = verifier if self.checking else None

    # ---------------------------------------------------------------- enrolment
    def enrol(self, sampler_id: str, public_hex: Optional[str]) -> None:
        """Accept records signed by this key in this sampler's name (a sampler the learner launched)."""
        if self.enrolment is not None and public_hex is not None:
            self.enrolment.enrol(sampler_id, public_hex)

    def reload_enrolment(self) -> None:
        """``enrolment_file``: add its keys and revocations when the file has changed."""
        path = self.config.enrolment_file
        if self.enrolment is None or not path:
            return
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return
        stamp = (stat.st_mtime, stat.st_size)
        if stamp != self._enrolment_stamp:
            self.enrolment.update(Enrolment.load(path))
            self._enrolment_stamp = stamp

    # ---------------------------------------------------------------- the gate
    def lose_versions(self, versions) -> None:
        """Version numbers whose earlier weights are gone (see the module docstring)."""
        with self._lock:
            self.lost_versions |= {int(v) for v in versions}

    def remember(self, version: int, message: bytes) -> None:
        """A published version's message (the weight store's), for re-scoring groups that claim it."""
        if self.verifier is not None and self.rescoring:
            self.verifier.remember(version, message)

    def admit(self, group: RolloutGroup) -> bool:
        """Refuse (:class:`RecordRejected`, reason named) or let ``group`` through: True when a
        passed re-score vouched for it. Nothing of the group is remembered here: the caller hands
        the verdict to :meth:`accepted` once the buffer has taken the group (a group the buffer
        refuses leaves no trace, and its uid may be re-sent and judged afresh).

        The gate in one call: :meth:`begin`, the checks in this thread (waiting for a version the
        buffer already accepts, :attr:`version_wait_s` at most), :meth:`finish`."""
        if self.checking and self.verifier is None:
            raise RuntimeError("this gate has no verifier (its checks run elsewhere): use begin() and finish()")
        admission = self.begin(group)
        result = CheckResult(held=False)
        if self.verifier is not None:
            if admission.wants_weights:
                # the buffer takes version v before the learner hands v's weights here: wait for them
                self.verifier.wait_for(admission.version, self.version_wait_s)
            result = self.verifier.run(
                group, rewards=admission.checks, logprobs=admission.wants_weights, lost=admission.lost
            )
        return self.finish(admission, result)

    def begin(self, group: RolloutGroup) -> Admission:
        """The gate's part before any check (cheap: the books only): refuse a quarantined or
        divergent sampler, an unknown precision, a missing seed, or a replay (without blame);
        draw whether q is re-scored. Returns what the checks must do for :meth:`finish`."""
        sampler, uid = str(group.sampler_id), group.group_uid
        version = int(group.policy_version)
        with self._lock:
            refusal = self.ledger.refusal(sampler)
            if refusal is not None:
                self.ledger.refused(refusal)
                raise RecordRejected("sampler_id", refusal, f"sampler is {refusal}", sampler_id=sampler, group_uid=uid)
            if self.checking and self.rescoring:
                # the tolerance of a re-score depends on it: refused on every group, checked or not
                unknown = precision_refusal(group.sampler_precision)
                if unknown is None and self.precisions is not None and group.sampler_precision not in self.precisions:
                    unknown = (
                        "precision_not_accepted",
                        f"sampler_precision={group.sampler_precision!r}: this run accepts "
                        f"{', '.join(self.precisions)} (hetero.sampler_precision)",
                    )
                if unknown is not None:
                    self.ledger.refused(unknown[0])
                    raise RecordRejected("sampler_precision", *unknown, sampler_id=sampler, group_uid=uid)
                seed = group.sampling_seed
                if self.config.checkable_sampling and (
                    not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)
                ):
                    # the token check needs it: refused on every group, checked or not (no blame:
                    # a sampler not configured for it, not a lie shown)
                    self.ledger.refused("unseeded")
                    raise RecordRejected(
                        "sampling_seed",
                        "unseeded",
                        f"sampling_seed={seed!r}: "
                        "hetero.trust.checkable_sampling needs each group's Gumbel-max seed "
                        "(an integer) in its signed record",
                        sampler_id=sampler,
                        group_uid=uid,
                    )
                if self.config.checkable_sampling and self.check_assignment:
                    self._check_assigned_seed(group)
            slot = self._slot(group)
            if slot is not None and (self._slots.get(slot, uid) != uid or slot in self._slots_awaiting):
                # one draw per assigned prompt: a second is another draw of the same prompt (no
                # blame: sending only the draw it likes is withholding, which no check can see)
                self.ledger.refused("slot_reused")
                raise RecordRejected(
                    "batch_slot",
                    "slot_reused",
                    f"slot {group.batch_slot} of batch {group.batch_index} was sent before",
                    sampler_id=sampler,
                    group_uid=uid,
                )
            digest = content_digest(group)
            rescore = self.rescoring and self.ledger.should_check(
                sampler, f"{uid}\x00{digest}", self._fraction(sampler)
            )
            if digest in self._awaiting:
                # a copy of a group still awaiting its verdict: the same tokens twice, as below;
                # the first earns no credit by its check
                self._awaiting[digest] = True
                replayed = True
            else:
                replayed = self._known_copy(digest, uid)
                if replayed and self._contents[digest]:
                    # the same tokens twice: one of the two copied, and which cannot be told (the
                    # first to arrive may be the copy). The credit the first earned by its check is
                    # withdrawn, so a copier that front-runs an honest sampler gains no trust by it;
                    # no blame
                    self.ledger.withdraw_credit(self._contents[digest])
                    self._contents[digest] = ""
            lost = self.checking and version in self.lost_versions
            if replayed and not lost:
                raise self._replayed(group, digest)
            if not replayed:
                self._awaiting[digest] = False
            if slot is not None:
                self._slots_awaiting.add(slot)
            self._arrivals += 1
            arrival = self._arrivals
        return Admission(
            group, digest, rescore=rescore, lost=lost, replayed=replayed, checks=self.checking, arrival=arrival
        )

    def _known_copy(self, digest: str, uid: str) -> bool:
        """Whether content ``digest`` was received before under another uid than ``uid``. Lock held."""
        return digest in self._contents and self._content_uids.get(digest) != uid

    def _slot(self, group: RolloutGroup) -> Optional[tuple[str, int, int]]:
        """(sampler, batch, slot) of an assigned group; None for an unassigned one, or with the
        assignment off (``check_assignment``)."""
        if not self.check_assignment or group.batch_index is None or group.batch_slot is None:
            return None
        return (str(group.sampler_id), int(group.batch_index), int(group.batch_slot))

    def _check_assigned_seed(self, group: RolloutGroup) -> None:
        """Under checkable sampling a group's seed is the learner's assignment for its slot and
        version (:func:`~verl_ext.trust.assignment.assigned_seed`): another seed is a sampler
        choosing its draw (``seed_not_assigned``, a failed check). A group without a slot is
        refused without blame (``unassigned``: a sampler not following the protocol). Lock held."""
        sampler, uid = str(group.sampler_id), group.group_uid
        slot = self._slot(group)
        if slot is None:
            self.ledger.refused("unassigned")
            raise RecordRejected(
                "batch_index",
                "unassigned",
                "hetero.trust.checkable_sampling needs each group's batch_index and batch_slot (the "
                "learner's assignment of its prompt and seed) in its signed record",
                sampler_id=sampler,
                group_uid=uid,
            )
        expected = assigned_seed(gumbel_key(self.ledger.secret), sampler, slot[1], slot[2], group.policy_version)
        if int(group.sampling_seed) != expected:
            failure = (
                "seed_not_assigned",
                f"sampling_seed={group.sampling_seed} is not the seed the learner assigned to slot {slot[2]} "
                f"of batch {slot[1]} at v{group.policy_version}",
            )
            self._record_failure(group, failure)
            raise RecordRejected("sampling_seed", *failure, sampler_id=sampler, group_uid=uid)

    def _replayed(self, group: RolloutGroup, digest: str) -> RecordRejected:
        # Old content under a new uid: refused, but without blame. Two honest samplers (or one,
        # twice) can draw the very same responses at the same version -- a confident model on
        # a short answer does -- and their log-probs are then identical too, so a coincidence
        # looks exactly like a replay; the refusal alone takes away all a replay could gain.
        return RecordRejected(
            "record",
            "replayed",
            "this group's content (its prompt and its responses' tokens, in any order) was received before, "
            f"first as {self._content_uids.get(digest, 'a group still awaiting its verdict')}",
            sampler_id=str(group.sampler_id),
            group_uid=group.group_uid,
        )

    def finish(self, admission: Admission, result: CheckResult) -> bool:
        """The verdict on a begun group from its checks' ``result`` (:meth:`GroupVerifier.run`,
        here or in a checker process): refuse it (:class:`RecordRejected`) or return whether a
        passed re-score vouched for it, as :meth:`admit` does. A sampler quarantined while the
        group awaited its verdict has it refused too."""
        group = admission.group
        credited = False
        try:
            self._account(group, result)
            self._refuse_lost_version(admission, result)
            if admission.replayed:
                raise self._replayed(group, admission.digest)
            rescore, failure, mismatch = self._outcome(admission, result)
            with self._lock:
                if failure is None and mismatch is not None:
                    failure = self._repeated_mismatch(group, mismatch, result)
                if failure is None:
                    if rescore:
                        self.ledger.record(
                            str(group.sampler_id),
                            group.group_uid,
                            passed=True,
                            arrival=admission.arrival,
                            release=self.buffer.vouch,
                        )
                        credited = True
                    return rescore
                self._record_failure(group, failure)
            raise RecordRejected("record", *failure, sampler_id=str(group.sampler_id), group_uid=group.group_uid)
        finally:
            self._settle_copies(admission, credited)
            slot = self._slot(group)
            if slot is not None:
                with self._lock:
                    self._slots_awaiting.discard(slot)

    def _account(self, group: RolloutGroup, result: CheckResult) -> None:
        """Book the checks' cost and token counts; refuse a group whose sampler was quarantined (or
        went divergent) while it was checked."""
        sampler = str(group.sampler_id)
        with self._lock:
            self.check_cpu_s += result.cpu_s
            if result.pid == os.getpid():
                self.learner_check_cpu_s += result.cpu_s
            self.token_counts.update(result.tokens)
            refusal = self.ledger.refusal(sampler)
            if refusal is not None:
                self.ledger.refused(refusal)
                raise RecordRejected(
                    "sampler_id", refusal, f"sampler is {refusal}", sampler_id=sampler, group_uid=group.group_uid
                )

    def _refuse_lost_version(self, admission: Admission, result: CheckResult) -> None:
        """A group claiming a lost version gets in only when its re-score matches our weights of
        that number (else it was made with the crashed learner's: refused without blame)."""
        if not admission.lost:
            return
        group = admission.group
        lost = (
            result.logprobs_failure
            if result.held
            else ("lost_version", "the learner does not hold its own weights of that number to tell")
        )
        if lost is not None:
            raise RecordRejected(
                "policy_version",
                "lost_version",
                f"version {group.policy_version} was republished after a learner resume; {lost[1]}",
                sampler_id=str(group.sampler_id),
                group_uid=group.group_uid,
            )

    def _outcome(
        self, admission: Admission, result: CheckResult
    ) -> tuple[bool, Optional[tuple[str, str]], Optional[Mismatch]]:
        """(whether the group was re-scored, its failure, its mismatch) from the checks' result.
        A due re-score that could not be made refuses the group (``unverifiable_version``, no
        blame), unless the group is past the bound (the buffer drops it unused)."""
        if not self.checking:
            return admission.rescore, None, None
        group, version = admission.group, admission.version
        rescore = admission.rescore
        if rescore and not result.held and is_stale(self.buffer.learner_version, version, self.buffer.max_delay):
            rescore = False
        if rescore and not result.held:
            raise RecordRejected(
                "policy_version",
                "unverifiable_version",
                f"a check is due and the learner does "
                f"not hold version {version}'s weights (waited {self.version_wait_s:g} s)",
                sampler_id=str(group.sampler_id),
                group_uid=group.group_uid,
            )
        failure = result.rewards_failure
        if failure is None and rescore:
            return rescore, result.logprobs_failure, result.mismatch
        return rescore, failure, None

    def _repeated_mismatch(
        self, group: RolloutGroup, mismatch: Mismatch, result: CheckResult
    ) -> Optional[tuple[str, str]]:
        """Add a passed re-score's mismatch to its sampler's CUSUM: a failure once small lies add up.
        Call with the lock held."""
        precision = str(group.sampler_precision)
        checked = result.tokens.get("tokens_checked", 0)  # the token check's counts, if it ran
        repeated = self.cusum.add(
            str(group.sampler_id),
            mismatch,
            self.bounds.tolerance(result.scorer_precision, precision),
            self.bounds.bounds_precision(result.scorer_precision, precision),
            near_ties=(checked, result.tokens.get("token_near_ties", 0)) if checked else None,
        )
        return None if repeated is None else ("bad_logprobs", repeated)

    def _record_failure(self, group: RolloutGroup, failure: tuple[str, str]) -> None:
        """A failed check against its sampler; a quarantine drops its unchecked groups still
        buffered (the buffer's lock inside the gate's: the buffer never calls the gate). Call with
        the lock held."""
        reason, detail = failure
        self.ledger.record(
            str(group.sampler_id),
            group.group_uid,
            passed=False,
            reason=reason,
            detail=detail,
            drop=lambda uids: self.buffer.purge(uids, "quarantined"),
        )

    def _settle_copies(self, admission: Admission, credited: bool) -> None:
        """A copy arrived while this group awaited its verdict (and was refused as replayed): what
        its check earned is withdrawn, and its content is known."""
        if admission.replayed:
            return
        with self._lock:
            if self._awaiting.pop(admission.digest, False):
                if credited:
                    self.ledger.withdraw_credit(str(admission.group.sampler_id))
                self._know(admission.digest, admission.group.group_uid, "")

    WAITING_FRACTION = 0.5
    """The draw's fraction (if above ``verify_fraction``) for a sampler with withheld groups while
    the learner waits on them: they are vouched for sooner. Still the secret's draw: a sampler
    cannot tell which arrival is checked, and a higher rate only catches lies sooner."""

    def _fraction(self, sampler: str) -> Optional[float]:
        """The draw's fraction for ``sampler``'s next group (None: ``verify_fraction``)."""
        if self.withholding and self.buffer.waits_on_withheld() and self.buffer.withheld_by(sampler):
            return max(self.config.verify_fraction, self.WAITING_FRACTION)
        return None

    def withholds(self, vouched: bool) -> bool:
        """Whether a group with :meth:`admit`'s verdict ``vouched`` enters the buffer withheld
        (``hold_unchecked``: not taken until a later group's passed check vouches for it)."""
        return self.withholding and not vouched

    def checks_over_quota(self, group: RolloutGroup) -> bool:
        """Whether ``group``, arriving over its sampler's quota, is checked anyway rather than
        passed over: it is drawn for a re-score, its sampler has groups withheld (a quota full of
        them would otherwise never be vouched for: no arrival gets checked, the learner waits for
        them, and they never go stale), and it is the sampler's first such check at this learner
        version (a flooder buys one check per version). The draw is the secret's, so a sampler
        cannot tell which of its arrivals this check will be."""
        sampler = str(group.sampler_id)
        if not self.withholding or not self.buffer.withheld_by(sampler):
            return False
        version = self.buffer.learner_version
        with self._lock:
            if self._over_quota_checks.get(sampler) == version or self.ledger.refusal(sampler) is not None:
                return False
            if not self.ledger.should_check(
                sampler, f"{group.group_uid}\x00{content_digest(group)}", self._fraction(sampler)
            ):
                return False
            self._over_quota_checks[sampler] = version
            return True

    def accepted(self, group: RolloutGroup, vouched: bool = False) -> None:
        """``group`` entered the buffer; ``vouched``: :meth:`admit`'s verdict on it (a group no
        check vouched for is purged if its sampler is quarantined before a check passes, and
        vouched for by a passed check of a group that arrives after this call)."""
        with self._lock:
            digest = content_digest(group)
            # already known: a copy came while it awaited its verdict, and its credit was withdrawn
            copied = self._known_copy(digest, group.group_uid)
            self._know(digest, group.group_uid, "" if copied else (str(group.sampler_id) if vouched else ""))
            self._commit_slot(group)
            if not vouched:
                self._arrivals += 1
                self.ledger.accepted(str(group.sampler_id), group.group_uid, arrival=self._arrivals)

    def _commit_slot(self, group: RolloutGroup) -> None:
        """The group's slot is taken for good (it entered the buffer, or was passed over). Lock held."""
        slot = self._slot(group)
        if slot is not None:
            self._slots.setdefault(slot, group.group_uid)

    def _know(self, digest: str, uid: str, vouched_by: str) -> None:
        """Remember content ``digest`` (its first uid kept), vouched for by ``vouched_by``. Lock held."""
        self._contents[digest] = vouched_by
        self._content_uids.setdefault(digest, uid)

    def malformed(self, refusal: RecordRejected) -> None:
        """A signed record that does not decode, fails validation or makes a check raise: a failed
        check against the sampler ``refusal`` names (its signer: the inbox refuses any record
        naming another sampler than the one that signed it)."""
        with self._lock:
            self.ledger.record(
                str(refusal.sampler_id),
                str(refusal.group_uid),
                passed=False,
                reason=refusal.reason,
                detail=str(refusal),
                drop=lambda uids: self.buffer.purge(uids, "quarantined"),
            )

    def passed_over(self, group: RolloutGroup) -> None:
        """A group the inbox dropped unchecked (over its sampler's quota): its content is known
        from now on, so a copy under another uid is refused as ``replayed`` (else a replaying
        sampler could pass off an honest group the learner never used as its own)."""
        with self._lock:
            digest = content_digest(group)
            if digest not in self._contents:
                self._know(digest, group.group_uid, "")
            self.passed_over_counts[str(group.sampler_id)] += 1
            self._commit_slot(group)

    def trained(self, groups: list[RolloutGroup], divergence: list[float]) -> None:
        """After a step: each consumed group's measured divergence (the per-sampler bound)."""
        with self._lock:
            for group, value in zip(groups, divergence):
                self.ledger.observe_divergence(str(group.sampler_id), value)

    # ---------------------------------------------------------------- reporting
    def drain_events(self) -> list[dict]:
        with self._lock:
            return self.ledger.drain_events()

    def metrics(self) -> dict[str, float]:
        """The ledger's ``trust/*``, ``trust/<sampler id>/passed_over`` (its groups dropped unchecked
        over its quota: who floods), ``perf/trust_check_cpu_s_total`` (CPU seconds spent checking,
        wherever) and ``perf/trust_check_learner_cpu_s_total`` (the part in this process)."""
        with self._lock:
            passed = {f"trust/{sampler}/passed_over": float(n) for sampler, n in self.passed_over_counts.items()}
            cusum = {f"trust/{sampler}/mismatch_cusum": value for sampler, value in self.cusum.sums.items()}
            tokens = (
                {f"trust/{k}": float(v) for k, v in self.token_counts.items()}
                if self.rescoring and self.config.checkable_sampling
                else {}
            )
            return {
                **self.ledger.metrics(),
                **passed,
                **cusum,
                **tokens,
                "perf/trust_check_cpu_s_total": self.check_cpu_s,
                "perf/trust_check_learner_cpu_s_total": self.learner_check_cpu_s,
            }

    def state_dict(self) -> dict:
        with self._lock:
            return {
                "ledger": self.ledger.state_dict(),
                "contents": dict(sorted(self._contents.items())),
                "content_uids": dict(sorted(self._content_uids.items())),
                "lost_versions": sorted(self.lost_versions),
                "passed_over": dict(self.passed_over_counts),
                "cusum": self.cusum.state_dict(),
                "arrivals": self._arrivals,
                "slots": sorted([*slot, uid] for slot, uid in self._slots.items()),
            }

    def load_state_dict(self, state: dict) -> None:
        with self._lock:
            self.ledger.load_state_dict(state["ledger"])
            contents = state["contents"]  # a list before checks earned credit per content
            self._contents = dict(contents) if isinstance(contents, dict) else dict.fromkeys(contents, "")
            self._content_uids = dict(state.get("content_uids", {}))  # absent before: every re-read a copy
            self.lost_versions = set(state.get("lost_versions", []))
            self.passed_over_counts = Counter(state.get("passed_over", {}))
            self.cusum.load_state_dict(state.get("cusum", {}))
            self._arrivals = int(state.get("arrivals", 0))
            # [sampler, batch, slot, uid]; without the uid (older checkpoints) no uid matches it
            self._slots = {
                (str(e[0]), int(e[1]), int(e[2])): str(e[3]) if len(e) > 3 else "" for e in state.get("slots", [])
            }
