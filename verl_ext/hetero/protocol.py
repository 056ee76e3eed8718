"""The async wire protocol, in one place: every topic, control key and control record. Learner and samplers
(and the soak's fault injector) talk only through a :class:`~.transport.Transport`; ``(topic, key) -> bytes``::

    weights        version_key(v)         safetensors state dict of version v, learner -> samplers
    weights_delta  version_key(v)         XOR delta from v-1 to v (hetero.weight_sync=delta)
    rollouts       the group uid          RolloutGroup bytes, sampler -> learner
    expected       the group uid          Announcement: a group being generated (stale_policy=wait)
    control        stop                   anything: every sampler stops (driver / learner)
    control        learner-status         LearnerStatus, after every learner step
    control        progress_key(sampler)  SamplerProgress: the batch index a sampler claimed
    control        gumbel-key             GumbelKey: the key of the assigned Gumbel seeds (learner)
On Ray the learner actor is :data:`LEARNER_ACTOR`, sampler i's n-th launch :func:`sampler_actor_name`.
Records are small JSON objects; a reader that finds one missing, half-written or malformed treats
it as absent (:func:`read_record` returns None) instead of stalling on it.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Optional, TypeVar

from verl_ext.hetero.transport import CorruptMessage, Transport

WEIGHTS_TOPIC = "weights"
DELTA_SUFFIX = "_delta"
ROLLOUT_TOPIC = "rollouts"
EXPECTED_TOPIC = "expected"
CONTROL_TOPIC = "control"
REISSUE_TOPIC = "reissue"
STOP_KEY = "stop"
STATUS_KEY = "learner-status"
GUMBEL_KEY = "gumbel-key"

# Ray actor names (async mode on Ray): an operator, or a fault injector, finds the actors by them
LEARNER_ACTOR = "heterorl-learner"
SAMPLER_ACTOR_PREFIX = "heterorl-sampler-"


def sampler_actor_name(index: int, launch: int) -> str:
    """Name of the ``launch``-th incarnation (0 = first) of sampler ``index``."""
    return f"{SAMPLER_ACTOR_PREFIX}{index}-{launch}"


def version_key(version: int) -> str:
    """Transport key of weight version ``version`` (weights and delta topics); zero-padded so
    lexical order is numeric order."""
    return f"v{version:010d}"


def parse_version_key(key: str) -> Optional[int]:
    """The version of a :func:`version_key` key, or None for any other key."""
    if len(key) == 11 and key[0] == "v" and key[1:].isdigit():
        return int(key[1:])
    return None


def delta_topic(topic: str) -> str:
    """Topic of the delta messages of weights topic ``topic`` (same keys: :func:`version_key`)."""
    return topic + DELTA_SUFFIX


WEIGHTS_DELTA_TOPIC = delta_topic(WEIGHTS_TOPIC)


@dataclass(frozen=True)
class TransportSpec:
    """How every process reaches the shared exchange (picklable, sent to every actor).

    ``kind="ray"``: a named Ray mailbox actor ``name``; ``kind="fsspec"``: the folder/URL ``url``."""

    kind: str
    """ray | fsspec."""
    url: str = ""
    """fsspec: folder or URL shared by learner and samplers."""
    name: str = ""
    """ray: name of the mailbox actor."""
    resources: tuple[tuple[str, float], ...] = ()
    """ray: custom resources of the mailbox actor (placement: the learner's node), as pairs."""

    def open(self) -> Transport:
        from verl_ext.hetero.transport import make_transport

        if self.kind == "fsspec":
            return make_transport("fsspec", url=self.url)
        if self.kind == "ray":
            return make_transport("ray", name=self.name, resources=dict(self.resources))
        raise ValueError(f"TransportSpec.kind={self.kind!r}; expected 'ray' or 'fsspec'")


R = TypeVar("R", bound="_Record")


class _Record:
    """JSON encoding shared by the control records."""

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls: type[R], data: bytes) -> R:
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError(f"{cls.__name__}: expected a JSON object, got {type(raw).__name__}")
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = required - set(raw)
        if missing:
            raise ValueError(f"{cls.__name__}: missing fields {sorted(missing)}")
        return cls(**{k: raw[k] for k in names if k in raw})


@dataclass(frozen=True)
class LearnerStatus(_Record):
    """What the learner publishes after every step (``control/learner-status``)."""

    version: int
    """The learner's policy version (optimizer steps taken)."""
    queue_depth: int
    """Groups waiting in its buffer; samplers pause while it is >= ``hetero.max_queued_groups``."""
    refresh_s: float = 0.0
    """The learner rewrites this record at least this often (0: only after steps)."""
    written_at: float = 0.0
    """The learner's wall clock when it wrote this record."""

    def silent_s(self, now: float) -> float:
        """How long past its promised refresh the learner is silent (0 while it keeps its word, or
        promised nothing): a learner that crashed, or whose link is cut, writes no more. Generous
        (three refreshes and 15 s), since samplers' and learner's clocks differ a little."""
        if self.refresh_s <= 0:
            return 0.0
        return max(0.0, now - self.written_at - 3 * self.refresh_s - 15.0)


@dataclass(frozen=True)
class Announcement(_Record):
    """A group a sampler has started generating (``expected/<uid>``): under
    ``stale_policy=wait`` the learner does not step past the version that would make it stale
    before it arrives (or ``hetero.wait_timeout_s`` passes)."""

    policy_version: int
    """The weight version generating the group."""
    sampler_id: str
    """Who generates it (named in the learner's timeout error)."""


@dataclass(frozen=True)
class SamplerProgress(_Record):
    """How far a sampler launch has gone (``control/progress-<sampler id>``), written before it
    draws a batch's prompts: a restarted sampler starts at ``next_batch``, so it draws new prompts
    and never reuses a batch index of the launch before it."""

    launch: str
    """The launch's uid namespace (a fresh one per launch)."""
    next_batch: int
    """The first batch index this launch has not claimed."""


@dataclass(frozen=True)
class Reissue(_Record):
    """A prompt given back to the samplers (``reissue/<sampler id>.<dropped group uid>``): its
    group went stale before the learner could train it, so the addressed sampler puts the prompt
    in its next batch instead of one of its own draws (the verl engine's pools)."""

    prompt_ids: list
    """The prompt's token ids, as the dropped group carried them."""
    tries: int
    """How many times the prompt has been given back, this time included."""


def reissues_for(transport: Transport, sampler_id: str) -> list[tuple[str, Reissue]]:
    """The prompts given back to ``sampler_id``, oldest key first; malformed ones deleted."""
    out = []
    for key in transport.keys(REISSUE_TOPIC):
        if key.startswith(f"{sampler_id}."):
            record = read_record(transport, Reissue, REISSUE_TOPIC, key)
            if (
                record is None
                or not isinstance(record.prompt_ids, list)
                or not all(isinstance(t, int) for t in record.prompt_ids)
            ):
                transport.delete(REISSUE_TOPIC, key)
                continue
            out.append((key, record))
    return out


@dataclass(frozen=True)
class GumbelKey(_Record):
    """The key samplers derive each group's Gumbel seed from (``control/gumbel-key``,
    :func:`verl_ext.trust.assignment.assigned_seed`), written by the learner before its first version."""

    key: str
    """32 bytes, hex."""


def publish_gumbel_key(transport: Transport, key: bytes) -> None:
    transport.put(CONTROL_TOPIC, GUMBEL_KEY, GumbelKey(bytes(key).hex()).to_bytes())


def read_gumbel_key(transport: Transport) -> Optional[bytes]:
    """The learner's published seed key, or None while there is none (or it does not parse)."""
    record = read_record(transport, GumbelKey, CONTROL_TOPIC, GUMBEL_KEY)
    try:
        return None if record is None else bytes.fromhex(record.key)
    except (TypeError, ValueError):
        return None


def progress_key(sampler_id: str) -> str:
    return f"progress-{sampler_id}"


def claim_batch(transport: Transport, sampler_id: str, launch: str, batch_index: int) -> None:
    """Record that ``launch`` of ``sampler_id`` draws batch ``batch_index`` (before it does)."""
    record = SamplerProgress(str(launch), int(batch_index) + 1)
    transport.put(CONTROL_TOPIC, progress_key(sampler_id), record.to_bytes())


def sampler_progress(transport: Transport, sampler_id: str) -> Optional[SamplerProgress]:
    """The last :class:`SamplerProgress` of ``sampler_id`` on this exchange, or None."""
    return read_record(transport, SamplerProgress, CONTROL_TOPIC, progress_key(sampler_id))


def read_record(transport: Transport, cls: type[R], topic: str, key: str) -> Optional[R]:
    """The record at (topic, key), or None if it is absent, being rewritten or malformed."""
    try:
        return cls.from_bytes(transport.get(topic, key))
    except (KeyError, CorruptMessage, ValueError, TypeError):
        return None


def publish_status(transport: Transport, status: LearnerStatus, wait: bool = True) -> None:
    """The learner's status; ``wait=False``: a pipelined write (:meth:`Transport.put_nowait`)."""
    (transport.put if wait else transport.put_nowait)(CONTROL_TOPIC, STATUS_KEY, status.to_bytes())


def request_stop(transport: Transport) -> None:
    """Tell every sampler on this exchange to stop after its current batch."""
    transport.put(CONTROL_TOPIC, STOP_KEY, b"stop")


def stop_requested(transport: Transport) -> bool:
    return STOP_KEY in transport.keys(CONTROL_TOPIC)


def clear_stop(transport: Transport) -> None:
    """A new run on a used exchange: the previous run's stop marker is not for us."""
    if stop_requested(transport):
        transport.delete(CONTROL_TOPIC, STOP_KEY)


def clear_topic(transport: Transport, topic: str, prefix: str = "") -> int:
    """Delete every message of ``topic`` (whose key starts with ``prefix``); returns how many."""
    keys = [key for key in transport.keys(topic) if key.startswith(prefix)]
    for key in keys:
        transport.delete(topic, key)
    return len(keys)


def announce(transport: Transport, uid: str, policy_version: int, sampler_id: str) -> None:
    transport.put(EXPECTED_TOPIC, uid, Announcement(int(policy_version), str(sampler_id)).to_bytes())
