"""Signed rollout records: only enrolled samplers' groups reach the buffer, over
the fsspec transports (memory, a folder) and Ray's, with each refusal counted under its reason."""

from __future__ import annotations

import itertools
import json

import pytest

from verl_ext.trust import signing as auth
from verl_ext.trust.signing import MAGIC, Enrolment, SamplerKey
from verl_ext.hetero.buffer import RolloutBuffer
from verl_ext.hetero.exchange import RolloutInbox, send_group
from verl_ext.hetero.records import RecordRejected
from verl_ext.hetero.transport import FsspecTransport

from tests.hetero.factories import build_group

_ids = itertools.count()


@pytest.fixture(params=["memory", "folder"])
def transport(request, tmp_path):
    if request.param == "memory":
        return FsspecTransport(f"memory://hetero-auth-{next(_ids)}")
    return FsspecTransport(str(tmp_path / "shared"))


@pytest.fixture
def keys():
    return {s: SamplerKey.generate(s) for s in ("s0", "s1", "stranger")}


@pytest.fixture
def enrolment(keys):
    out = Enrolment()
    for s in ("s0", "s1"):
        out.enrol(s, keys[s].public_hex())
    return out


def _reason(enrolment, data):
    with pytest.raises(RecordRejected) as err:
        enrolment.open(data, "k")
    return err.value.reason


def test_seal_and_open_and_every_refusal(keys, enrolment):
    record = build_group("s0-g1", 0, sampler="s0").to_bytes()
    sealed = keys["s0"].seal(record)
    assert enrolment.open(sealed) == ("s0", record)
    tampered = bytearray(sealed)
    tampered[-10] ^= 1  # one bit of the record
    assert _reason(enrolment, bytes(tampered)) == "bad_signature"
    assert _reason(enrolment, record) == "unsigned"
    assert _reason(enrolment, keys["stranger"].seal(record)) == "unenrolled"
    # s1 signs the message of s0's record with its own key and claims to be s0: checked against s0's key
    signature = keys["s1"].private_key.sign(auth._message("s0", record)).hex()
    header = json.dumps(
        {"sampler_id": "s0", "key_id": auth.key_id(keys["s0"].public_hex()), "signature": signature}
    ).encode()
    forged = MAGIC + len(header).to_bytes(4, "big") + header + record
    assert _reason(enrolment, forged) == "bad_signature"
    assert _reason(enrolment, MAGIC + (10**6).to_bytes(4, "big") + b"{}") == "bad_signature"
    enrolment.revoke("s0")
    assert _reason(enrolment, sealed) == "revoked"
    enrolment.enrol("s0", SamplerKey.generate("s0").public_hex())  # a restart's new key: still revoked
    assert _reason(enrolment, sealed) == "revoked"
    enrolment.reinstate("s0")
    assert enrolment.open(sealed)[0] == "s0"


def test_a_restarted_sampler_keeps_its_earlier_records_valid(keys, enrolment):
    """A restart enrols a second key under the same id: records the first launch left in flight
    are still accepted, and a key of another sampler id does not sign for this one."""
    record = build_group("s0-g1", 0, sampler="s0").to_bytes()
    restarted = SamplerKey.generate("s0")
    enrolment.enrol("s0", restarted.public_hex())
    assert enrolment.open(keys["s0"].seal(record))[0] == "s0"
    assert enrolment.open(restarted.seal(record))[0] == "s0"
    assert len(enrolment.keys["s0"]) == 2
    posing = SamplerKey(sampler_id="s0", private_key=keys["s1"].private_key)  # s1's key, s0's name
    assert _reason(enrolment, posing.seal(record)) == "unenrolled"


def test_keys_and_enrolment_survive_files(tmp_path, keys, enrolment):
    path = keys["s0"].save(tmp_path / "s0.key")
    assert (path.stat().st_mode & 0o777) == 0o600
    loaded = SamplerKey.load(path)
    assert loaded.sampler_id == "s0" and loaded.public_hex() == keys["s0"].public_hex()
    enrolment.revoke("s1")
    again = Enrolment.from_json(enrolment.to_json())
    assert again.keys == enrolment.keys and again.revoked == {"s1"}
    record = build_group("s0-g1", 0, sampler="s0").to_bytes()
    assert again.open(loaded.seal(record))[1] == record
    with pytest.raises(ValueError, match="sampler 'bad': bad public key 'zz'"):
        Enrolment.from_json(json.dumps({"keys": {"bad": ["zz"]}}))
    saved = again.save(tmp_path / "enrolment.json")
    assert Enrolment.load(saved).keys == enrolment.keys
    assert Enrolment.load(tmp_path / "absent.json").keys == {}
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        Enrolment.load(tmp_path / "broken.json")


def test_operator_commands(tmp_path, capsys):
    """keygen -> enrol -> revoke through the module's command line, as an operator would."""
    key_file, enrol_file = tmp_path / "r7.key", tmp_path / "enrolment.json"
    assert auth.main(["keygen", str(key_file), "sampler-7"]) == 0
    public_hex = capsys.readouterr().out.strip()
    assert auth.main(["keygen", str(key_file), "sampler-7"]) == 2  # never overwrites a key
    assert "exists" in capsys.readouterr().err
    assert auth.main(["enrol", str(enrol_file), "sampler-7", public_hex]) == 0
    record = build_group("r7-g0", 0, sampler="sampler-7").to_bytes()
    assert Enrolment.load(enrol_file).open(SamplerKey.load(key_file).seal(record))[0] == "sampler-7"
    assert auth.main(["enrol", str(enrol_file), "sampler-8", "nothex"]) == 2
    assert "bad public key 'nothex'" in capsys.readouterr().err
    assert auth.main(["revoke", str(enrol_file), "sampler-7"]) == 0
    assert Enrolment.load(enrol_file).revoked == {"sampler-7"}


def _check_inbox(transport, keys, enrolment):
    buffer = RolloutBuffer(max_delay=4)
    inbox = RolloutInbox(transport, buffer, enrolment=enrolment)
    for i in range(3):
        send_group(transport, build_group(f"s0-g{i}", 0, sampler="s0"), key=keys["s0"])
    send_group(transport, build_group("s1-g0", 0, sampler="s1"), key=keys["s1"])
    # a stranger writes straight into the transport: unsigned, and signed with its own key
    transport.put("rollouts", "x-g0", build_group("x-g0", 0, sampler="s0").to_bytes())
    transport.put("rollouts", "x-g1", keys["stranger"].seal(build_group("x-g1", 0, sampler="stranger").to_bytes()))
    # s1 publishes a group in s0's name
    transport.put("rollouts", "s1-g9", keys["s1"].seal(build_group("s1-g9", 0, sampler="s0").to_bytes()))
    with pytest.raises(ValueError, match="names sampler 's0' but the key is 's1'"):
        send_group(transport, build_group("s1-g8", 0, sampler="s0"), key=keys["s1"])
    assert inbox.poll() == 4
    rejected = buffer.metrics()
    assert {k: v for k, v in rejected.items() if k.startswith("hetero/rejected/")} == {
        "hetero/rejected/unsigned": 1.0,
        "hetero/rejected/unenrolled": 1.0,
        "hetero/rejected/sampler_mismatch": 1.0,
    }
    assert inbox.stats["unauthenticated"] == 3
    consumed = {g.group_uid for g in buffer.take(4, 0)}
    assert consumed == {"s0-g0", "s0-g1", "s0-g2", "s1-g0"}
    # a replay of a consumed signed record (same bytes, re-put) is never used again
    replay = keys["s0"].seal(build_group("s0-g0", 0, sampler="s0").to_bytes())
    transport.delete("rollouts", "s0-g0")
    transport.put("rollouts", "s0-g0", replay)
    assert inbox.poll() == 0 and len(buffer) == 0
    # revoked from the next record on; the groups accepted before stay
    enrolment.revoke("s1")
    send_group(transport, build_group("s1-g1", 1, sampler="s1"), key=keys["s1"])
    send_group(transport, build_group("s0-g3", 1, sampler="s0"), key=keys["s0"])
    buffer.set_learner_version(1)
    assert inbox.poll() == 1
    assert buffer.metrics()["hetero/rejected/revoked"] == 1.0
    assert buffer.ledger.status["s1-g1"] == "rejected:revoked"
    # without an enrolment the learner reads signed records without checking them
    plain = RolloutBuffer(max_delay=4)
    plain.set_learner_version(1)
    count = RolloutInbox(transport, plain).poll()
    uids = {g.group_uid for g in plain.take(count, 1)}
    assert {"s0-g3", "x-g0", "x-g1", "s1-g9"} <= uids  # signed, unsigned, foreign: all read unchecked


def test_only_enrolled_samplers_reach_the_buffer_over_fsspec(transport, keys, enrolment):
    _check_inbox(transport, keys, enrolment)


def test_only_enrolled_samplers_reach_the_buffer_over_ray(keys, enrolment):
    import ray

    from verl_ext.hetero.transport import RayTransport

    ray.init(num_cpus=1, include_dashboard=False, namespace="hetero-auth", log_to_driver=False)
    try:
        transport = RayTransport("heterorl-test-auth")
        try:
            _check_inbox(transport, keys, enrolment)
        finally:
            transport.shutdown()
    finally:
        ray.shutdown()
