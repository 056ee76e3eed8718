"""Signed rollout records: only enrolled samplers' groups reach the learner (issue 23 item 1).

A sampler seals each serialised group (:meth:`RolloutGroup.to_bytes`) with its Ed25519 key; the
learner opens it with the public keys it enrolled and refuses anything else before decoding it.

Why Ed25519 rather than HMAC with per-sampler secrets: the learner holds only public keys, so the
list it enrols (a JSON file in the run directory, on a shared folder, in a bucket) is not a
secret -- whoever can read it still cannot sign -- and a sampler's private key never has to be
sent anywhere: a sampler makes its key where it runs and publishes only the public half. Cost:
signing ~50 us and verifying ~150 us per group on this CPU, against milliseconds to seconds of
generation per group.

What is signed: a domain tag, the sampler id, and the SHA-256 of the record's bytes; so changing
one byte of the record, claiming another sampler's id, or moving a signature to another record
fails. The record's own ``sampler_id`` must equal the signer's (a sampler cannot publish in
another's name). Replays of an old signed record carry its group uid, which the learner's ledger
remembers across checkpoints (buffered, consumed, dropped: never twice) -- the uid is the nonce.

Envelope: ``MAGIC`` + 4-byte big-endian header length + JSON header
``{"sampler_id", "signature" (hex)}`` + the record's bytes. Rejections are
:class:`~verl_ext.hetero.records.RecordRejected` with reasons ``unsigned``, ``unenrolled``,
``revoked``, ``bad_signature``, ``sampler_mismatch``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from verl_ext.hetero.records import RecordRejected

MAGIC = b"HRLSIG1\n"
_DOMAIN = b"heterorl.rollout_group.signature/1\0"
_MAX_HEADER = 4096


def _message(sampler_id: str, record: bytes) -> bytes:
    return _DOMAIN + sampler_id.encode() + b"\0" + hashlib.sha256(record).digest()


@dataclass
class SamplerKey:
    """A sampler's signing key (Ed25519)."""

    sampler_id: str
    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls, sampler_id: str) -> "SamplerKey":
        return cls(str(sampler_id), Ed25519PrivateKey.generate())

    def public_hex(self) -> str:
        """The public key, raw 32 bytes as hex: what the learner enrols."""
        raw = self.private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return raw.hex()

    def save(self, path: str | os.PathLike) -> Path:
        """Write the private key (PKCS8 PEM, file mode 0600) with the sampler id beside it."""
        path = Path(path)
        pem = self.private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption())  # fmt: skip
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps({"sampler_id": self.sampler_id}).encode() + b"\n" + pem)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SamplerKey":
        head, _, pem = Path(path).read_bytes().partition(b"\n")
        key = serialization.load_pem_private_key(pem, password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path}: not an Ed25519 private key")
        return cls(str(json.loads(head)["sampler_id"]), key)

    def seal(self, record: bytes) -> bytes:
        """The signed envelope of ``record`` (a serialised group)."""
        header = json.dumps({"sampler_id": self.sampler_id,
                             "signature": self.private_key.sign(_message(self.sampler_id, record)).hex()}).encode()
        return MAGIC + struct.pack(">I", len(header)) + header + record


def _split(data: bytes) -> tuple[bytes, bytes]:
    """(header, record) of an envelope; ValueError on a malformed one."""
    try:
        (size,) = struct.unpack(">I", data[len(MAGIC) : len(MAGIC) + 4])
    except struct.error as err:
        raise ValueError(f"truncated envelope: {err}") from None
    if size > _MAX_HEADER:
        raise ValueError(f"header of {size} bytes")
    start = len(MAGIC) + 4
    return data[start : start + size], data[start + size :]


def unverified_record(data: bytes) -> bytes:
    """The record inside an envelope without checking its signature (a learner that enrols no
    samplers); ``data`` itself when it is not an envelope."""
    return _split(data)[1] if data.startswith(MAGIC) else data


@dataclass
class Enrolment:
    """The samplers a learner accepts: sampler id -> public key (hex), and the revoked ids."""

    keys: dict[str, str] = field(default_factory=dict)
    revoked: set[str] = field(default_factory=set)

    def enrol(self, sampler_id: str, public_hex: str) -> None:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex))  # a malformed key fails here, named
        self.keys[str(sampler_id)] = public_hex
        self.revoked.discard(str(sampler_id))

    def revoke(self, sampler_id: str) -> None:
        """Refuse this sampler's records from the next one on."""
        self.revoked.add(str(sampler_id))

    def to_json(self) -> str:
        return json.dumps({"keys": self.keys, "revoked": sorted(self.revoked)}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Enrolment":
        data = json.loads(text)
        out = cls()
        for sampler_id, public_hex in data.get("keys", {}).items():
            try:
                out.enrol(sampler_id, public_hex)
            except ValueError as err:
                raise ValueError(f"enrolment: sampler {sampler_id!r}: bad public key {public_hex!r}: {err}") from None
        out.revoked = set(map(str, data.get("revoked", [])))
        return out

    def open(self, data: bytes, key: str = "?") -> tuple[str, bytes]:
        """(signer's sampler id, the record's bytes) of a valid envelope from an enrolled,
        unrevoked sampler; else :class:`RecordRejected` naming why (``key``: the transport key,
        for the message)."""
        if not data.startswith(MAGIC):
            raise RecordRejected("record", "unsigned", "no signature envelope", group_uid=key)
        try:
            raw_header, record = _split(data)
            header = json.loads(raw_header)
            sampler_id, signature = str(header["sampler_id"]), bytes.fromhex(header["signature"])
        except (struct.error, ValueError, KeyError, TypeError) as err:
            raise RecordRejected("record", "bad_signature", f"unreadable signature header: {err}", group_uid=key) from None
        if sampler_id in self.revoked:
            raise RecordRejected("sampler_id", "revoked", "sampler revoked", sampler_id=sampler_id, group_uid=key)
        public_hex = self.keys.get(sampler_id)
        if public_hex is None:
            raise RecordRejected("sampler_id", "unenrolled", "no enrolled key for this sampler",
                                 sampler_id=sampler_id, group_uid=key)  # fmt: skip
        try:
            Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex)).verify(signature, _message(sampler_id, record))
        except InvalidSignature:
            raise RecordRejected("record", "bad_signature", "signature does not match the record and signer",
                                 sampler_id=sampler_id, group_uid=key) from None  # fmt: skip
        return sampler_id, record
