"""After the soak's run: the learner's final ledger, every sampler group accounted for by uid,
the ledger against the step metrics, and each injected fault judged (see ``research/soak/__main__.py``)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import ray

from .faults import BAD_REASON, LIAR_UID, SAMPLER_ACTOR, SAMPLER_UID, WAN_FAULT_WEIGHTS, Fault
from verl_ext.rundir import load_latest_checkpoint, read_events

_NO_STATE = {"step": 0, "learner": {"version": 0}, "buffer": {"ledger": {"status": {}, "duplicates": {}}}}


# --------------------------------------------------------------------------- the final ledger
@dataclass
class FinalState:
    """The learner's ledger (uid -> status) and policy version when the soak ended."""

    ledger: dict[str, str]
    duplicates: dict[str, int]
    version: int
    source: str  # "live learner" or which checkpoint, and why
    checkpoint_step: Optional[int] = None  # set when the ledger comes from a checkpoint


def final_state(learner_handle: Any, run_dir: Path) -> FinalState:
    """From the live learner (the injector held a handle on it), else from the run directory's
    latest checkpoint."""
    checkpoint_step = None
    try:
        if learner_handle is None:
            raise ValueError("no handle on the learner was taken")
        state = ray.get(learner_handle.checkpoint_state.remote(), timeout=120)
        source = "live learner"
    except Exception as err:  # noqa: BLE001 - learner dead: fall back to the latest checkpoint
        state = load_latest_checkpoint(run_dir) or _NO_STATE
        why = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
        source = f"latest checkpoint, step {state['step']} (live learner unavailable: {why})"
        checkpoint_step = int(state["step"])
    ledger = state["buffer"]["ledger"]
    return FinalState(
        dict(ledger["status"]), dict(ledger["duplicates"]), int(state["learner"]["version"]), source, checkpoint_step
    )


# --------------------------------------------------------------------------- accounting by uid
@dataclass
class UidAccount:
    """Every uid a sampler committed (seen by the watcher or in the ledger), by outcome."""

    generated: set[str]
    outcome: Counter  # consumed | dropped | rejected | buffered | in_transport, and "<status>:<reason>"
    lost_uids: list[str]
    reused: dict[str, int]  # uid -> how many different contents were committed under it
    errors: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        # the injector re-sends sampler messages only byte for byte, so two contents = two groups
        return len(self.lost_uids) + sum(n - 1 for n in self.reused.values())


def account_uids(seen: dict[str, set[str]], ledger: dict[str, str], in_transport: set[str]) -> UidAccount:
    generated = {k for k in seen if SAMPLER_UID.match(k)} | {uid for uid in ledger if SAMPLER_UID.match(uid)}
    outcome: Counter[str] = Counter()
    lost_uids = []
    for uid in sorted(generated):
        status = ledger.get(uid)
        if status is not None:
            outcome[status.split(":", 1)[0]] += 1
            if status.startswith(("dropped", "rejected")):
                outcome[status] += 1
        elif uid in in_transport:
            outcome["in_transport"] += 1
        else:
            lost_uids.append(uid)
    reused = {uid: len(shas) for uid, shas in seen.items() if SAMPLER_UID.match(uid) and len(shas) > 1}
    account = UidAccount(generated, outcome, lost_uids, reused)
    unknown = sorted(
        k
        for k in set(seen) | set(ledger)
        if not k.startswith("fault-") and not SAMPLER_UID.match(k) and not LIAR_UID.match(k)
    )
    if unknown:
        account.errors.append(
            f"{len(unknown)} rollout keys match neither the sampler uid pattern nor the "
            f"injector's (e.g. {unknown[:3]}): the accounting would not cover them"
        )
    return account


# --------------------------------------------------------------------------- samplers that lie (hetero.trust)
TRUST_REASONS = (
    "unsigned",
    "unenrolled",
    "revoked",
    "bad_signature",
    "sampler_mismatch",
    "bad_logprobs",
    "bad_rewards",
    "bad_advantages",
    "unknown_prompt",
    "quarantined",
    "divergent",
    "undeclared_precision",
    "unknown_precision",
    "token_mismatch",
    "unseeded",
    "unassigned",
    "prompt_not_assigned",
    "seed_not_assigned",
    "slot_reused",
)
"""Refusals of the signature check and the trust gate: an honest group refused for one is a false
alarm (``unseeded`` too: the soak's honest samplers draw with checkable sampling when it is on). Not ``replayed``: content identical to an accepted group is refused by design and without
blame, an honest coincidence included (it shows under the run's reasons); nor ``lost_version`` and
``unverifiable_version``: groups whose version's weights the learner does not hold (a crashed
learner's, or from before a resume) cannot be checked, and are refused without blame."""


def honest_rejected(ledger: dict[str, str]) -> list[str]:
    """Honest samplers' uids refused by a trust reason, or dropped by a quarantine."""
    bad = {f"rejected:{r}" for r in TRUST_REASONS} | {"dropped:quarantined"}
    return sorted(uid for uid, status in ledger.items() if SAMPLER_UID.match(uid) and status in bad)


TOKEN_LIE_CATCH = {"other_weights": 19 / 45, "truncated": 19 / 71}
"""Of a token liar's checked lies, the share the token check refuses (p < 1: a redraw can differ from
the seed's draw only at near ties): docs/reliability.md's detection table (fp32, 2026-11-29). Every
other lie of the crew fails each of its checks (p = 1)."""
BOUND_CONFIDENCE = 0.01
"""A lie's poisoned groups are within the bound when more would happen with probability under this."""


def poison_bound(kind: str, verify_fraction: float) -> int:
    """The most groups of lie ``kind`` (a patient one's too) a learner with ``hold_unchecked`` may
    train on within docs/reliability.md's bound: 0 where each checked lie fails; for a token lie the
    least k with (1 - f p)^k <= BOUND_CONFIDENCE (the unchecked lies a later lie's passed check may
    vouch for), f = ``verify_fraction``, p its catch rate."""
    from .liars import lie_of

    p = TOKEN_LIE_CATCH.get(lie_of(kind))
    if p is None or verify_fraction <= 0:
        return 0
    return math.ceil(math.log(BOUND_CONFIDENCE) / math.log(1.0 - verify_fraction * p))


def liar_figures(
    ledger: dict[str, str], crew: dict[str, Any], run_dir: Path, verify_fraction: float = 0.1
) -> dict[str, Any]:
    """``--liars``: the lying groups that reached an optimizer step (by lie, and those beyond the
    bound, :func:`poison_bound`), how each lie's groups ended, the seconds from each liar's first
    group to its quarantine (events.jsonl), and how the honest bf16 sampler's groups ended (by
    status; its refusals count in :func:`honest_rejected`)."""
    lied: dict[str, str] = crew.get("lied", {})
    poisoned = Counter(kind for uid, kind in lied.items() if ledger.get(uid) == "consumed")
    outcomes: dict[str, Counter] = {}
    for uid, kind in lied.items():
        outcomes.setdefault(kind, Counter())[ledger.get(uid, "not read")] += 1
    first = crew.get("first_sent", {})
    quarantined_at = {e["sampler_id"]: e["time"] for e in read_events(run_dir) if e.get("event") == "quarantined"}
    from .liars import LIES, HonestBf16Sampler, liar_id

    bf16_prefix = f"s{HonestBf16Sampler.INDEX}-bf16-"
    honest_bf16 = Counter(status.split(":", 1)[0] for uid, status in ledger.items() if uid.startswith(bf16_prefix))

    to_quarantine = {
        kind: (
            round(quarantined_at[liar_id(kind)] - first[kind], 1)
            if liar_id(kind) in quarantined_at and kind in first
            else None
        )
        for kind in LIES
    }
    return {
        "poisoned_trained": sum(poisoned.values()),
        "poisoned_by_lie": dict(poisoned),
        "poisoned_beyond_bound": {kind: n for kind, n in poisoned.items() if n > poison_bound(kind, verify_fraction)},
        "bounds": {kind: poison_bound(kind, verify_fraction) for kind in poisoned},
        "sent": len(lied),
        "outcomes": {k: dict(v) for k, v in sorted(outcomes.items())},
        "seconds_to_quarantine": to_quarantine,
        "honest_bf16": dict(sorted(honest_bf16.items())),
    }


# --------------------------------------------------------------------------- the step metrics
@dataclass
class StepCheck:
    """The ledger's consumed groups against the per-step ``hetero/consumed`` metrics."""

    steps_done: int
    steps_executed: int
    consumed_by_metrics: int
    consumed_in_ledger: int
    errors: list[str] = field(default_factory=list)

    @property
    def consumed_twice(self) -> int:
        # the learner may have taken one more batch whose step was cut by the time limit
        return max(0, self.consumed_by_metrics - self.consumed_in_ledger)


def check_steps(rows: list[dict], final: FinalState, batch: int, generated: set[str]) -> StepCheck:
    """``rows``: the run's metric lines (a step past the checkpoint the ledger came from is left out)."""
    consumed_rows = [r for r in rows if "hetero/consumed" in r]
    step_rows = [r for r in consumed_rows if final.checkpoint_step is None or r["step"] <= final.checkpoint_step]
    check = StepCheck(
        steps_done=max((int(r["step"]) for r in consumed_rows), default=0),
        steps_executed=len(step_rows),
        consumed_by_metrics=int(sum(r["hetero/consumed"] for r in step_rows)),
        consumed_in_ledger=sum(1 for s in final.ledger.values() if s == "consumed"),
    )
    if consumed_rows and not generated:
        check.errors.append("the learner took steps but no sampler group was seen: the accounting saw nothing")
    if not 0 <= check.consumed_in_ledger - check.consumed_by_metrics <= batch:
        check.errors.append(
            f"ledger has {check.consumed_in_ledger} consumed groups but the step metrics count "
            f"{check.consumed_by_metrics} (batch {batch})"
        )
    bad_finite = [r["step"] for r in step_rows if not math.isfinite(r.get("actor/loss", 0.0))]
    if bad_finite:
        check.errors.append(f"non-finite loss logged at steps {bad_finite[:5]}")
    return check


# --------------------------------------------------------------------------- each fault judged
@dataclass
class RunEnd:
    """What the judges of the faults look at."""

    ledger: dict[str, str]
    in_transport: set[str]
    final_version: int
    max_delay: int
    seen_names: set[str]  # "<segment>:<actor name>" of every actor the injector saw alive
    segment_end: dict[int, float]  # segment -> when it ended (s since the start)
    segments: int
    end_s: float


def _sampler_kill(f: Fault, end: RunEnd) -> str:
    seg = f.detail["segment"]
    if f"{seg}:{f.detail['restart_name']}" in end.seen_names:
        return "survived"
    if end.segment_end.get(seg, end.end_s) - f.at < 30:
        return "not judged: run ended before the restart"
    return "NOT SURVIVED: sampler not restarted"


def _learner_crash(f: Fault, end: RunEnd) -> str:
    return "survived" if f.detail["segment"] + 1 < end.segments else "not judged: no segment after it"


def _rejected(f: Fault, end: RunEnd) -> str:
    expected = f"rejected:{BAD_REASON[f.kind]}"
    status = end.ledger.get(f.key)
    if status == expected:
        return "survived"
    if status is None and f.key in end.in_transport:
        return "not judged: not read yet"
    return f"NOT SURVIVED: ledger says {status!r}, expected {expected!r}"


def _never_accepted(f: Fault, end: RunEnd) -> str:
    return "survived" if f.key not in end.ledger else f"NOT SURVIVED: accepted as {end.ledger[f.key]!r}"


def _weights_passed(f: Fault, end: RunEnd) -> str:
    needed = f.detail["version_at_fault"] + end.max_delay + 1
    if end.final_version >= needed:
        return "survived"  # the learner kept consuming groups from newer weights
    if end.end_s - f.at < 60:
        return "not judged: run ended too soon"
    return f"NOT SURVIVED: learner stuck below version {needed}"


def _duplicate(f: Fault, end: RunEnd) -> str:
    # one status for the uid (never "duplicate"); using it twice is caught by the consumed-twice
    # check over the whole run
    if end.ledger.get(f.key) is not None or f.key in end.in_transport:
        return "survived"
    return "NOT SURVIVED: the uid vanished"


def _network(f: Fault, end: RunEnd) -> str:
    needed = (f.detail.get("version_after_fault") or 0) + end.max_delay + 1
    if end.final_version >= needed:
        return "survived"  # the learner kept training on groups from across the link
    if end.end_s - f.detail.get("ended_s", f.at) < 90:
        return "not judged: run ended too soon after it"
    return f"NOT SURVIVED: learner stuck below version {needed}"


def _clock_skew_rollout(f: Fault, end: RunEnd) -> str:
    status = end.ledger.get(f.key)
    if status is not None and not status.startswith("rejected"):
        return "survived"
    if status is None and f.key in end.in_transport:
        return "survived (still in transport)"
    if status == "rejected:future_version" and f.detail.get("segment", end.segments) + 1 < end.segments:
        # the sampler drew it with weights its segment's learner published past its last checkpoint,
        # then crashed: that version is lost, and a group claiming it is refused without blame
        return "survived (future_version: its version was lost in the learner crash that ended its segment)"
    return f"NOT SURVIVED: ledger says {status!r}"


def _judge_of(kind: str) -> Optional[Callable[[Fault, RunEnd], str]]:
    if kind in BAD_REASON:
        return _rejected
    if kind.startswith("rollout_") or kind == "duplicate_other_key":
        return _never_accepted
    if kind.startswith("weights_") or kind == "clock_skew_weights":
        return _weights_passed
    if kind in WAN_FAULT_WEIGHTS:
        return _network
    return {
        "sampler_kill": _sampler_kill,
        "learner_crash": _learner_crash,
        "duplicate_message": _duplicate,
        "clock_skew_rollout": _clock_skew_rollout,
    }.get(kind)


def judge_faults(faults: list[Fault], end: RunEnd) -> None:
    """Set each fault's ``outcome``: survived, NOT SURVIVED (why) or not judged (why)."""
    for fault in faults:
        judge = _judge_of(fault.kind)
        if judge is not None:
            fault.outcome = judge(fault, end)


# --------------------------------------------------------------------------- the summary's figures
def accounting(
    final: FinalState,
    uids: UidAccount,
    steps: StepCheck,
    temporaries: list[str],
    actor_names: set[str],
    segments: list[dict],
    leftovers: list[str],
) -> dict[str, Any]:
    """The figures :func:`research.soak.report.report` prints."""
    outcome = uids.outcome
    return {
        "ledger_source": final.source,
        "generated": len(uids.generated),
        "consumed": outcome["consumed"],
        "dropped": outcome["dropped"],
        "rejected": outcome["rejected"],
        "buffered": outcome["buffered"],
        "in_transport": outcome["in_transport"],
        "reasons": {k: v for k, v in sorted(outcome.items()) if ":" in k},
        "honest_rejected": honest_rejected(final.ledger),
        "lost_uids": uids.lost_uids[:20],
        "reused_uids": dict(sorted(uids.reused.items())[:20]),
        "uids_reused": len(uids.reused),
        "sampler_groups_rejected_future": sum(
            1 for uid in uids.generated if final.ledger.get(uid) == "rejected:future_version"
        ),
        "consumed_by_step_metrics": steps.consumed_by_metrics,
        "consumed_in_ledger_all": steps.consumed_in_ledger,
        "duplicate_arrivals": int(sum(final.duplicates.values())),
        "leftover_temporaries": len(temporaries),
        "final_policy_version": final.version,
        "sampler_restarts": sum(
            1 for n in actor_names if SAMPLER_ACTOR.match(n.split(":", 1)[1]) and not n.endswith("-0")
        ),
        "segments": segments,
        "leftover_actors_at_end": leftovers,
    }
