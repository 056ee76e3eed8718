"""The loop every sampler runs, whatever generates its groups: one copy of claim, delay, sign, send.

:class:`SamplerLoop` is the base of the embedded engine's sampler (HF ``generate``) and of the
verl engine's sampler pools (verl's rollout servers and agent loop). Each batch: load the newest
weights its delayed weight store lets it see, wait while they are past the staleness bound
(``skip_stale``) or the learner's queue is full (``max_queued_groups``), claim batch b on the
exchange (a restart resumes after it), generate, stretch the time by ``speed_factor``, sign and send
every group (prompts and, under checkable sampling, Gumbel seeds as the learner assigns them:
:mod:`verl_ext.trust.assignment`). A learner that resumed from a checkpoint deletes the versions it had published past
it: a sampler holding one of those loads the newest left instead of waiting to be overtaken (its
groups would be refused as ``future_version`` until then). A subclass supplies :meth:`load_weights`
and :meth:`generate_batch`.
"""

from __future__ import annotations

import time
from typing import Any

from verl_ext.hetero.exchange import send_group
from verl_ext.hetero.protocol import (
    CONTROL_TOPIC,
    STATUS_KEY,
    LearnerStatus,
    claim_batch,
    read_gumbel_key,
    read_record,
    stop_requested,
    version_key,
)
from verl_ext.hetero.records import RolloutGroup
from verl_ext.hetero.transport import Transport
from verl_ext.hetero.weights import WeightStore
from verl_ext.trust.signing import SamplerKey


class SamplerLoop:
    """Generates rollout groups with the newest weights its delay lets it see, until told to stop."""

    WAIT_POLL_S = 0.1
    """Seconds between checks while waiting for newer weights or for room in the learner's queue."""

    WEIGHT_STATS = {
        "full_loads": "weight_full_loads",
        "delta_loads": "weight_delta_loads",
        "bytes_fetched": "weight_bytes_fetched",
        "delta_fallbacks": "weight_delta_fallbacks",
        "delta_larger": "weight_delta_larger",
    }
    """Weight store counter -> sampler stat: which path each load took (hetero.weight_sync)."""

    def init_loop(
        self,
        transport: Transport,
        weights: WeightStore,
        sampler_id: str,
        launch: str,
        *,
        max_delay: int,
        skip_stale: bool,
        max_queued_groups: int,
        keep_weight_versions: int,
        speed_factor: float = 1.0,
        key: SamplerKey | None = None,
        checkable: bool = False,
    ) -> None:
        """``weights``: the store it fetches through (a delay channel over ``transport``);
        ``launch``: this launch's uid namespace (a restart never reuses a group uid); ``checkable``:
        it draws by seeded Gumbel-max, so it waits for the learner's seed key (:attr:`gumbel_key`)."""
        self.transport, self.weights, self.sampler_id, self.launch = transport, weights, sampler_id, launch
        self.max_delay, self.skip_stale, self.max_queued_groups = max_delay, skip_stale, max_queued_groups
        self.speed_factor, self.key, self.checkable = speed_factor, key, checkable
        self.gumbel_key: bytes | None = None  # the learner's, read with each new version (checkable)
        self._waiting_since: float | None = None  # start-up: since when it waits for the learner
        self._published_at: float | None = None  # when the learner published the version held here
        self._told_silent = False  # said that the learner's status is overdue (once per silence)
        self._told_waiting = False
        # what exists, undelayed: only the version numbers are read from it, never the weights
        self.published = WeightStore(transport, keep_last=keep_weight_versions)
        self.version = -1
        self.stats: dict[str, Any] = {
            "batches": 0,
            "groups": 0,
            "tokens": 0,
            "gen_s": 0.0,
            "weight_loads": 0,
            "stale_wait_s": 0.0,
            "queue_wait_s": 0.0,
            "learner_silent_pauses": 0,
            "lost_version_reloads": 0,
            **{k: 0 for k in self.WEIGHT_STATS.values()},
        }

    # ---- what a subclass supplies ----------------------------------------------------------
    def load_weights(self, version: int, state: dict) -> None:
        """Put ``state`` (HF-named CPU tensors of ``version``) into the generator."""
        raise NotImplementedError

    def generate_batch(self, batch_index: int) -> list[RolloutGroup]:
        """The groups of batch ``batch_index``, generated with the loaded version (``self.version``)."""
        raise NotImplementedError

    # ---- the loop --------------------------------------------------------------------------
    def _refresh_weights(self) -> int | None:
        """Load the newest version this sampler may see; returns the newest published one (read once:
        :meth:`weights_too_stale` judges by it too)."""
        published = self.published.latest_version()
        # the learner resumed behind the version held here: that version is lost (a crashed learner's
        # branch), and groups made with it would be refused until the learner is past it
        lost = published is not None and published < self.version
        newest = self.weights.latest(newer_than=self.version if self.version >= 0 and not lost else None)
        if newest is not None and lost:
            self.stats["lost_version_reloads"] += 1
        if newest is not None:
            version, state = newest
            self.load_weights(version, state)
            self.version = version
            self.stats["weight_loads"] += 1
            self._published_at = self._publish_time(version)
            self.on_weights_loaded(version)
        if self.checkable and (newest is not None or self.gumbel_key is None):
            # written before the learner's first version; re-read with each version (a learner that
            # resumed keeps its secret, so its key is the same)
            self.gumbel_key = read_gumbel_key(self.transport) or self.gumbel_key
        for counter, stat in self.WEIGHT_STATS.items():
            self.stats[stat] = self.weights.stats[counter]
        return published

    def _publish_time(self, version: int) -> float | None:
        """When the learner committed ``version`` (its clock, from the message's metadata)."""
        try:
            return self.published.transport.info(self.published.topic, version_key(version)).sent_at
        except KeyError:  # pruned meanwhile
            return None

    def version_age_s(self) -> float | None:
        """Seconds since the learner published the version held here (wall clocks of both: on
        different machines, as close as they are synchronised); None before the first load."""
        return None if self._published_at is None else time.time() - self._published_at

    def on_batch_sent(self, batch_index: int, groups: list[RolloutGroup]) -> None:
        """Called after a batch's groups went out; a subclass reports progress here."""

    def on_weights_loaded(self, version: int) -> None:
        """Called after ``version`` was loaded (:meth:`version_age_s` says how long after its publish)."""

    STARTUP_NOTICE_S = 60.0
    """After this long without the learner's first version (or seed key), the sampler says what it waits for."""

    def _say_once_if_waiting_long(self) -> None:
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
        if self._told_waiting or time.monotonic() - self._waiting_since < self.STARTUP_NOTICE_S:
            return
        self._told_waiting = True
        missing = "first weight version" if self.version < 0 else "Gumbel seed key (control/gumbel-key)"
        hint = (
            ""
            if self.version < 0
            else ": the learner writes it only with hetero.trust.checkable_sampling=true; give the sampler the learner's overrides"
        )
        print(
            f"[{self.sampler_id}] waiting {self.STARTUP_NOTICE_S:.0f} s for the learner's {missing}{hint}", flush=True
        )

    def weights_too_stale(self, published: int | None) -> bool:
        """Groups made now would be past the bound on arrival, ``published`` being the newest
        version the learner has published (the learner only moves forward)."""
        return self.skip_stale and published is not None and published - self.version > self.max_delay

    def learner_queue_full(self) -> bool:
        """Back-pressure: the learner's last published queue depth is at ``max_queued_groups``,
        or the learner promised to refresh its status and went silent (crashed, or cut off: what
        it would train on when back is unknown, and groups made meanwhile pile up on the exchange)."""
        if self.max_queued_groups <= 0:
            return False
        status = read_record(self.transport, LearnerStatus, CONTROL_TOPIC, STATUS_KEY)
        if status is None:
            return False
        now = time.time()
        silent = status.silent_s(now)
        if silent > 0 and not self._told_silent:
            print(f"[{self.sampler_id}] the learner's status is {now - status.written_at:.0f} s old (it promised one "
                  f"every {status.refresh_s:.0f} s): pausing until it writes again", flush=True)  # fmt: skip
            self.stats["learner_silent_pauses"] += 1
        self._told_silent = silent > 0
        return silent > 0 or status.queue_depth >= self.max_queued_groups

    def stopped(self) -> bool:
        return stop_requested(self.transport)

    def public_key(self) -> str | None:
        """The public half of this sampler's signing key (hex), or None when it does not sign."""
        return None if self.key is None else self.key.public_hex()

    def send(self, group: RolloutGroup) -> None:
        """Publish one group (signed when the sampler has a key). The soak's lying samplers
        (research/soak/liars.py) change the group here."""
        send_group(self.transport, group, key=self.key)

    def run(self, start_batch: int = 0, max_batches: int | None = None) -> dict[str, Any]:
        """Generate until the stop marker appears (or ``max_batches``); returns the counters."""
        batch_index = start_batch
        while not self.stopped() and (max_batches is None or batch_index - start_batch < max_batches):
            published = self._refresh_weights()
            if self.version < 0 or (self.checkable and self.gumbel_key is None):
                time.sleep(0.05)  # the learner has not published version 0 (or its seed key) yet
                self._say_once_if_waiting_long()
                continue
            # wait for newer weights rather than generate groups to drop; for room in the queue
            wait = "stale_wait_s" if self.weights_too_stale(published) else None
            if wait is None and self.learner_queue_full():
                wait = "queue_wait_s"
            if wait is not None:
                # each check is a few round trips to the exchange: 10 a second, not 20
                t0 = time.perf_counter()
                time.sleep(self.WAIT_POLL_S)
                self.stats[wait] += time.perf_counter() - t0
                continue
            # claimed before its prompts are drawn: a restart resumes after it
            claim_batch(self.transport, self.sampler_id, self.launch, batch_index)
            t0 = time.perf_counter()
            groups = self.generate_batch(batch_index)
            gen_s = time.perf_counter() - t0
            if self.speed_factor > 1:
                time.sleep(gen_s * (self.speed_factor - 1))  # slower hardware: same work takes longer
            for group in groups:
                self.send(group)
            self.on_batch_sent(batch_index, groups)
            self.stats["batches"] += 1
            self.stats["groups"] += len(groups)
            self.stats["tokens"] += sum(int(g.response_mask.sum()) for g in groups)
            self.stats["gen_s"] += gen_s
            batch_index += 1
        return dict(self.stats, next_batch=batch_index)

    def counters(self) -> dict[str, Any]:
        return dict(self.stats)
