"""A transport wrapper that makes each message visible only after a drawn delay.

:class:`DelayChannel` is itself a :class:`~verl_ext.hetero.transport.Transport`, so a
:class:`~verl_ext.hetero.weights.WeightStore` or the rollout helpers run over it unchanged. Typical
use: each sampler wraps the shared transport around the weights topic (``stream`` = its index,
``speed_factor`` = its relative slowness), so it sees each new version after its own delay.

Delays are in seconds of ``clock`` (injectable: tests advance it by hand), drawn by the run's one
rule (:class:`~verl_ext.hetero.delay.DelaySchedule`): a weight version's delay depends only on
(seed, version, stream), any other message's on (seed, topic and key, stream), never on when or
how often the receiver polls. Counted from ``timebase="sender"``: the sender's commit time
(``MessageInfo.sent_at``; exact, but assumes the clocks agree), or ``timebase="receiver"``: the
first time this channel saw the message committed (immune to clock skew; up to one poll late).
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Callable, Iterable

import numpy as np

from verl_ext.hetero.delay import DelayModel, DelaySchedule
from verl_ext.hetero.protocol import WEIGHTS_DELTA_TOPIC, WEIGHTS_TOPIC, parse_version_key
from verl_ext.hetero.transport import MessageInfo, Transport, check_name

TIMEBASES = ("sender", "receiver")


def message_index(topic: str, key: str) -> int:
    """The :class:`DelaySchedule` key of a message: a weight version's number (so version v is
    delayed as in replay mode and the verl engine; its delta, ``weights_delta``, exactly like it),
    else 64 bits of SHA-256 of ``topic/key``."""
    if topic in (WEIGHTS_TOPIC, WEIGHTS_DELTA_TOPIC):
        version = parse_version_key(key)
        if version is not None:
            return version
    return int.from_bytes(hashlib.sha256(f"{topic}/{key}".encode()).digest()[:8], "little")


class DelayChannel(Transport):
    """Delay visibility of the messages of ``transport``.

    Args:
        transport: the real transport; writes pass straight through.
        delay_model: draws delays in seconds.
        seed: root seed of the delay draws.
        stream: this receiver's delay stream (:mod:`verl_ext.hetero.seeding`: sampler i is
            ``sampler_stream(i)``): receivers with different streams draw independent delays for
            the same message.
        speed_factor: multiplies every delay (> 0; 2.0 = this receiver is twice as far/slow).
        topics: topics to delay; others are visible at once. None = every topic.
        timebase: ``"sender"`` or ``"receiver"`` (see module docstring).
        clock: seconds; must be comparable with the sender transport's clock for ``"sender"``.
    """

    def __init__(
        self,
        transport: Transport,
        delay_model: DelayModel,
        seed: int = 0,
        stream: int = 0,
        speed_factor: float = 1.0,
        topics: Iterable[str] | None = None,
        timebase: str = "sender",
        clock: Callable[[], float] = time.time,
    ):
        super().__init__(clock)
        if timebase not in TIMEBASES:
            raise ValueError(f"DelayChannel: timebase={timebase!r} must be one of {TIMEBASES}")
        if not (np.isfinite(speed_factor) and speed_factor > 0):
            raise ValueError(f"DelayChannel: speed_factor={speed_factor} must be finite and > 0")
        if stream < 0:
            raise ValueError(f"DelayChannel: stream={stream} must be >= 0")
        self.inner, self.delay_model = transport, delay_model
        self.schedule = DelaySchedule(delay_model, seed)
        self.seed, self.stream, self.speed_factor, self.timebase = int(seed), int(stream), float(speed_factor), timebase
        self.topics = None if topics is None else frozenset(check_name("topic", t) for t in topics)
        self._lock = threading.Lock()
        self._visible_at: dict[tuple[str, str, str], float] = {}  # (topic, key, sha256) -> clock time
        self.stats = transport.stats  # corrupt/put/get counters are the inner transport's

    def delay_for(self, topic: str, key: str) -> float:
        """The delay (seconds, speed factor applied) this channel gives message (topic, key)."""
        if self.topics is not None and topic not in self.topics:
            return 0.0
        return self.schedule.delay(message_index(topic, key), self.stream, self.speed_factor)

    def visible_at(self, topic: str, key: str) -> float:
        """Clock time at which a committed message becomes visible here (KeyError if it is
        not committed)."""
        return self._visible_at_info(self.inner.info(topic, key))

    def _visible_at_info(self, info: MessageInfo) -> float:
        mark = (info.topic, info.key, info.sha256)
        with self._lock:
            if mark not in self._visible_at:
                base = info.sent_at if self.timebase == "sender" else self.clock()
                self._visible_at[mark] = base + self.delay_for(info.topic, info.key)
            return self._visible_at[mark]

    def _is_visible(self, topic: str, key: str, now: float) -> bool:
        try:
            return self.visible_at(topic, key) <= now
        except KeyError:  # deleted between listing and checking
            return False

    def infos(self, topic: str) -> list[MessageInfo]:
        """Metadata of the committed messages whose delay has elapsed, sorted by key: one listing
        of the inner transport (a sampler lists the weights topic on every poll; one round trip
        per kept version made the sampler's polls cost more the longer the delay)."""
        now = self.clock()
        return [info for info in self.inner.infos(topic) if self._visible_at_info(info) <= now]

    def keys(self, topic: str) -> list[str]:
        """Committed keys whose delay has elapsed."""
        return [info.key for info in self.infos(topic)]

    def pending(self, topic: str) -> dict[str, float]:
        """Committed but not yet visible keys -> seconds until visible."""
        now = self.clock()
        out = {}
        for info in self.inner.infos(topic):
            remaining = self._visible_at_info(info) - now
            if remaining > 0:
                out[info.key] = remaining
        return out

    def info(self, topic: str, key: str) -> MessageInfo:
        if not self._is_visible(topic, key, self.clock()):
            raise KeyError(f"{topic}/{key} is not visible yet (or not committed)")
        return self.inner.info(topic, key)

    def _read(self, topic: str, key: str) -> tuple[MessageInfo, bytes]:
        if not self._is_visible(topic, key, self.clock()):
            raise KeyError(f"{topic}/{key} is not visible yet (or not committed)")
        return self.inner._read(topic, key)

    def put(self, topic: str, key: str, data: bytes) -> MessageInfo:
        return self.inner.put(topic, key, data)

    def delete(self, topic: str, key: str) -> None:
        self.inner.delete(topic, key)
        with self._lock:
            for mark in [m for m in self._visible_at if m[0] == topic and m[1] == key]:
                del self._visible_at[mark]

    def metrics(self, topics: Iterable[str]) -> dict[str, float]:
        """``hetero/pending/<topic>``: messages committed but still hidden by their delay, and
        ``hetero/pending_s/<topic>``: the longest remaining wait among them (seconds)."""
        out = {}
        for topic in topics:
            remaining = self.pending(topic)
            out[f"hetero/pending/{topic}"] = float(len(remaining))
            out[f"hetero/pending_s/{topic}"] = float(max(remaining.values(), default=0.0))
        return out
