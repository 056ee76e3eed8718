"""Versioned policy weights over a transport.

The learner calls ``publish(version, state_dict)``; samplers poll ``latest_version()`` and load
``latest()`` or ``get(version)``; the last ``keep_last`` versions are kept. State dicts travel as
safetensors bytes under the transport's SHA-256, verified on every load (a corrupt version is skipped,
``stats["corrupt"]``). ``wire_dtype="bf16"``: floating tensors sent as bfloat16, cast back on load.

Deltas (``delta=True``, ``hetero.weight_sync=delta``): beside each full version n, a message n in
``<topic>_delta``: the XOR of n's and n-1's wire bits, zlib-compressed (:func:`encode_xor`), with
the SHA-256 of both. A fetcher at version b applies deltas b+1..n when all are visible, ``n - b <=
max_delta_chain`` and they are smaller than the full version, and checks the result's digest;
otherwise it fetches the full version. Either way the state dict is bit-identical to the full
version's (``stats``: ``full_loads``, ``delta_loads``, ``bytes_fetched``, ``delta_fallbacks``,
``delta_larger``). Costs: docs/network.md.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections import Counter
from typing import Mapping

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from verl_ext.hetero.protocol import WEIGHTS_TOPIC, delta_topic, parse_version_key, version_key
from verl_ext.hetero.safetensors_meta import read_metadata
from verl_ext.hetero.transport import CorruptMessage, Transport

WEIGHTS_FORMAT = "heterorl.weights/1"
DELTA_FORMAT = "heterorl.weights-delta/1"
XOR_TENSOR = "__xor__"  # the delta message's compressed XOR of all floating tensors
WIRE_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def wire_tensors(
    state_dict: Mapping[str, torch.Tensor], wire_dtype: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors as they travel (CPU, contiguous, floating ones cast to ``wire_dtype``, tied
    tensors given their own storage) and each one's original dtype name."""
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype={wire_dtype!r} must be one of {list(WIRE_DTYPES)}")
    cast_to = WIRE_DTYPES[wire_dtype]
    tensors, dtypes, seen_storage = {}, {}, set()
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(value).__name__}, expected a torch.Tensor")
        tensor = value.detach().to("cpu")
        dtypes[name] = str(tensor.dtype).removeprefix("torch.")
        if cast_to is not None and tensor.is_floating_point():
            tensor = tensor.to(cast_to)
        tensor = tensor.contiguous()
        # safetensors refuses tensors sharing storage (tied embeddings); give each its own copy
        pointer = tensor.untyped_storage().data_ptr()
        if pointer in seen_storage and tensor.numel():
            tensor = tensor.clone()
        seen_storage.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    return tensors, dtypes


def _serialize_wire(tensors: Mapping[str, torch.Tensor], dtypes: Mapping[str, str], version: int) -> bytes:
    metadata = {"format": WEIGHTS_FORMAT, "version": str(int(version)), "dtypes": json.dumps(dict(dtypes))}
    return st_save(dict(tensors), metadata=metadata)


def serialize_state_dict(state_dict: Mapping[str, torch.Tensor], version: int, wire_dtype: str | None = None) -> bytes:
    """safetensors bytes of ``state_dict`` (CPU, contiguous); the original dtypes and the version
    ride in the metadata so :func:`deserialize_state_dict` restores them."""
    tensors, dtypes = wire_tensors(state_dict, wire_dtype)
    return _serialize_wire(tensors, dtypes, version)


def _deserialize_wire(data: bytes) -> tuple[int, dict[str, torch.Tensor], dict[str, str]]:
    """(version, tensors in their wire dtypes, original dtype names) of a full weights message."""
    metadata = read_metadata(data)
    if metadata.get("format") != WEIGHTS_FORMAT:
        raise ValueError(f"not a weights message: format={metadata.get('format')!r}, expected {WEIGHTS_FORMAT!r}")
    return int(metadata["version"]), st_load(data), json.loads(metadata["dtypes"])


def _to_original(
    tensors: Mapping[str, torch.Tensor], dtypes: Mapping[str, str], copy: bool = False
) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in tensors.items():
        restored = tensor.to(getattr(torch, dtypes[name]))
        # the fetcher keeps its wire tensors as the next delta's base: never hand them out
        out[name] = restored.clone() if copy and restored.data_ptr() == tensor.data_ptr() else restored
    return out


def deserialize_state_dict(data: bytes) -> tuple[int, dict[str, torch.Tensor]]:
    """Inverse of :func:`serialize_state_dict`: (version, state_dict in the original dtypes)."""
    version, tensors, dtypes = _deserialize_wire(data)
    return version, _to_original(tensors, dtypes)


# --- XOR deltas (also what research/testbeds/wan/sync_bench.py measures) --------------------------


def _tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, flat. [numel * element_size] uint8"""
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def floating_bits(state: Mapping[str, torch.Tensor], wire_dtype: str | None = None) -> np.ndarray:
    """The bit patterns of every floating tensor, cast to ``wire_dtype`` (None: as is), in name
    order, concatenated as bytes. [B] uint8 (``.view(np.uint16)`` for bf16 values)"""
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype={wire_dtype!r} must be one of {list(WIRE_DTYPES)}")
    cast_to = WIRE_DTYPES[wire_dtype]
    parts = [
        _tensor_bytes(state[name].to(cast_to) if cast_to is not None else state[name])
        for name in sorted(state)
        if state[name].is_floating_point()
    ]
    return torch.cat(parts).numpy() if parts else np.zeros(0, dtype=np.uint8)


def encode_xor(new_bits: np.ndarray, base_bits: np.ndarray, level: int = 1) -> bytes:
    """zlib(new XOR base): bits that did not change become zeros, which compress away. Any
    unsigned dtype (the bytes are the same). [P], [P] -> bytes"""
    if new_bits.shape != base_bits.shape or new_bits.dtype != base_bits.dtype:
        raise ValueError(
            f"shapes differ: new {new_bits.shape} {new_bits.dtype}, base {base_bits.shape} "
            f"{base_bits.dtype} (a full version is needed)"
        )
    return zlib.compress(np.bitwise_xor(new_bits, base_bits).tobytes(), level)


def decode_xor(blob: bytes, base_bits: np.ndarray) -> np.ndarray:
    """Inverse of :func:`encode_xor`: the new bit patterns, bit-exact. bytes, [P] -> [P]"""
    xor = np.frombuffer(zlib.decompress(blob), dtype=base_bits.dtype)
    if xor.shape != base_bits.shape:
        raise ValueError(f"delta holds {xor.size} values, the base {base_bits.size} (a full version is needed)")
    return np.bitwise_xor(xor, base_bits)


def wire_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of exact wire bits: every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(f"{name}\0{str(tensor.dtype).removeprefix('torch.')}\0{list(tensor.shape)}\0".encode())
        digest.update(_tensor_bytes(tensor).numpy().tobytes())
    return digest.hexdigest()


def encode_delta(
    base: Mapping[str, torch.Tensor],
    target: Mapping[str, torch.Tensor],
    dtypes: Mapping[str, str],
    base_version: int,
    version: int,
    level: int = 1,
) -> bytes:
    """The delta message base -> target (both wire tensors, :func:`wire_tensors`): safetensors
    with the compressed XOR of the floating tensors' bits and the non-floating tensors whole.
    ValueError if the two do not have the same floating tensors (names, dtypes, shapes)."""
    floating = sorted(name for name, t in target.items() if t.is_floating_point())
    layout = [[name, str(target[name].dtype).removeprefix("torch."), list(target[name].shape)] for name in floating]
    base_layout = [
        [name, str(t.dtype).removeprefix("torch."), list(t.shape)]
        for name, t in sorted(base.items())
        if t.is_floating_point()
    ]
    if layout != base_layout:
        raise ValueError("delta: base and target differ in their floating tensors (a full version is needed)")
    if XOR_TENSOR in target:
        raise ValueError(f"delta: a tensor is named {XOR_TENSOR!r}, the delta message's own entry")
    blob = encode_xor(floating_bits(target), floating_bits(base), level)
    tensors = {name: t for name, t in target.items() if not t.is_floating_point()}
    tensors[XOR_TENSOR] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    metadata = {
        "format": DELTA_FORMAT,
        "version": str(int(version)),
        "base_version": str(int(base_version)),
        "base_sha256": wire_sha256(base),
        "target_sha256": wire_sha256(target),
        "dtypes": json.dumps(dict(dtypes)),
        "floating": json.dumps(layout),
    }
    return st_save(tensors, metadata=metadata)


def apply_delta(
    data: bytes, base: Mapping[str, torch.Tensor], base_sha256: str | None = None
) -> tuple[int, dict[str, torch.Tensor], dict[str, str], str]:
    """Apply delta message ``data`` to the wire tensors ``base``: (version, target wire tensors,
    original dtype names, target SHA-256). ValueError if it is not a delta, was built on other
    bits than ``base`` (SHA-256 ``base_sha256``, computed if None), or the result does not
    reproduce the target's SHA-256."""
    metadata = read_metadata(data)
    if metadata.get("format") != DELTA_FORMAT:
        raise ValueError(f"not a weights delta: format={metadata.get('format')!r}, expected {DELTA_FORMAT!r}")
    if (base_sha256 or wire_sha256(base)) != metadata["base_sha256"]:
        raise ValueError(f"delta {metadata['version']} was built on other bits than the held version")
    tensors = st_load(data)
    blob = tensors.pop(XOR_TENSOR).numpy().tobytes()
    bits = decode_xor(blob, floating_bits(base))
    offset = 0
    for name, dtype, shape in json.loads(metadata["floating"]):
        wire_dtype = getattr(torch, dtype)
        size = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=wire_dtype).element_size()
        tensors[name] = torch.from_numpy(bits[offset : offset + size].copy()).view(wire_dtype).reshape(shape)
        offset += size
    sha = wire_sha256(tensors)
    if sha != metadata["target_sha256"]:
        raise ValueError(f"delta {metadata['version']}: reconstructed bits fail the target's SHA-256")
    return int(metadata["version"]), tensors, json.loads(metadata["dtypes"]), sha


class WeightStore:
    """Publish and fetch versioned state dicts through a :class:`Transport`.

    Args:
        transport: where versions live (any Transport, or a DelayChannel wrapping one so each
            sampler sees a version only after its drawn delay; it must cover the delta topic too).
        keep_last: K, how many most recent versions the publisher keeps (and their deltas);
            older ones are deleted after each publish (>= 1).
        wire_dtype: None (as is), "fp32", "bf16" or "fp16": dtype floating tensors travel in.
        topic: transport topic for weights; deltas go to :func:`delta_topic` (topic).
        delta: publish a delta next to each full version, and fetch through deltas (module
            docstring). A fetching store then keeps a copy of the last returned version's wire
            tensors (the base of the next delta).
        max_delta_chain: the most deltas a fetch applies; further behind, it fetches the full
            version (>= 1).
        pipelined: the publisher does not wait for the transport to confirm its writes
            (:meth:`Transport.put_nowait`; the async learner's choice: the Ray mailbox stores a
            version while the learner trains the next one). It then lists the topic once, at its
            first publish, and prunes from what it published since. A failed write raises at a
            later publish or at :meth:`flush`.
    """

    def __init__(
        self,
        transport: Transport,
        keep_last: int = 2,
        wire_dtype: str | None = None,
        topic: str = WEIGHTS_TOPIC,
        delta: bool = False,
        max_delta_chain: int = 8,
        pipelined: bool = False,
    ):
        if keep_last < 1:
            raise ValueError(f"WeightStore: keep_last={keep_last} must be >= 1")
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"WeightStore: wire_dtype={wire_dtype!r} must be one of {list(WIRE_DTYPES)}")
        if isinstance(max_delta_chain, bool) or not isinstance(max_delta_chain, int) or max_delta_chain < 1:
            raise ValueError(f"WeightStore: max_delta_chain={max_delta_chain!r} must be an int >= 1")
        self.transport, self.keep_last, self.wire_dtype, self.topic = transport, keep_last, wire_dtype, topic
        self.delta, self.max_delta_chain, self.delta_topic = bool(delta), max_delta_chain, delta_topic(topic)
        self.pipelined = bool(pipelined)
        # publisher, pipelined: (versions, deltas) it knows to exist; None until the first publish
        self._known: tuple[list[int], list[int]] | None = None
        self.stats: Counter[str] = Counter()
        self._bad: set[tuple[int, str]] = set()  # (version, sha256) already counted as corrupt
        self._sent: tuple[int, dict[str, torch.Tensor]] | None = None  # publisher: last version's wire tensors
        # fetcher: (version, wire tensors, original dtypes, wire SHA-256) it last returned
        self._held: tuple[int, dict[str, torch.Tensor], dict[str, str], str] | None = None
        self._published_sha256: dict[int, str] = {}  # publisher: kept version -> its message's SHA-256

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> bytes:
        """Store ``state_dict`` as ``version`` (int >= 0), then delete versions older than the
        newest ``keep_last``. Publishing an existing version replaces it. With deltas, the delta
        from version - 1 goes first when this store published version - 1 last (else a stale
        delta of that number is deleted, and fetchers take the full version). Returns the full
        version's message (:func:`deserialize_state_dict` reads it): the weights exactly as
        fetchers receive them."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"WeightStore.publish: version={version!r} must be an int >= 0")
        tensors, dtypes = wire_tensors(state_dict, self.wire_dtype)
        key = version_key(version)
        put = self.transport.put_nowait if self.pipelined else self.transport.put
        delete_many = self.transport.delete_many_nowait if self.pipelined else self.transport.delete_many
        if self.pipelined and self._known is None:  # what an earlier run left: listed once
            self._known = (self.versions(), self.delta_versions() if self.delta else [])
        if self.delta:
            delta = None
            if self._sent is not None and self._sent[0] == version - 1:
                try:
                    delta = encode_delta(self._sent[1], tensors, dtypes, version - 1, version)
                except ValueError:  # the tensors changed shape: only a full version can carry it
                    self.stats["delta_skipped"] += 1
            if delta is not None:
                # before the full version: it has the same delay, so a receiver that can see full
                # version n can see delta n too
                put(self.delta_topic, key, delta)
                self.stats["deltas_published"] += 1
                self.stats["delta_bytes_published"] += len(delta)
            else:
                delete_many(self.delta_topic, [key])
            # the next delta's base: copies, since uncast CPU wire tensors are the caller's live
            # parameters, which the optimizer updates in place before the next publish
            self._sent = (version, {name: t.clone() for name, t in tensors.items()})
        data = _serialize_wire(tensors, dtypes, version)
        self._published_sha256[version] = put(self.topic, key, data).sha256
        self.stats["published"] += 1
        self.stats["bytes_published"] += len(data)
        if self._known is not None:
            versions = sorted(set(self._known[0]) | {version})
            deltas = sorted(
                (set(self._known[1]) - {version}) | ({version} if self.delta and delta is not None else set())
            )
        else:
            versions, deltas = self.versions(), self.delta_versions() if self.delta else []
        kept = versions[-self.keep_last :]
        delete_many(self.topic, [version_key(v) for v in versions[: -self.keep_last]])
        self._published_sha256 = {v: h for v, h in self._published_sha256.items() if v in kept}
        if self.delta and kept:
            delete_many(self.delta_topic, [version_key(v) for v in deltas if v < kept[0]])
            deltas = [v for v in deltas if v >= kept[0]]
        if self._known is not None:
            self._known = (kept, deltas)
        return data

    def published_sha256(self, version: int) -> str | None:
        """Publisher: the SHA-256 of ``version``'s full message as this store published it (what
        :meth:`publish` returned), while it keeps that version; else None. A reader holding a
        message of that number to it knows it is the publisher's, whoever else can write to the
        transport (the learner's trust checker reads versions so)."""
        return self._published_sha256.get(int(version))

    def flush(self) -> None:
        """Wait until every write of this publisher is confirmed (pipelined); raise a failed one's error."""
        self.transport.flush()

    def delete_newer_than(self, version: int) -> None:
        """Delete every version (and delta) newer than ``version``: a resumed learner's future."""
        self.transport.flush()
        self._known = None  # listed again at the next publish
        for topic, versions in ((self.topic, self.versions()), (self.delta_topic, self.delta_versions())):
            self.transport.delete_many(topic, [version_key(v) for v in versions if v > version])
        if self._sent is not None and self._sent[0] > version:
            self._sent = None
        self._published_sha256 = {v: h for v, h in self._published_sha256.items() if v <= version}

    def versions(self) -> list[int]:
        """Committed (and, through a DelayChannel, visible) versions, ascending."""
        return sorted(v for v in map(parse_version_key, self.transport.keys(self.topic)) if v is not None)

    def delta_versions(self) -> list[int]:
        """Versions whose delta (from the version before) is committed and visible, ascending."""
        return sorted(v for v in map(parse_version_key, self.transport.keys(self.delta_topic)) if v is not None)

    def latest_version(self) -> int | None:
        """Newest committed version, or None; cheap (lists keys, loads nothing)."""
        versions = self.versions()
        return versions[-1] if versions else None

    def get(self, version: int) -> dict[str, torch.Tensor]:
        """The state dict of ``version``, from its full message. KeyError if absent (never
        published, pruned, or not yet visible); :class:`CorruptMessage` if it fails its checksum."""
        key = version_key(version)
        try:
            data = self.transport.get(self.topic, key)
        except CorruptMessage:
            try:
                mark = (version, self.transport.info(self.topic, key).sha256)
            except (KeyError, CorruptMessage):
                mark = (version, "")
            if mark not in self._bad:  # count each bad version once, however often it is polled
                self._bad.add(mark)
                self.stats["corrupt"] += 1
            raise
        self.stats["bytes_fetched"] += len(data)
        stored_version, tensors, dtypes = _deserialize_wire(data)
        if stored_version != version:
            raise CorruptMessage(f"weights {key} hold version {stored_version}, expected {version}")
        self.stats["loaded"] += 1
        self.stats["full_loads"] += 1
        if self.delta:
            self._held = (version, tensors, dtypes, wire_sha256(tensors))
        return _to_original(tensors, dtypes, copy=self.delta)

    def _via_deltas(self, version: int, visible: dict[int, int]) -> dict[str, torch.Tensor] | None:
        """The state dict of ``version`` from the held version and the deltas after it (``visible``:
        delta version -> bytes), or None (then the caller fetches the full version)."""
        if self._held is None or not 0 < version - self._held[0] <= self.max_delta_chain:
            return None
        held_version, tensors, dtypes, sha = self._held
        chain = range(held_version + 1, version + 1)
        if not all(v in visible for v in chain):
            self.stats["delta_fallbacks"] += 1  # pruned, or not visible yet
            return None
        try:
            full_bytes = self.transport.info(self.topic, version_key(version)).size
        except (KeyError, CorruptMessage):
            return None
        if sum(visible[v] for v in chain) >= full_bytes:
            self.stats["delta_larger"] += 1
            return None
        for step in range(held_version + 1, version + 1):
            try:
                data = self.transport.get(self.delta_topic, version_key(step))
            except (KeyError, CorruptMessage):  # pruned while reading, or damaged
                self.stats["delta_fallbacks"] += 1
                return None
            self.stats["bytes_fetched"] += len(data)
            try:
                got, tensors, dtypes, sha = apply_delta(data, tensors, sha)
            except ValueError:  # built on other bits (a republished version), or not a delta
                self.stats["delta_fallbacks"] += 1
                return None
            if got != step:
                self.stats["delta_fallbacks"] += 1
                return None
        self._held = (version, tensors, dtypes, sha)
        self.stats["loaded"] += 1
        self.stats["delta_loads"] += 1
        return _to_original(tensors, dtypes, copy=True)

    def latest(self, newer_than: int | None = None) -> tuple[int, dict[str, torch.Tensor]] | None:
        """(version, state_dict) of the newest loadable version, or None if there is none (or
        none newer than ``newer_than``). Corrupt versions are skipped and counted once each, and
        the next older one is tried; versions pruned while reading are skipped too. With deltas,
        the newest version is reached through deltas when it can be (module docstring)."""
        # deltas are listed first: through a receiver-timebase DelayChannel a key's delay starts
        # when it is first listed, and delta n must not start later than full version n
        visible: dict[int, int] = {}
        if self.delta:
            for info in self.transport.infos(self.delta_topic):
                if parse_version_key(info.key) is not None:
                    visible[parse_version_key(info.key)] = info.size
        for version in reversed(self.versions()):
            if newer_than is not None and version <= newer_than:
                return None
            if self.delta:
                state = self._via_deltas(version, visible)
                if state is not None:
                    return version, state
            try:
                return version, self.get(version)
            except (KeyError, CorruptMessage):
                continue
        return None
