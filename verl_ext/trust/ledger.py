"""Trust in samplers, earned by checks (:mod:`verl_ext.trust.verifier`'s); this module keeps the books.

- **draw**: every group of a sampler on probation (its first ``probation_groups`` checks), then each
  with probability ``verify_fraction``, by an HMAC of the group under a secret only the learner holds
  (``os.urandom``, kept in :meth:`state_dict`): no sampler can predict which groups are checked;
- **trust**: a score in [0, 1] per sampler id, 1 at start; a failed check subtracts ``penalty``, a
  passed one adds ``recovery`` (capped at 1). Below ``quarantine_below`` the sampler is quarantined
  for the rest of the run, across resumes: later records are refused (``quarantined``), and the groups
  accepted since its last passed check go to ``drop`` (``trust/purged``: those actually dropped);
- **vouching**: a passed check vouches for the sampler's unchecked groups that arrived before it;
- **divergence** (``max_divergence`` > 0): while the mean KL(sampler || learner) of a sampler's last
  ``divergence_window`` consumed groups (:func:`verl_ext.algos.diagnostics.sampler_learner_kl`, as
  ``is/kl_sampler_learner``) is over the bound, its groups are refused (``divergent``).
Events: :meth:`drain_events`; ``trust/`` scalars: :meth:`metrics`. Evidence: docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

QUARANTINED, DIVERGENT = "quarantined", "divergent"


@dataclass
class SamplerTrust:
    """One sampler's books."""

    score: float = 1.0
    checks: int = 0
    failures: int = 0
    quarantined_at: float | None = None
    first_seen: float | None = None
    # (arrival number, uid) of its unchecked groups accepted and not vouched for by a passed check since
    since_good_check: list[tuple[int, str]] = field(default_factory=list)
    divergence: deque = field(default_factory=deque)  # the last groups' measured divergence
    over_divergence: bool = False


class TrustLedger:
    """Per-sampler trust (see module docstring). Thread-safe use: one caller at a time (the
    inbox's poll thread checks, the learner thread reports divergence; the source serialises)."""

    # The ranges of the arguments, written once: the constructor and ``hetero.trust``'s
    # validation (recipe.gepo.sections.TrustConfig, which names its hydra keys) both check them here.
    RANGES: dict[str, tuple[str, Callable[[float], bool]]] = {
        "verify_fraction": ("in [0, 1]", lambda v: 0.0 <= v <= 1.0),
        "probation_groups": (">= 0", lambda v: v >= 0),
        "penalty": (">= 0", lambda v: v >= 0),
        "recovery": (">= 0", lambda v: v >= 0),
        "quarantine_below": ("in [0, 1]", lambda v: 0.0 <= v <= 1.0),
        "max_divergence": (">= 0 (0 = off)", lambda v: v >= 0),
        "divergence_window": (">= 1", lambda v: v >= 1),
    }

    @classmethod
    def check_arguments(cls, arguments: dict[str, float], names: dict[str, str] | None = None) -> None:
        """Raise ValueError naming the first of ``arguments`` (constructor argument -> value) out of
        its range, and its value; under ``names[argument]`` (e.g. the hydra key) when given. NaN
        is out of every range."""
        for argument, value in arguments.items():
            what, ok = cls.RANGES[argument]
            if not ok(value):
                raise ValueError(f"{(names or {}).get(argument, argument)}={value!r} must be {what}")

    def __init__(
        self,
        verify_fraction: float = 0.1,
        probation_groups: int = 4,
        penalty: float = 1.0,
        recovery: float = 0.05,
        quarantine_below: float = 0.5,
        max_divergence: float = 0.0,
        divergence_window: int = 8,
        secret: bytes | None = None,
    ):
        self.check_arguments(
            {
                "verify_fraction": verify_fraction,
                "probation_groups": probation_groups,
                "penalty": penalty,
                "recovery": recovery,
                "quarantine_below": quarantine_below,
                "max_divergence": max_divergence,
                "divergence_window": divergence_window,
            }
        )
        self.verify_fraction, self.probation_groups = float(verify_fraction), int(probation_groups)
        self.penalty, self.recovery, self.quarantine_below = float(penalty), float(recovery), float(quarantine_below)
        self.max_divergence, self.divergence_window = float(max_divergence), int(divergence_window)
        self.secret = os.urandom(32) if secret is None else bytes(secret)  # the draw's key: never leaves the learner
        self.samplers: dict[str, SamplerTrust] = {}
        self.counts: Counter[str] = Counter()  # checked, failed:<reason>, purged, refused:<reason>
        self._events: list[dict] = []

    def _of(self, sampler_id: str) -> SamplerTrust:
        books = self.samplers.get(sampler_id)
        if books is None:
            books = self.samplers[sampler_id] = SamplerTrust(first_seen=time.time())
        return books

    # ---------------------------------------------------------------- admission
    def refusal(self, sampler_id: str) -> str | None:
        """Why this sampler's next group is refused before any check (``quarantined``,
        ``divergent``), or None."""
        books = self._of(sampler_id)
        if books.quarantined_at is not None:
            return QUARANTINED
        if books.over_divergence:
            return DIVERGENT
        return None

    def should_check(self, sampler_id: str, key: str, fraction: float | None = None) -> bool:
        """Check this group? Always while the sampler is on probation, else with probability
        ``fraction`` (default ``verify_fraction``): HMAC-SHA256(secret, ``key``) read as a uniform
        number, ``key`` naming the group (its uid and content). The same group always draws the
        same way at one fraction, and is drawn at every larger one."""
        if self._of(sampler_id).checks < self.probation_groups:
            return True
        digest = hmac.new(self.secret, f"{sampler_id}\x00{key}".encode(), hashlib.sha256).digest()
        return int.from_bytes(digest[:8], "big") / 2.0**64 < (self.verify_fraction if fraction is None else fraction)

    def accepted(self, sampler_id: str, uid: str, arrival: int = 0) -> None:
        """An unchecked group of this sampler entered the buffer: vouched for by a passed check of a
        group that arrived after it (``arrival``: the caller's order of arrivals), purged if a check
        quarantines the sampler first."""
        self._of(sampler_id).since_good_check.append((int(arrival), uid))

    def record(
        self,
        sampler_id: str,
        uid: str,
        passed: bool,
        reason: str = "",
        detail: str = "",
        drop: Callable[[list[str]], int] | None = None,
        arrival: int | None = None,
        release: Callable[[list[str]], int] | None = None,
    ) -> list[str]:
        """The outcome of one check of the group that arrived ``arrival``-th (None: after all).
        Passed: the sampler's unchecked groups that arrived before it are vouched for and go to
        ``release`` (e.g. the buffer's ``vouch``); returns []. Quarantining: returns the uids to
        purge, every unchecked group not vouched for; ``drop`` (e.g. the buffer's ``purge``) is
        called with them and returns how many it actually dropped: only those count as
        ``trust/purged`` (a step may already have trained on the others; the event gives both
        numbers). Without ``drop`` nothing was dropped, and nothing is counted."""
        books = self._of(sampler_id)
        books.checks += 1
        self.counts["checked"] += 1
        if passed:
            books.score = min(1.0, books.score + self.recovery)
            vouched = [uid for n, uid in books.since_good_check if arrival is None or n < arrival]
            books.since_good_check = [
                (n, uid) for n, uid in books.since_good_check if not (arrival is None or n < arrival)
            ]
            if release is not None and vouched:
                self.counts["vouched"] += int(release(vouched))
            return []
        books.failures += 1
        books.score = max(0.0, books.score - self.penalty)
        self.counts[f"failed:{reason}"] += 1
        if books.quarantined_at is not None or books.score >= self.quarantine_below:
            return []
        books.quarantined_at = time.time()
        purge = [uid for _, uid in books.since_good_check]
        books.since_good_check = []
        dropped = int(drop(purge)) if drop is not None and purge else 0
        self.counts["purged"] += dropped
        self._events.append(
            {
                "event": "quarantined",
                "sampler_id": sampler_id,
                "group_uid": uid,
                "reason": reason,
                "detail": detail,
                "score": books.score,
                "checks": books.checks,
                "failures": books.failures,
                "purged": dropped,
                "unchecked_since_last_pass": len(purge),
                "seconds_since_first_group": books.quarantined_at - (books.first_seen or books.quarantined_at),
                "time": books.quarantined_at,
            }
        )
        return purge

    def withdraw_credit(self, sampler_id: str) -> None:
        """Take back what one passed check earned this sampler (its ``recovery`` and the check's
        place in its probation): the checked group turned out to be a copy, or copied. Not a
        failure: it quarantines nobody by itself."""
        books = self._of(sampler_id)
        books.score = max(0.0, books.score - self.recovery)
        books.checks = max(0, books.checks - 1)
        self.counts["withdrawn"] += 1

    def refused(self, reason: str) -> None:
        self.counts[f"refused:{reason}"] += 1

    # ---------------------------------------------------------------- divergence
    def observe_divergence(self, sampler_id: str, value: float) -> None:
        """A consumed group's measured divergence (its ``is/kl_sampler_learner``-style k3 KL estimate,
        :func:`recipe.gepo.embedded.learner.group_divergence`)."""
        if self.max_divergence <= 0:
            return
        books = self._of(sampler_id)
        books.divergence.append(float(value))
        while len(books.divergence) > self.divergence_window:
            books.divergence.popleft()
        over = float(np.mean(books.divergence)) > self.max_divergence
        if over != books.over_divergence:
            books.over_divergence = over
            self._events.append(
                {
                    "event": "divergence_over_bound" if over else "divergence_back_under_bound",
                    "sampler_id": sampler_id,
                    "divergence": float(np.mean(books.divergence)),
                    "bound": self.max_divergence,
                    "time": time.time(),
                }
            )

    # ---------------------------------------------------------------- reporting
    def drain_events(self) -> list[dict]:
        events, self._events = self._events, []
        return events

    def metrics(self) -> dict[str, float]:
        """``trust/checked``, ``trust/failed[/<reason>]``, ``trust/refused[/<reason>]``,
        ``trust/purged``, ``trust/vouched`` (withheld groups a passed check released),
        ``trust/withdrawn`` (checks whose credit was taken back: copies),
        ``trust/quarantined`` (run totals); per sampler
        ``trust/<sampler id>/score`` and, with a divergence bound, ``trust/<sampler id>/divergence``."""
        out = {
            "trust/checked": float(self.counts["checked"]),
            "trust/purged": float(self.counts["purged"]),
            "trust/vouched": float(self.counts["vouched"]),
            "trust/withdrawn": float(self.counts["withdrawn"]),
            "trust/quarantined": float(sum(b.quarantined_at is not None for b in self.samplers.values())),
        }
        for kind in ("failed", "refused"):
            out[f"trust/{kind}"] = float(sum(v for k, v in self.counts.items() if k.startswith(f"{kind}:")))
            out.update(
                {f"trust/{k.replace(':', '/')}": float(v) for k, v in self.counts.items() if k.startswith(f"{kind}:")}
            )
        for sampler_id, books in self.samplers.items():
            out[f"trust/{sampler_id}/score"] = books.score
            if self.max_divergence > 0 and books.divergence:
                out[f"trust/{sampler_id}/divergence"] = float(np.mean(books.divergence))
        return out

    def state_dict(self) -> dict:
        return {
            "counts": dict(self.counts),
            "secret": self.secret.hex(),
            "samplers": {
                s: {
                    "score": b.score,
                    "checks": b.checks,
                    "failures": b.failures,
                    "quarantined_at": b.quarantined_at,
                    "divergence": list(b.divergence),
                    "over_divergence": b.over_divergence,
                    "since_good_check": [list(entry) for entry in b.since_good_check],
                }
                for s, b in self.samplers.items()
            },
        }

    def load_state_dict(self, state: dict) -> None:
        self.counts = Counter(state["counts"])
        if "secret" in state:  # a checkpoint from before the secret keeps this ledger's new one
            self.secret = bytes.fromhex(state["secret"])
        self.samplers = {}
        for sampler_id, books in state["samplers"].items():
            self.samplers[sampler_id] = SamplerTrust(
                score=books["score"],
                checks=books["checks"],
                failures=books["failures"],
                quarantined_at=books["quarantined_at"],
                divergence=deque(books["divergence"]),
                over_divergence=books["over_divergence"],
                first_seen=time.time(),
                # the buffer is restored with them; a bare uid (older checkpoints) arrived first
                since_good_check=[
                    (0, entry) if isinstance(entry, str) else (int(entry[0]), str(entry[1]))
                    for entry in books["since_good_check"]
                ],
            )
