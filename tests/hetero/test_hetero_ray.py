"""Ray object-store transport, weights and the rollout inbox over it (real Ray, 2 CPUs)."""

import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from verl_ext.hetero.buffer import RolloutBuffer
from verl_ext.hetero.delay import make_delay_model
from verl_ext.hetero.delay_channel import DelayChannel
from verl_ext.hetero.exchange import RolloutInbox, send_group
from verl_ext.hetero.records import RolloutGroup
from verl_ext.hetero.transport import CorruptMessage, RayTransport
from verl_ext.hetero.weights import WeightStore

from .factories import build_group

TESTS_DIR = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ray_cluster():
    # workers import this module (actor classes, factories) as package "hetero" under tests/
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        namespace="hetero-tests",
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": f"{TESTS_DIR}:{TESTS_DIR.parent}"}},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def transport(ray_cluster):
    """One mailbox actor for the module (actor start-up costs seconds on 2 shared cores)."""
    mailbox = RayTransport(name="hetero-test-mailbox")
    yield mailbox
    mailbox.shutdown()


@pytest.fixture(scope="module")
def samplers(ray_cluster):
    actors = [Sampler.remote() for _ in range(2)]
    yield actors
    for actor in actors:
        ray.kill(actor)


@ray.remote(num_cpus=0)
class Sampler:
    """A sampler process: sends groups through a transport."""

    def send(self, transport, uids, version):
        for uid in uids:
            send_group(transport, build_group(uid, version, sampler=uid.split("-")[0]))
        return len(uids)


def test_ray_transport_checksum_is_verified(transport):
    info = transport.put("weights", "v1", b"good bytes")
    # overwrite the stored reference with different bytes under the old checksum
    ray.get(transport._mailbox.put_ref.remote(info, [ray.put(b"evil bytes")]))
    with pytest.raises(CorruptMessage, match="message weights/v1"):
        transport.get("weights", "v1")
    assert transport.stats["corrupt"] == 1
    transport.delete("weights", "v1")


def test_weight_store_over_ray(transport):
    store = WeightStore(transport, keep_last=2, wire_dtype="bf16", topic="weights-bf16")
    for version in range(3):
        store.publish(version, {"w": torch.full((4, 4), float(version)), "b": torch.zeros(4)})
    version, state = store.latest()
    assert version == 2 and store.versions() == [1, 2]
    assert state["w"].dtype == torch.float32 and torch.equal(state["w"], torch.full((4, 4), 2.0))


def test_pipelined_writes_apply_in_order_and_stay_bounded(transport):
    """put_nowait / delete_many_nowait return before the mailbox confirms; this process's later
    reads still see them (the mailbox runs a caller's calls in order), at most MAX_PENDING are in
    flight, and after flush another handle sees them too."""
    for i in range(10):
        transport.put_nowait("pipe", f"k{i:02d}", bytes([i]) * 1000)
        assert len(transport._pending) <= RayTransport.MAX_PENDING
    assert transport.get("pipe", "k09") == bytes([9]) * 1000  # ordered after the writes
    transport.delete_many_nowait("pipe", [f"k{i:02d}" for i in range(5)])
    transport.flush()
    assert transport._pending == []
    assert RayTransport(name="hetero-test-mailbox").keys("pipe") == [f"k{i:02d}" for i in range(5, 10)]
    transport.delete_many("pipe", transport.keys("pipe"))


def test_pipelined_weight_store_prunes_as_the_waiting_one(transport):
    """The learner's pipelined store lists once (an earlier run's versions and deltas are pruned
    too) and then prunes from what it published: after flush the same versions and deltas remain
    as with the store that waits, and a sampler's store loads the newest bit-exactly."""
    state = lambda v: {"w": torch.full((4, 4), float(v)) + torch.arange(16.0).reshape(4, 4) * 1e-3, "b": torch.zeros(4)}
    left = {}
    for topic, pipelined in (("pipe-w0", False), ("pipe-w1", True)):
        WeightStore(transport, keep_last=3, topic=topic, delta=True).publish(0, state(0))  # an earlier run's
        store = WeightStore(transport, keep_last=3, topic=topic, delta=True, pipelined=pipelined)
        for version in range(1, 9):
            store.publish(version, state(version))
        store.flush()
        left[pipelined] = (store.versions(), store.delta_versions())
        version, loaded = WeightStore(RayTransport(name="hetero-test-mailbox"), topic=topic).latest()
        assert version == 8 and torch.equal(loaded["w"], state(8)["w"])
    assert left[True] == left[False] == ([6, 7, 8], [6, 7, 8])


def test_delay_channel_lists_a_topic_in_one_call(transport):
    """Over the Ray mailbox, a sampler lists the weights topic on every poll; with a message's info fetched one by one
    that cost a round trip per kept version (78 at a 5 s delay in bench_async). Now keys(),
    infos() and pending() make one listing of the inner transport and no per-key calls."""
    calls = Counter()
    inner_info, inner_infos = transport.info, transport.infos
    transport.info = lambda topic, key: calls.update(["info"]) or inner_info(topic, key)
    transport.infos = lambda topic: calls.update(["infos"]) or inner_infos(topic)
    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    transport.clock = clock
    channel = DelayChannel(transport, make_delay_model("constant", value=5.0), clock=clock)
    for v in range(40):
        transport.put("channel-weights", f"v{v:03d}", b"w")
        now[0] += 0.25
    calls.clear()
    visible = channel.keys("channel-weights")
    assert visible == [f"v{v:03d}" for v in range(21)]  # sent at least 5 s ago
    assert [i.key for i in channel.infos("channel-weights")] == visible
    assert len(channel.pending("channel-weights")) == 19
    assert calls == Counter(infos=3)
    del transport.info, transport.infos
    transport.clock = time.time
    transport.delete_many("channel-weights", transport.keys("channel-weights"))


def test_inbox_over_ray_transport(transport, samplers):
    ray.get([s.send.remote(transport, [f"s{i}-g{j}" for j in range(3)], 0) for i, s in enumerate(samplers)])
    buffer = RolloutBuffer(max_delay=0)
    inbox = RolloutInbox(transport, buffer)
    assert inbox.poll() == 6
    assert sorted(g.group_uid for g in buffer.take(6, 0)) == sorted(f"s{i}-g{j}" for i in range(2) for j in range(3))
    assert inbox.acknowledge(buffer.state_dict()) == 6 and transport.keys("rollouts") == []


def test_ray_transport_round_trip_and_outlives_the_sender(transport, samplers):
    # last in the module: it kills one of the shared sampler actors
    sampler = samplers[-1]
    assert ray.get(sampler.send.remote(transport, ["s0-g0", "s0-g1"], 0)) == 2
    ray.kill(sampler)  # the process that put the objects is gone; the mailbox owns them
    assert transport.keys("rollouts") == ["s0-g0", "s0-g1"]
    group = RolloutGroup.from_bytes(transport.get("rollouts", "s0-g1"))
    assert group.group_uid == "s0-g1"
    np.testing.assert_array_equal(group.rewards, build_group("s0-g1", 0).rewards)
    assert transport.info("rollouts", "s0-g0").size == len(build_group("s0-g0", 0).to_bytes())
    transport.delete("rollouts", "s0-g0")
    assert RayTransport(name="hetero-test-mailbox").keys("rollouts") == ["s0-g1"]  # same named mailbox
    with pytest.raises(KeyError):
        transport.get("rollouts", "s0-g0")
    transport.delete("rollouts", "s0-g1")
