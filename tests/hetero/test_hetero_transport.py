"""fsspec transport, weight store, delay channel and rollout inbox; the batched reads (infos,
get_many, delete_many) on both transports."""

import itertools
import posixpath

import numpy as np
import pytest
import torch

from verl_ext.hetero.buffer import RolloutBuffer
from verl_ext.hetero.delay import make_delay_model
from verl_ext.hetero.delay_channel import DelayChannel
from verl_ext.hetero.exchange import RolloutInbox, send_group
from verl_ext.hetero.protocol import version_key
from verl_ext.hetero.transport import CorruptMessage, FsspecTransport, checksum, make_transport
from verl_ext.hetero.weights import WeightStore

from .factories import build_group

_memory_ids = itertools.count()


class FakeClock:
    """Manually advanced seconds, shared by sender and receiver in one test."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["memory", "file-url", "plain-path"])
def transport(request, tmp_path):
    if request.param == "memory":
        return FsspecTransport(f"memory://hetero-test-{next(_memory_ids)}")
    if request.param == "file-url":
        return FsspecTransport(f"file://{tmp_path}/shared")
    return FsspecTransport(str(tmp_path / "plain"))


def _data_path(transport, topic, key):
    return posixpath.join(transport.root, topic, key + ".msg")


def test_put_get_keys_delete(transport):
    assert transport.keys("rollouts") == []
    info = transport.put("rollouts", "s0-g1", b"payload-1")
    transport.put("rollouts", "s0-g0", b"payload-0")
    assert transport.keys("rollouts") == ["s0-g0", "s0-g1"]
    assert transport.get("rollouts", "s0-g1") == b"payload-1"
    assert info.size == 9 and transport.info("rollouts", "s0-g1") == info
    transport.put("rollouts", "s0-g1", b"replaced")
    assert transport.get("rollouts", "s0-g1") == b"replaced"
    transport.delete("rollouts", "s0-g1")
    transport.delete("rollouts", "never-there")
    assert transport.keys("rollouts") == ["s0-g0"]
    with pytest.raises(KeyError):
        transport.get("rollouts", "s0-g1")
    assert transport.incomplete("rollouts") == []


@pytest.mark.parametrize("bad", ["../escape", ".hidden", "a/b", "", "x" * 201, "sp ace"])
def test_bad_names_are_refused(bad):
    transport = FsspecTransport(f"memory://hetero-test-{next(_memory_ids)}")
    with pytest.raises(ValueError, match="is not a valid name"):
        transport.put("rollouts", bad, b"x")
    with pytest.raises(ValueError, match="is not a valid name"):
        transport.keys(bad)


def test_corrupted_payload_is_counted_never_returned(transport):
    transport.put("weights", "v1", b"A" * 100)
    transport.put("weights", "v2", b"B" * 100)
    transport.fs.pipe_file(_data_path(transport, "weights", "v1"), b"A" * 40)  # truncated
    transport.fs.pipe_file(_data_path(transport, "weights", "v2"), b"B" * 99 + b"C")  # bit flip
    for key in ("v1", "v2"):
        with pytest.raises(CorruptMessage, match=f"message weights/{key}"):
            transport.get("weights", key)
    assert transport.stats["corrupt"] == 2
    transport.fs.pipe_file(posixpath.join(transport.root, "weights", "v2.ok"), b"{garbage")
    with pytest.raises(CorruptMessage, match="commit marker of weights/v2 is unreadable"):
        transport.get("weights", "v2")


def test_get_with_sha256_returns_the_digest_it_verified_and_refuses_corrupt_bytes(transport):
    transport.put("weights", "v1", b"A" * 100)
    transport.put("weights", "v2", b"B" * 100)
    assert transport.get_with_sha256("weights", "v1") == (b"A" * 100, checksum(b"A" * 100))
    transport.fs.pipe_file(_data_path(transport, "weights", "v2"), b"B" * 99 + b"C")  # bit flip
    with pytest.raises(CorruptMessage, match="message weights/v2"):
        transport.get_with_sha256("weights", "v2")


def test_leftovers_of_interrupted_writes_are_invisible_and_listed(transport):
    transport.put("rollouts", "s1-done", b"ok")
    directory = posixpath.join(transport.root, "rollouts")
    # what a writer killed mid-way leaves behind: a temporary, and a renamed payload never committed
    transport.fs.pipe_file(posixpath.join(directory, ".tmp.s1-half.msg.0123"), b"partial")
    transport.fs.pipe_file(posixpath.join(directory, "s1-uncommitted.msg"), b"whole but uncommitted")
    transport.fs.pipe_file(posixpath.join(directory, ".tmp.s2-other.msg.4567"), b"another writer")
    assert transport.keys("rollouts") == ["s1-done"]
    assert transport.incomplete("rollouts") == [".tmp.s1-half.msg.0123", ".tmp.s2-other.msg.4567", "s1-uncommitted.msg"]
    assert transport.get("rollouts", "s1-done") == b"ok"


def test_make_transport_errors():
    with pytest.raises(ValueError, match="unknown transport kind='nccl'"):
        make_transport("nccl")
    with pytest.raises(ValueError, match="needs url="):
        make_transport("fsspec")


def _model_state(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))
    model[1].weight = model[0].weight  # tied embeddings share storage
    state = dict(model.state_dict())
    state["step"] = torch.tensor(seed, dtype=torch.int64)
    return state


def test_weight_store_publish_latest_get_keep_last(transport):
    store = WeightStore(transport, keep_last=2)
    assert store.latest() is None and store.latest_version() is None
    for version in range(4):
        store.publish(version, _model_state(version))
    assert store.versions() == [2, 3]
    version, state = store.latest()
    assert version == 3
    for name, tensor in _model_state(3).items():
        assert torch.equal(state[name], tensor) and state[name].dtype == tensor.dtype
    assert torch.equal(store.get(2)["1.bias"], _model_state(2)["1.bias"])
    with pytest.raises(KeyError):
        store.get(0)  # pruned
    assert store.latest(newer_than=3) is None
    with pytest.raises(ValueError, match="version=-1 must be an int >= 0"):
        store.publish(-1, {})
    with pytest.raises(ValueError, match="keep_last=0"):
        WeightStore(transport, keep_last=0)


def test_weight_store_bf16_wire_halves_bytes_and_restores_dtype(transport):
    state = {"w": torch.randn(64, 64), "ids": torch.arange(5)}
    WeightStore(transport, topic="fp32").publish(0, state)
    WeightStore(transport, topic="bf16", wire_dtype="bf16").publish(0, state)
    full, half = transport.info("fp32", version_key(0)).size, transport.info("bf16", version_key(0)).size
    assert half < 0.55 * full
    loaded = WeightStore(transport, topic="bf16").get(0)
    assert loaded["w"].dtype == torch.float32 and torch.equal(loaded["ids"], state["ids"])
    assert torch.allclose(loaded["w"], state["w"], rtol=1e-2, atol=1e-2)
    assert not torch.equal(loaded["w"], state["w"])  # really went through bf16


def test_corrupt_latest_weights_fall_back_to_previous_and_count_once(transport):
    store = WeightStore(transport, keep_last=3)
    store.publish(1, _model_state(1))
    store.publish(2, _model_state(2))
    path = _data_path(transport, "weights", version_key(2))
    data = transport.fs.cat_file(path)
    transport.fs.pipe_file(path, data[: len(data) // 2])
    for _ in range(3):  # polled repeatedly: still version 1, counted once
        version, state = store.latest()
        assert version == 1 and torch.equal(state["1.bias"], _model_state(1)["1.bias"])
    assert store.stats["corrupt"] == 1
    with pytest.raises(CorruptMessage):
        store.get(2)
    store.publish(2, _model_state(2))  # republishing repairs it
    assert store.latest()[0] == 2


def test_delay_channel_hides_messages_until_their_delay(transport):
    clock = FakeClock()
    transport.clock = clock
    model = make_delay_model("lognormal", low=60, high=1920)  # no offset: no mass pinned at low
    channels = [DelayChannel(transport, model, seed=3, stream=s, clock=clock) for s in range(3)]
    transport.put("weights", "v1", b"weights-1")
    delays = [channel.delay_for("weights", "v1") for channel in channels]
    assert all(60 <= d <= 1920 for d in delays)
    assert len(set(delays)) > 1  # each receiver draws its own delay
    assert delays[0] == DelayChannel(transport, model, seed=3, stream=0).delay_for("weights", "v1")
    for channel, delay in zip(channels, delays):
        assert channel.keys("weights") == []
        assert channel.pending("weights") == {"v1": pytest.approx(delay)}
        assert channel.metrics(["weights"]) == {
            "hetero/pending/weights": 1.0,
            "hetero/pending_s/weights": pytest.approx(delay),
        }
        with pytest.raises(KeyError, match="not visible yet"):
            channel.get("weights", "v1")
    clock.now += min(delays)
    first = int(np.argmin(delays))
    assert channels[first].get("weights", "v1") == b"weights-1"
    assert [c.keys("weights") for c in channels].count(["v1"]) == 1
    clock.now += max(delays)
    assert all(c.keys("weights") == ["v1"] for c in channels)


def test_delay_channel_receiver_timebase_topics_and_speed(transport):
    clock = FakeClock()
    transport.clock = lambda: -1e9  # a sender clock wildly skewed: receiver timebase ignores it
    model = make_delay_model("constant", value=10.0)
    channel = DelayChannel(transport, model, timebase="receiver", speed_factor=2.0, topics=["weights"], clock=clock)
    transport.put("weights", "v1", b"w")
    transport.put("rollouts", "g1", b"r")
    assert channel.keys("rollouts") == ["g1"]  # not a delayed topic
    assert channel.keys("weights") == []  # first seen now, visible 20 s later
    clock.now += 19.9
    assert channel.keys("weights") == []
    clock.now += 0.2
    assert channel.keys("weights") == ["v1"]
    with pytest.raises(ValueError, match="timebase='wall'"):
        DelayChannel(transport, model, timebase="wall")


def test_weight_store_through_delay_channel_sees_versions_late(transport):
    clock = FakeClock()
    transport.clock = clock
    learner = WeightStore(transport, keep_last=5)
    sampler_view = WeightStore(
        DelayChannel(transport, make_delay_model("constant", value=30.0), clock=clock), keep_last=5
    )
    learner.publish(0, _model_state(0))
    clock.now += 10
    learner.publish(1, _model_state(1))
    clock.now += 25  # v0 is 35 s old, v1 only 25 s
    assert sampler_view.latest()[0] == 0
    clock.now += 5
    assert sampler_view.latest()[0] == 1


def test_rollout_inbox_exactly_once_across_a_learner_crash(transport):
    for i in range(6):
        send_group(transport, build_group(f"s0-g{i}", version=0))
    transport.put("rollouts", "s0-junk", b"not a rollout")
    buffer = RolloutBuffer(max_delay=2)
    inbox = RolloutInbox(transport, buffer)
    assert inbox.poll(max_groups=4) == 4
    consumed = [g.group_uid for g in buffer.take(3, 0)]
    checkpoint = buffer.state_dict()  # saved; 1 group still buffered
    assert inbox.acknowledge(checkpoint) == 4  # those 4 are now safe in the checkpoint
    assert inbox.poll() == 2  # the rest arrive after the checkpoint...
    consumed += [g.group_uid for g in buffer.take(2, 1)]
    assert inbox.stats["corrupt"] == 1
    # ...and the learner dies before the next checkpoint: resume from the saved one
    resumed = RolloutBuffer(max_delay=2)
    resumed.load_state_dict(checkpoint)
    consumed_before_crash = consumed[:3]
    resumed_inbox = RolloutInbox(transport, resumed)
    assert resumed_inbox.poll() == 2  # unacknowledged messages are read again
    after = [g.group_uid for g in resumed.take(3, 1)]
    assert sorted(consumed_before_crash + after) == [f"s0-g{i}" for i in range(6)]
    assert resumed_inbox.poll() == 0  # nothing twice
    assert resumed_inbox.metrics()["hetero/inbox_corrupt"] == 1
    bad_uid = build_group("s0 g7", version=0)
    with pytest.raises(ValueError, match="group_uid='s0 g7' is not a valid name"):
        send_group(transport, bad_uid)


def test_the_inbox_remembers_only_the_messages_it_refused(transport):
    """Its set of handled (key, checksum) pairs is what keeps a refused or unreadable message from
    being read again; a buffered group is skipped by its ledger status instead, so its entry goes
    at the next listing: over a long run the set holds the refusals, not every group."""
    for i in range(5):
        send_group(transport, build_group(f"s0-g{i}", version=0))
    transport.put("rollouts", "s0-junk", b"not a rollout")
    buffer = RolloutBuffer(max_delay=2)
    inbox = RolloutInbox(transport, buffer)
    assert inbox.poll() == 5 and len(inbox._processed) == 6
    assert inbox.poll() == 0  # nothing read twice...
    assert {key for key, _ in inbox._processed} == {"s0-junk"}  # ...and only the junk remembered
    assert inbox.stats["corrupt"] == 1  # not re-read, not re-counted
    assert len(buffer.take(5, 0)) == 5 and inbox.poll() == 0


def test_the_inbox_validates_each_group_once_on_its_way_through_a_gate(monkeypatch):
    """With a gate the inbox validates a group (its named reasons come before the gate's) and the
    buffer does not validate it again; without one the buffer validates. validate_group is
    wrapped (counting, then the real function) where both modules call it; buffer and inbox are real."""
    import verl_ext.hetero.buffer as buffer_module
    import verl_ext.hetero.exchange as exchange_module
    from verl_ext.hetero.records import validate_group

    calls = []

    def counting(group, *args, **kwargs):
        calls.append(group.group_uid)
        return validate_group(group, *args, **kwargs)

    monkeypatch.setattr(exchange_module, "validate_group", counting)
    monkeypatch.setattr(buffer_module, "validate_group", counting)

    class Gate:  # vouches for g0 only; records what the inbox tells it
        def __init__(self):
            self.admitted, self.accepted_as = [], {}

        def admit(self, group):
            self.admitted.append(group.group_uid)
            return group.group_uid == "s0-g0"

        def accepted(self, group, vouched=False):
            self.accepted_as[group.group_uid] = vouched

        def withholds(self, vouched):
            return False

        def malformed(self, refusal):  # only a signed record is blamed: these are unsigned
            raise AssertionError(f"blamed an unsigned record: {refusal}")

    def send_all(transport):
        for i in range(3):
            send_group(transport, build_group(f"s0-g{i}", version=0))
        bad = build_group("s0-bad", version=0)
        bad.sampler_logprobs = -bad.sampler_logprobs + 1  # positive: not log-probabilities
        send_group(transport, bad)

    gated = FsspecTransport(f"memory://hetero-test-{next(_memory_ids)}")
    send_all(gated)
    buffer, gate = RolloutBuffer(max_delay=2), Gate()
    assert RolloutInbox(gated, buffer, gate=gate).poll() == 3
    assert sorted(calls) == ["s0-bad", "s0-g0", "s0-g1", "s0-g2"]  # once each
    assert buffer.ledger.status["s0-bad"] == "rejected:positive_logprob" and "s0-bad" not in gate.admitted
    assert gate.accepted_as == {"s0-g0": True, "s0-g1": False, "s0-g2": False}

    calls.clear()
    plain = FsspecTransport(f"memory://hetero-test-{next(_memory_ids)}")
    send_all(plain)
    ungated = RolloutBuffer(max_delay=2)
    assert RolloutInbox(plain, ungated).poll() == 3
    assert sorted(calls) == ["s0-bad", "s0-g0", "s0-g1", "s0-g2"]  # by the buffer, once each
    assert ungated.ledger.status["s0-bad"] == "rejected:positive_logprob"


@pytest.fixture(scope="module")
def ray_transport():
    import ray

    from verl_ext.hetero.transport import RayTransport

    ray.init(num_cpus=1, include_dashboard=False, namespace="hetero-transport-many", log_to_driver=False)
    transport = RayTransport("heterorl-test-many")
    yield transport
    transport.shutdown()
    ray.shutdown()


def _check_batched_reads(transport):
    """infos / get_many / delete_many answer as info / get / delete one by one would."""
    for key in ("a", "b", "c"):
        transport.put("rollouts", key, key.encode() * 10)
    infos = transport.infos("rollouts")
    assert [i.key for i in infos] == ["a", "b", "c"]
    assert [i.sha256 for i in infos] == [transport.info("rollouts", k).sha256 for k in "abc"]
    got = transport.get_many("rollouts", ["c", "missing", "a"])
    assert got["c"] == b"c" * 10 and got["a"] == b"a" * 10
    assert isinstance(got["missing"], KeyError)
    transport.delete_many("rollouts", ["a", "c", "missing"])
    assert transport.keys("rollouts") == ["b"]
    transport.delete("rollouts", "b")


def test_batched_reads_fsspec(transport):
    _check_batched_reads(transport)


def test_batched_reads_ray(ray_transport):
    _check_batched_reads(ray_transport)
    # a committed payload that no longer matches its checksum comes back as CorruptMessage
    import ray

    info = ray_transport.put("rollouts", "x", b"good bytes")
    ray.get(ray_transport._mailbox.put_ref.remote(info, [ray.put(b"evil bytes")]))
    before = ray_transport.stats["corrupt"]
    assert isinstance(ray_transport.get_many("rollouts", ["x"])["x"], CorruptMessage)
    assert ray_transport.stats["corrupt"] == before + 1
    ray_transport.delete("rollouts", "x")


def test_a_listing_reads_each_commit_marker_once_until_it_is_rewritten(transport):
    for k in range(20):
        transport.put("rollouts", f"g{k:02d}", bytes([k]) * 100)
    first = transport.infos("rollouts")
    reads = transport.stats["marker_reads"]
    assert [i.key for i in first] == [f"g{k:02d}" for k in range(20)] and reads >= 20
    assert transport.infos("rollouts") == first and transport.stats["marker_reads"] == reads  # no round trip each
    transport.put("rollouts", "g03", b"rewritten, another size")
    transport.delete("rollouts", "g07")
    again = {i.key: i for i in transport.infos("rollouts")}
    assert "g07" not in again and again["g03"].sha256 == checksum(b"rewritten, another size")
    assert transport.stats["marker_reads"] == reads + 1
