"""The thread that injects the soak's faults into a live run (see ``research/soak/__main__.py``)."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Optional

import ray

from .faults import (
    BAD_GROUP_EDITS,
    SAMPLER_ACTOR,
    SAMPLER_UID,
    WAN_FAULT_WEIGHTS,
    ExchangeDamage,
    Fault,
    fault_weights,
)
from .wan_link import WanLink
from verl_ext.trust.signing import SamplerKey, unverified_record
from verl_ext.hetero.exchange import send_group
from verl_ext.hetero.protocol import (
    LEARNER_ACTOR,
    ROLLOUT_TOPIC,
    WEIGHTS_TOPIC,
    parse_version_key,
    sampler_actor_name,
    version_key,
)
from verl_ext.hetero.records import RolloutGroup
from verl_ext.hetero.transport import FsspecTransport, RayTransport, Transport
from verl_ext.rundir import latest_checkpoint_step


class Injector(threading.Thread):
    """Injects one random fault every ``mean_interval`` seconds (exponential gaps) while a run
    segment is on (``in_run``), until stopped; kills the learner at ``learner_crashes`` random
    times once the run directory ``run_dir`` has a checkpoint (setting ``crash_flag`` first)."""

    def __init__(
        self,
        transport: Transport,
        exchange: Path,
        run_dir: Path,
        seed: int,
        t0: float,
        duration: float,
        mean_interval: float,
        learner_crashes: int,
        save_freq: int,
        wan: Optional[WanLink] = None,
        key: Optional[SamplerKey] = None,
    ):
        super().__init__(daemon=True, name="soak-injector")
        self.transport, self.exchange, self.run_dir, self.wan = transport, exchange, run_dir, wan
        self.key = (
            key  # enrolled (hetero.trust.enrolment_file): its bad groups meet validation, not the signature check
        )
        self.fault_weights = fault_weights(wan is not None)
        self.rng = random.Random(seed * 7919 + 1)
        self.damage = ExchangeDamage(exchange, self.rng)
        self.t0, self.mean_interval, self.save_freq = t0, mean_interval, save_freq
        self.crash_times = sorted(self.rng.uniform(0.3, 0.75) * duration for _ in range(learner_crashes))
        self.in_run, self.crash_flag = threading.Event(), threading.Event()
        self.faults: list[Fault] = []
        self.errors: list[str] = []
        self.actor_names: set[str] = set()  # "<segment>:<name>" of every actor ever seen alive
        self.segment = 0
        self.counter = 0
        self.learner_handle = None
        self._handle_at = 0.0
        self._next_at = 0.0
        self._halt = threading.Event()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)

    # -- the schedule
    def run(self) -> None:
        self._next_at = self.now() + self.rng.expovariate(1.0 / self.mean_interval)
        while not self._halt.is_set():
            time.sleep(0.2)
            self._named_actors()
            if not self.in_run.is_set():
                continue
            try:
                self._tick()
            except Exception as err:  # noqa: BLE001 - an injector bug must not look like a survived fault
                self.errors.append(f"injector: {type(err).__name__}: {err}")

    def _tick(self) -> None:
        """Inject what is due: a scheduled learner crash first, else the next random fault."""
        if self.crash_times and self.now() >= self.crash_times[0] and self._checkpoint_step() >= self.save_freq:
            self.crash_times.pop(0)
            self._record(self.inject("learner_crash"))
            return
        if self.now() < self._next_at:
            return
        self._next_at = self.now() + self.rng.expovariate(1.0 / self.mean_interval)
        kinds, weights = zip(*self.fault_weights.items())
        self._record(self.inject(self.rng.choices(kinds, weights)[0]))

    def _record(self, fault: Optional[Fault]) -> None:
        if fault is not None:
            self.faults.append(fault)

    def _checkpoint_step(self) -> int:
        return latest_checkpoint_step(self.run_dir)

    # -- what the run looks like now
    def _named_actors(self) -> list[str]:
        try:
            names = list(ray.util.list_named_actors())
        except Exception:  # noqa: BLE001 - Ray busy or shutting down: try again next tick
            return []
        self.actor_names.update(f"{self.segment}:{n}" for n in names)
        if LEARNER_ACTOR in names and time.monotonic() - self._handle_at > 1.0:
            # holding a handle keeps the learner actor alive after run() returns, so the final
            # ledger can be read from it (Ray reclaims an actor once no handle is left)
            try:
                self.learner_handle = ray.get_actor(LEARNER_ACTOR)
                self._handle_at = time.monotonic()
            except ValueError:
                pass
        return names

    def _template(self) -> Optional[RolloutGroup]:
        """A group some sampler committed, read back (a model for the injected ones)."""
        keys = [k for k in self.transport.keys(ROLLOUT_TOPIC) if SAMPLER_UID.match(k)]
        self.rng.shuffle(keys)
        for key in keys[:10]:
            try:
                return RolloutGroup.from_bytes(unverified_record(self.transport.get(ROLLOUT_TOPIC, key)))
            except (KeyError, ValueError):
                continue  # acknowledged (deleted) meanwhile
        return None

    def _latest_weights(self) -> Optional[int]:
        versions = [v for v in map(parse_version_key, self.transport.keys(WEIGHTS_TOPIC)) if v is not None]
        return max(versions) if versions else None

    def _fault_key(self, kind: str) -> str:
        self.counter += 1
        return f"fault-{kind.replace('_', '')}-{self.counter}"

    def _skewed(self, skew: float) -> Transport:
        """A second handle on the exchange whose sender clock is ``skew`` seconds off."""
        if self.wan is None:
            return FsspecTransport(str(self.exchange), clock=lambda: time.time() + skew)
        return RayTransport(
            self.transport.name,
            self.transport.namespace,
            clock=lambda: time.time() + skew,
            resources=self.transport.resources,
        )

    # -- the faults; each returns None when there was nothing to inject it into
    def inject(self, kind: str) -> Optional[Fault]:
        fault = Fault(kind, self.now())
        if kind in WAN_FAULT_WEIGHTS:
            return self._network(fault)
        if kind == "sampler_kill":
            return self._kill_sampler(fault)
        if kind == "learner_crash":
            return self._crash_learner(fault)
        if kind.startswith("weights_") or kind == "clock_skew_weights":
            return self._weights_fault(fault)
        template = self._template()
        if template is None:
            return None
        if kind.startswith("rollout_"):
            return self._damage_rollout(fault, template)
        if kind == "duplicate_message":
            return self._duplicate(fault, template)
        if kind == "duplicate_other_key":
            return self._duplicate_other_key(fault, template)
        return self._send_edited(fault, template)

    def _network(self, fault: Fault) -> Fault:
        fault.detail = {"version_at_fault": self._latest_weights()}
        fault.detail.update(self.wan.inject(fault.kind, self.rng))
        fault.detail["version_after_fault"] = self._latest_weights()
        fault.detail["ended_s"] = round(self.now(), 1)
        return fault

    def _kill_sampler(self, fault: Fault) -> Optional[Fault]:
        names = [n for n in self._named_actors() if SAMPLER_ACTOR.match(n)]
        if not names:
            return None
        name = self.rng.choice(names)
        try:
            ray.kill(ray.get_actor(name))
        except ValueError:
            return None  # already gone
        index, incarnation = SAMPLER_ACTOR.match(name).groups()
        fault.key = name
        fault.detail = {"segment": self.segment, "restart_name": sampler_actor_name(int(index), int(incarnation) + 1)}
        return fault

    def _crash_learner(self, fault: Fault) -> Optional[Fault]:
        try:
            learner = ray.get_actor(LEARNER_ACTOR)
        except ValueError:
            return None
        self.crash_flag.set()
        ray.kill(learner)
        fault.key = LEARNER_ACTOR
        fault.detail = {"segment": self.segment}
        return fault

    def _weights_fault(self, fault: Fault) -> Optional[Fault]:
        latest = self._latest_weights()
        if latest is None:
            return None
        fault.detail = {"version_at_fault": latest}
        if fault.kind == "clock_skew_weights":
            return self._skew_weights(fault, latest)
        # a version the learner has not published yet (it replaces it when it gets there)
        key = version_key(latest + 3)
        try:
            payload = self.transport.get(WEIGHTS_TOPIC, version_key(latest))
        except (KeyError, ValueError):
            return None
        fault.key = key
        damage = fault.kind.removeprefix("weights_")
        fault.detail.update(self.damage.write(WEIGHTS_TOPIC, key, payload, damage, self.counter))
        return fault

    def _skew_weights(self, fault: Fault, latest: int) -> Optional[Fault]:
        """The newest weights re-sent with a sender clock minutes off."""
        key = version_key(latest)
        try:
            payload = self.transport.get(WEIGHTS_TOPIC, key)
        except (KeyError, ValueError):
            return None
        skew = self.rng.choice([-1, 1]) * self.rng.uniform(60, 600)
        self._skewed(skew).put(WEIGHTS_TOPIC, key, payload)
        fault.key, fault.detail["skew_s"] = key, round(skew, 1)
        return fault

    def _damage_rollout(self, fault: Fault, template: RolloutGroup) -> Fault:
        fault.key = self._fault_key(fault.kind)
        damage = fault.kind.removeprefix("rollout_")
        fault.detail.update(self.damage.write(ROLLOUT_TOPIC, fault.key, template.to_bytes(), damage, self.counter))
        return fault

    def _duplicate(self, fault: Fault, template: RolloutGroup) -> Optional[Fault]:
        """The very message a sampler committed, sent again (same bytes, new commit marker)."""
        try:
            original = self.transport.get(ROLLOUT_TOPIC, template.group_uid)
        except (KeyError, ValueError):
            return None
        self.transport.put(ROLLOUT_TOPIC, template.group_uid, original)
        fault.key = template.group_uid
        return fault

    def _duplicate_other_key(self, fault: Fault, template: RolloutGroup) -> Optional[Fault]:
        """A sampler's committed message, signature and all, under another key."""
        try:
            original = self.transport.get(ROLLOUT_TOPIC, template.group_uid)
        except (KeyError, ValueError):
            return None
        key = self._fault_key(fault.kind)
        self.transport.put(ROLLOUT_TOPIC, key, original)
        fault.key, fault.detail["uid"] = key, template.group_uid
        return fault

    def _send_edited(self, fault: Fault, group: RolloutGroup) -> Optional[Fault]:
        """``group`` under a new uid, edited to be rejected (``bad_*``, ``future_version``) and
        signed by the enrolled injector; or a sampler's own signed message sent again under its
        uid by a transport whose clock is minutes off (``clock_skew_rollout``: a valid record, which
        a new uid or the injector's name would not be)."""
        if fault.kind == "clock_skew_rollout":
            try:
                original = self.transport.get(ROLLOUT_TOPIC, group.group_uid)
            except (KeyError, ValueError):
                return None
            skew = self.rng.choice([-1, 1]) * self.rng.uniform(60, 3600)
            self._skewed(skew).put(ROLLOUT_TOPIC, group.group_uid, original)
            fault.key, fault.detail["skew_s"] = group.group_uid, round(skew, 1)
            fault.detail["segment"] = self.segment  # a learner crash ending it may lose the group's version
            return fault
        key = self._fault_key(fault.kind)
        group.group_uid, group.sampler_id = key, "soak-injector"
        fault.key = key
        if fault.kind == "future_version":
            group.policy_version = (self._latest_weights() or 0) + 1000
        elif fault.kind in BAD_GROUP_EDITS:
            BAD_GROUP_EDITS[fault.kind](group)
        else:
            raise ValueError(f"unknown fault kind {fault.kind!r}")
        send_group(self.transport, group, key=self.key)
        return fault
