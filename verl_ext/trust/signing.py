"""Signed rollout records: only enrolled samplers' groups reach the learner.

A sampler seals each serialised group (:meth:`RolloutGroup.to_bytes`) with its Ed25519 key; the
learner opens it with the public keys it enrolled (:class:`Enrolment`, not a secret) and refuses
anything else before decoding it. Signed: a domain tag, the sampler id and the SHA-256 of the
record's bytes; the record's ``sampler_id`` must equal the signer's. The group uid is the nonce
(the ledger never accepts one twice). Envelope: ``MAGIC`` + 4-byte big-endian header length + JSON
header ``{"sampler_id", "key_id", "signature" (hex)}`` + the record's bytes; ``key_id`` names which
of the sampler's enrolled keys signed (a restarted sampler makes a new one). Rejections are
:class:`~verl_ext.hetero.records.RecordRejected` with reasons ``unsigned``, ``unenrolled``,
``revoked``, ``bad_signature``, ``sampler_mismatch``. Why Ed25519, not HMAC, and what it costs:
docs/reliability.md, "Signed records".

    python -m verl_ext.trust.signing keygen | pubkey | enrol | revoke | reinstate ...  (--help)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from verl_ext.hetero.records import RecordRejected
from verl_ext.rundir import write_text_atomically

MAGIC = b"HRLSIG1\n"
_DOMAIN = b"heterorl.rollout_group.signature/1\0"
_MAX_HEADER = 4096


def _message(sampler_id: str, record: bytes) -> bytes:
    return _DOMAIN + sampler_id.encode() + b"\0" + hashlib.sha256(record).digest()


def key_id(public_hex: str) -> str:
    """A public key's short name: the first 8 bytes of its SHA-256, hex."""
    return hashlib.sha256(bytes.fromhex(public_hex)).hexdigest()[:16]


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
        pem = self.private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps({"sampler_id": self.sampler_id}).encode() + b"\n" + pem)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SamplerKey":
        """A key :meth:`save` wrote; OSError when it cannot be read, ValueError naming ``path``
        when it is not such a key."""
        head, _, pem = Path(path).read_bytes().partition(b"\n")
        try:
            sampler_id = json.loads(head)["sampler_id"]
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, KeyError, TypeError, UnsupportedAlgorithm) as err:
            raise ValueError(
                f"{path}: not a sampler key file (keygen writes one): {type(err).__name__}: {err}"
            ) from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path}: not an Ed25519 private key")
        return cls(str(sampler_id), key)

    def seal(self, record: bytes) -> bytes:
        """The signed envelope of ``record`` (a serialised group)."""
        header = json.dumps(
            {
                "sampler_id": self.sampler_id,
                "key_id": key_id(self.public_hex()),
                "signature": self.private_key.sign(_message(self.sampler_id, record)).hex(),
            }
        ).encode()
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
    """The samplers a learner accepts: sampler id -> its public keys (key id -> hex), and the
    revoked sampler ids. A revoked id stays revoked when it enrols a new key (a quarantined
    sampler does not come back by restarting) until :meth:`reinstate`."""

    keys: dict[str, dict[str, str]] = field(default_factory=dict)
    revoked: set[str] = field(default_factory=set)

    def enrol(self, sampler_id: str, public_hex: str) -> str:
        """Accept records signed by this key in this sampler's name; returns the key id."""
        try:
            Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex))
        except ValueError as err:
            raise ValueError(f"enrolment: sampler {sampler_id!r}: bad public key {public_hex!r}: {err}") from None
        kid = key_id(public_hex)
        self.keys.setdefault(str(sampler_id), {})[kid] = public_hex
        return kid

    def revoke(self, sampler_id: str) -> None:
        """Refuse this sampler's records, under every key it has or will enrol, from the next one on."""
        self.revoked.add(str(sampler_id))

    def reinstate(self, sampler_id: str) -> None:
        self.revoked.discard(str(sampler_id))

    def update(self, other: "Enrolment") -> None:
        """Add ``other``'s keys and revocations to this enrolment."""
        for sampler_id, keys in other.keys.items():
            self.keys.setdefault(sampler_id, {}).update(keys)
        self.revoked |= other.revoked

    def to_json(self) -> str:
        keys = {sampler_id: sorted(by_id.values()) for sampler_id, by_id in self.keys.items()}
        return json.dumps({"keys": keys, "revoked": sorted(self.revoked)}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Enrolment":
        """``{"keys": {sampler id: [public hex, ...]}, "revoked": [sampler id, ...]}``."""
        data = json.loads(text)
        out = cls()
        for sampler_id, public_keys in data.get("keys", {}).items():
            for public_hex in [public_keys] if isinstance(public_keys, str) else public_keys:
                out.enrol(sampler_id, public_hex)
        out.revoked = set(map(str, data.get("revoked", [])))
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Enrolment":
        """An enrolment file; a missing file is an empty enrolment."""
        path = Path(path)
        if not path.exists():
            return cls()
        try:
            return cls.from_json(path.read_text())
        except (ValueError, TypeError, AttributeError) as err:
            raise ValueError(f"enrolment file {path}: {err}") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (a reader never sees half a file)."""
        path = Path(path)
        write_text_atomically(path, self.to_json())
        return path

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
            kid = str(header.get("key_id", ""))
        except (struct.error, ValueError, KeyError, TypeError, AttributeError) as err:
            raise RecordRejected(
                "record", "bad_signature", f"unreadable signature header: {err}", group_uid=key
            ) from None
        if sampler_id in self.revoked:
            raise RecordRejected("sampler_id", "revoked", "sampler revoked", sampler_id=sampler_id, group_uid=key)
        public_hex = self.keys.get(sampler_id, {}).get(kid)
        if public_hex is None:
            raise RecordRejected(
                "sampler_id",
                "unenrolled",
                f"no enrolled key {kid!r} for this sampler",
                sampler_id=sampler_id,
                group_uid=key,
            )
        try:
            Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex)).verify(
                signature, _message(sampler_id, record)
            )
        except InvalidSignature:
            raise RecordRejected(
                "record",
                "bad_signature",
                "signature does not match the record and signer",
                sampler_id=sampler_id,
                group_uid=key,
            ) from None
        return sampler_id, record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m verl_ext.trust.signing", description="Sampler keys and the learner's enrolment file."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    keygen = sub.add_parser("keygen", help="make a sampler's key (file mode 0600); prints its public key")
    keygen.add_argument("key_file")
    keygen.add_argument("sampler_id")
    pubkey = sub.add_parser("pubkey", help="print the public key of an existing key file (what enrol takes)")
    pubkey.add_argument("key_file")
    pubkey.add_argument("--sampler-id", default=None, help="refuse unless the key is this sampler's")
    enrol = sub.add_parser("enrol", help="add a sampler's public key to an enrolment file (again: no change)")
    enrol.add_argument("enrolment_file")
    enrol.add_argument("sampler_id")
    enrol.add_argument("public_hex")
    for name, help_text in (("revoke", "refuse a sampler from its next record on"), ("reinstate", "undo revoke")):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("enrolment_file")
        cmd.add_argument("sampler_id")
    args = parser.parse_args(argv)
    try:
        if args.command == "keygen":
            if Path(args.key_file).exists():
                raise ValueError(f"{args.key_file} exists; not overwriting a key")
            key = SamplerKey.generate(args.sampler_id)
            key.save(args.key_file)
            print(key.public_hex())
            return 0
        if args.command == "pubkey":
            key = SamplerKey.load(args.key_file)
            if args.sampler_id is not None and key.sampler_id != args.sampler_id:
                raise ValueError(f"{args.key_file} is {key.sampler_id!r}'s key, not --sampler-id {args.sampler_id!r}'s")
            print(key.public_hex())
            return 0
        enrolment = Enrolment.load(args.enrolment_file)
        if args.command == "enrol":
            print(enrolment.enrol(args.sampler_id, args.public_hex))
        else:
            getattr(enrolment, args.command)(args.sampler_id)
        enrolment.save(args.enrolment_file)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
