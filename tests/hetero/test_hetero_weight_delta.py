"""Weight deltas (``WeightStore(delta=True)``, ``hetero.weight_sync=delta``): a fetcher reaches
the newest version through XOR deltas when it is few versions behind, else through the full
version, and gets the same bits either way; DelayChannel delays delta n exactly like version n."""

import itertools
import subprocess
import sys

import numpy as np
import pytest
import torch

from verl_ext.hetero.delay import make_delay_model
from verl_ext.hetero.delay_channel import DelayChannel, message_index
from verl_ext.hetero.protocol import WEIGHTS_DELTA_TOPIC, WEIGHTS_TOPIC, delta_topic, parse_version_key, version_key
from verl_ext.hetero.transport import FsspecTransport
from verl_ext.hetero.weights import (
    WeightStore,
    apply_delta,
    decode_xor,
    encode_delta,
    encode_xor,
    floating_bits,
    wire_tensors,
)

from .test_hetero_transport import FakeClock, _data_path

_memory_ids = itertools.count()


@pytest.fixture(params=["memory", "file-url"])
def transport(request, tmp_path):
    if request.param == "memory":
        return FsspecTransport(f"memory://hetero-delta-test-{next(_memory_ids)}")
    return FsspecTransport(f"file://{tmp_path}/shared")


def _versions(n: int, lr: float = 1e-4, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """State dicts of versions 0..n-1 of a small model, each one AdamW step after the previous
    (a tied weight, an int buffer that changes, a bool buffer that does not)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 50))
    model[2].weight = model[0].weight  # tied: two names, one storage
    model.register_buffer("steps", torch.tensor(0, dtype=torch.int64))
    model.register_buffer("mask", torch.ones(7, dtype=torch.bool))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    out = []
    for _ in range(n):
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        ids = torch.randint(0, 50, (8, 6))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(ids).reshape(-1, 50), ids.roll(-1, 1).reshape(-1)).backward()
        opt.step()
        model.steps += 1
    return out


def _assert_bit_equal(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        # bit patterns, not values: -0.0 vs 0.0 or a NaN payload would differ here
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), want[name].reshape(-1).view(torch.uint8)), name


def test_xor_encoding_round_trips_and_refuses_other_shapes():
    states = _versions(2)
    base, new = floating_bits(states[0], "bf16"), floating_bits(states[1], "bf16")
    assert base.dtype == np.uint8 and base.size == 2 * sum(
        t.numel() for t in states[0].values() if t.is_floating_point()
    )
    assert np.array_equal(decode_xor(encode_xor(new, base), base), new)
    with pytest.raises(ValueError, match="full version"):
        encode_xor(new[:10], base)
    with pytest.raises(ValueError, match="full version"):
        decode_xor(encode_xor(new[:10], base[:10]), base)


@pytest.mark.parametrize("wire", ["fp32", "bf16", None])
def test_delta_chain_reconstructs_the_full_versions_bit_exactly(transport, wire):
    states = _versions(6)
    learner = WeightStore(transport, keep_last=6, wire_dtype=wire, delta=True, max_delta_chain=8)
    sampler = WeightStore(transport, keep_last=6, delta=True, max_delta_chain=8)
    full_reader = WeightStore(transport, keep_last=6)
    learner.publish(0, states[0])
    assert sampler.latest()[0] == 0 and sampler.stats["full_loads"] == 1
    for version in range(1, 6):
        learner.publish(version, states[version])
        got_version, got = sampler.latest(newer_than=version - 1)
        assert got_version == version
        _assert_bit_equal(got, full_reader.get(version))  # exactly what the full version holds
        got["0.weight"].add_(1.0)  # the caller's tensors are its own: the next delta's base is not touched
    assert sampler.stats["delta_loads"] == 5 and sampler.stats["full_loads"] == 1
    assert learner.stats["deltas_published"] == 5
    assert transport.keys(delta_topic(WEIGHTS_TOPIC)) == [version_key(v) for v in range(1, 6)]
    if wire is not None:  # the original dtypes come back, the wire's bits in them
        assert got["1.weight"].dtype == torch.float32 and got["steps"].dtype == torch.int64
        assert int(got["steps"]) == 5 and got["mask"].dtype == torch.bool


def test_sampler_within_the_chain_uses_deltas_beyond_it_one_full_version(transport):
    states = _versions(12)
    learner = WeightStore(transport, keep_last=12, wire_dtype="bf16", delta=True)
    near = WeightStore(transport, keep_last=12, delta=True, max_delta_chain=3)
    far = WeightStore(transport, keep_last=12, delta=True, max_delta_chain=3)
    learner.publish(0, states[0])
    near.latest(), far.latest()
    for version in range(1, 4):
        learner.publish(version, states[version])
    near_before = near.stats["bytes_fetched"]
    version, got = near.latest(newer_than=0)  # 3 behind, chain 3: three deltas
    assert version == 3 and near.stats["delta_loads"] == 1 and near.stats["full_loads"] == 1
    _assert_bit_equal(got, WeightStore(transport).get(3))
    for version in range(4, 8):
        learner.publish(version, states[version])
    version, got = far.latest(newer_than=0)  # 7 behind > 3: one full version, no delta read
    assert version == 7 and far.stats["full_loads"] == 2 and far.stats["delta_loads"] == 0
    assert far.stats["delta_fallbacks"] == 0  # out of reach is not a fallback
    _assert_bit_equal(got, WeightStore(transport).get(7))
    # three deltas moved fewer bytes than one full version of the same model
    assert near.stats["bytes_fetched"] - near_before < transport.info(WEIGHTS_TOPIC, version_key(3)).size


def test_pruned_or_corrupt_delta_falls_back_to_the_full_version(transport):
    states = _versions(8)
    learner = WeightStore(transport, keep_last=3, wire_dtype="bf16", delta=True)
    sampler = WeightStore(transport, keep_last=3, delta=True, max_delta_chain=8)
    learner.publish(0, states[0])
    sampler.latest()
    for version in range(1, 5):
        learner.publish(version, states[version])
    # deltas are pruned with their versions: 1 is gone, so 0 -> 4 cannot chain
    assert learner.versions() == [2, 3, 4] and learner.delta_versions() == [2, 3, 4]
    version, got = sampler.latest(newer_than=0)
    assert version == 4 and sampler.stats["full_loads"] == 2 and sampler.stats["delta_fallbacks"] == 1
    _assert_bit_equal(got, WeightStore(transport).get(4))

    learner.publish(5, states[5])
    learner.publish(6, states[6])
    path = _data_path(transport, delta_topic(WEIGHTS_TOPIC), version_key(6))
    data = transport.fs.cat_file(path)
    transport.fs.pipe_file(path, data[:-100] + bytes(100))  # damaged in storage: fails its checksum
    version, got = sampler.latest(newer_than=4)
    assert version == 6 and sampler.stats["full_loads"] == 3 and sampler.stats["delta_fallbacks"] == 2
    _assert_bit_equal(got, WeightStore(transport).get(6))

    # a delta built on other bits than the held version (its base was republished differently):
    # the base checksum refuses it before any bits are used
    wires = [wire_tensors(states[i], "bf16") for i in (5, 7)]
    bogus = encode_delta(wires[0][0], wires[1][0], wires[1][1], 6, 7)
    learner.publish(7, states[7])
    transport.put(delta_topic(WEIGHTS_TOPIC), version_key(7), bogus)
    version, got = sampler.latest(newer_than=6)
    assert version == 7 and sampler.stats["full_loads"] == 4 and sampler.stats["delta_fallbacks"] == 3
    _assert_bit_equal(got, WeightStore(transport).get(7))
    with pytest.raises(ValueError, match="other bits"):
        apply_delta(bogus, wire_tensors(states[6], "bf16")[0])


def test_protocol_owns_the_key_format_and_imports_no_weights():
    """The weights and delta topics' keys are the protocol's; the weight store builds on it, never
    the reverse (a fresh interpreter: importing the protocol loads no weights module, no torch)."""
    assert (version_key(17), parse_version_key(version_key(17)), parse_version_key("v17")) == ("v0000000017", 17, None)
    assert delta_topic(WEIGHTS_TOPIC) == WEIGHTS_DELTA_TOPIC == "weights_delta"
    code = (
        "import sys, verl_ext.hetero.protocol; "
        "print(sorted(m for m in ('verl_ext.hetero.weights', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_delay_channel_delays_delta_n_exactly_like_version_n(transport):
    assert message_index(WEIGHTS_DELTA_TOPIC, version_key(17)) == message_index(WEIGHTS_TOPIC, version_key(17)) == 17
    clock = FakeClock()
    transport.clock = clock
    model = make_delay_model("lognormal", low=60, high=1920)
    channel = DelayChannel(transport, model, seed=5, stream=2, clock=clock, topics=[WEIGHTS_TOPIC, WEIGHTS_DELTA_TOPIC])
    for version in range(1, 6):
        assert channel.delay_for(WEIGHTS_DELTA_TOPIC, version_key(version)) == channel.delay_for(
            WEIGHTS_TOPIC, version_key(version)
        )

    # end to end: a sampler behind a constant 30 s delay reaches each version through its delta
    # as soon as the version itself is visible, never earlier
    states = _versions(4)
    learner = WeightStore(transport, keep_last=4, wire_dtype="bf16", delta=True)
    sampler = WeightStore(
        DelayChannel(
            transport,
            make_delay_model("constant", value=30.0),
            clock=clock,
            topics=[WEIGHTS_TOPIC, WEIGHTS_DELTA_TOPIC],
        ),
        delta=True,
    )
    learner.publish(0, states[0])
    clock.now += 30
    assert sampler.latest()[0] == 0
    learner.publish(1, states[1])
    clock.now += 10
    learner.publish(2, states[2])
    clock.now += 19.9
    assert sampler.latest(newer_than=0) is None and sampler.stats["delta_loads"] == 0  # delta 1 hidden too
    clock.now += 0.2
    assert sampler.latest(newer_than=0)[0] == 1 and sampler.stats["delta_loads"] == 1
    clock.now += 10
    assert sampler.latest(newer_than=1)[0] == 2 and sampler.stats["delta_loads"] == 2
    assert sampler.stats["full_loads"] == 1


def test_republished_version_after_a_restart_has_no_stale_delta(transport):
    states = _versions(4)
    learner = WeightStore(transport, keep_last=4, delta=True)
    for version in range(3):
        learner.publish(version, states[version])
    assert learner.delta_versions() == [1, 2]
    restarted = WeightStore(transport, keep_last=4, delta=True)  # a resumed learner: no base in memory
    restarted.delete_newer_than(1)
    assert restarted.versions() == [0, 1] and restarted.delta_versions() == [1]
    restarted.publish(1, states[3])  # republished with other bits: its old delta must go
    assert restarted.delta_versions() == []
    sampler = WeightStore(transport, delta=True)
    _assert_bit_equal(sampler.latest()[1], states[3])


def test_delta_fetch_moves_fewer_bytes_than_full_on_a_small_lr_update(transport):
    states = _versions(3, lr=1e-5)
    for wire in ("fp32", "bf16"):
        topic = f"w{wire}"
        learner = WeightStore(transport, topic=topic, wire_dtype=wire, delta=True)
        delta_reader = WeightStore(transport, topic=topic, delta=True)
        full_reader = WeightStore(transport, topic=topic)
        learner.publish(0, states[0])
        delta_reader.latest(), full_reader.latest()
        learner.publish(1, states[1])
        before = dict(delta_reader.stats), dict(full_reader.stats)
        _assert_bit_equal(delta_reader.latest(newer_than=0)[1], full_reader.latest(newer_than=0)[1])
        delta_bytes = delta_reader.stats["bytes_fetched"] - before[0]["bytes_fetched"]
        full_bytes = full_reader.stats["bytes_fetched"] - before[1]["bytes_fetched"]
        assert delta_reader.stats["delta_loads"] == 1 and full_reader.stats["full_loads"] == 2
        assert delta_bytes < 0.7 * full_bytes, (wire, delta_bytes, full_bytes)


@pytest.mark.parametrize("wire", [None, "fp32", "bf16"])
def test_publishing_live_parameters_updated_in_place(transport, wire):
    """The learner publishes ``model.state_dict()`` itself -- tensors the optimizer then changes
    in place. The publisher's delta base must be a copy: an alias made every next delta the XOR
    of the new weights with themselves, so each one failed its checksum and the sampler fell back
    to full versions (never wrong weights, but never a delta either)."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    learner = WeightStore(transport, keep_last=8, wire_dtype=wire, delta=True)
    sampler = WeightStore(transport, keep_last=8, delta=True)
    for version in range(4):
        learner.publish(version, model.state_dict())
        want, _ = wire_tensors({k: v.detach().clone() for k, v in model.state_dict().items()}, wire)
        got_version, state = sampler.latest()  # one version behind each time: a chain of one delta
        assert got_version == version
        _assert_bit_equal(wire_tensors(state, wire)[0], want)
        opt.zero_grad()
        model(torch.randn(8, 256)).pow(2).mean().backward()
        opt.step()  # in place: the tensors just published change
    assert sampler.stats["full_loads"] == 1 and sampler.stats["delta_loads"] == 3, dict(sampler.stats)
    assert sampler.stats["delta_fallbacks"] == 0


def test_bad_max_delta_chain_is_refused(transport):
    with pytest.raises(ValueError, match="max_delta_chain=0"):
        WeightStore(transport, delta=True, max_delta_chain=0)


def test_a_chain_heavier_than_the_full_version_is_not_fetched(transport):
    states = [_versions(1, seed=seed)[0] for seed in range(4)]  # unrelated weights: big deltas
    learner = WeightStore(transport, keep_last=4, wire_dtype="bf16", delta=True)
    sampler = WeightStore(transport, delta=True)
    learner.publish(0, states[0])
    sampler.latest()
    for version in (1, 2, 3):
        learner.publish(version, states[version])
    chain = sum(transport.info(delta_topic(WEIGHTS_TOPIC), version_key(v)).size for v in (1, 2, 3))
    assert chain > transport.info(WEIGHTS_TOPIC, version_key(3)).size
    version, got = sampler.latest(newer_than=0)  # 3 behind, within the chain, but heavier: full
    assert version == 3 and sampler.stats["full_loads"] == 2 and sampler.stats["delta_loads"] == 0
    assert sampler.stats["delta_larger"] == 1 and sampler.stats["delta_fallbacks"] == 0
    _assert_bit_equal(got, WeightStore(transport).get(3))
