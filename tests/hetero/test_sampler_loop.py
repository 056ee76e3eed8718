"""verl_ext.hetero.sampler_loop.SamplerLoop, the loop both engines' samplers run: a sampler drawing
by checkable sampling waits for the learner's seed key (and says so once), then uses it."""

from __future__ import annotations

import threading
import time
import uuid

import torch

from verl_ext.hetero.protocol import TransportSpec, publish_gumbel_key
from verl_ext.hetero.sampler_loop import SamplerLoop
from verl_ext.hetero.weights import WeightStore


class Batches(SamplerLoop):
    """A loop whose batches are empty: what it waits for and what it loads is all there is."""

    STARTUP_NOTICE_S = 0.2

    def __init__(self, transport, checkable: bool):
        self.init_loop(
            transport, WeightStore(transport), "sampler-3", "l0", max_delay=2, skip_stale=True,
            max_queued_groups=0, keep_weight_versions=2, checkable=checkable,
        )  # fmt: skip
        self.keys_used = []

    def load_weights(self, version: int, state: dict) -> None:
        pass

    def generate_batch(self, batch_index: int) -> list:
        self.keys_used.append(self.gumbel_key)
        return []


def _exchange():
    transport = TransportSpec("fsspec", url=f"memory://sampler-loop-{uuid.uuid4().hex}").open()
    WeightStore(transport).publish(0, {"w": torch.zeros(2)})
    return transport


def test_a_checkable_sampler_waits_for_the_seed_key_and_says_so_once(capsys):
    transport = _exchange()
    loop = Batches(transport, checkable=True)
    runner = threading.Thread(target=loop.run, kwargs={"max_batches": 2})
    runner.start()
    time.sleep(0.6)
    assert loop.version == 0 and loop.stats["batches"] == 0  # version 0 is there, the key is not
    key = bytes(range(32))
    publish_gumbel_key(transport, key)
    runner.join(timeout=10)
    assert not runner.is_alive() and loop.keys_used == [key, key]
    said = capsys.readouterr().out
    assert said.count("waiting") == 1 and "Gumbel seed key" in said and "checkable_sampling=true" in said


def test_a_sampler_without_checkable_sampling_needs_no_key():
    loop = Batches(_exchange(), checkable=False)
    assert loop.run(max_batches=1)["batches"] == 1 and loop.keys_used == [None]


def test_a_sampler_knows_how_long_ago_the_version_it_sends_with_was_published():
    transport = _exchange()  # version 0, committed now

    class Reporting(Batches):
        def on_batch_sent(self, batch_index, groups):
            self.reported = (batch_index, self.version, self.version_age_s())

    loop = Reporting(transport, checkable=False)
    assert loop.version_age_s() is None  # nothing loaded yet
    time.sleep(0.3)
    loop.run(max_batches=1)
    batch, version, age = loop.reported
    assert (batch, version) == (0, 0) and 0.3 <= age < 5


def test_a_sampler_pauses_while_a_learner_that_promised_to_refresh_its_status_is_silent(capsys):
    from verl_ext.hetero.protocol import CONTROL_TOPIC, STATUS_KEY, LearnerStatus

    transport = _exchange()
    loop = Batches(transport, checkable=False)
    loop.max_queued_groups = 8

    def status(written_ago_s, refresh_s=5.0, depth=0):
        record = LearnerStatus(0, depth, refresh_s=refresh_s, written_at=time.time() - written_ago_s)
        transport.put(CONTROL_TOPIC, STATUS_KEY, record.to_bytes())

    status(2.0)
    assert not loop.learner_queue_full()  # it keeps its word
    status(2.0, depth=8)
    assert loop.learner_queue_full()  # a full queue, as before
    status(31.0)  # three refreshes and 15 s overdue: crashed, or cut off
    assert loop.learner_queue_full() and loop.learner_queue_full()
    assert (
        capsys.readouterr().out.count("s old (it promised one every 5 s)") == 1
        and loop.stats["learner_silent_pauses"] == 1
    )
    status(3600.0, refresh_s=0.0)  # promised nothing (the embedded learner writes after steps only)
    assert not loop.learner_queue_full()
    # a record from before the fields existed still reads
    transport.put(CONTROL_TOPIC, STATUS_KEY, b'{"version": 0, "queue_depth": 9}')
    assert loop.learner_queue_full()
