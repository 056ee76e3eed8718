"""Versioned policy weights over a transport.

The learner calls ``publish(version, state_dict)`` after each update (or every k updates);
samplers poll ``latest_version()`` and load ``latest()`` or ``get(version)``. Only the last
``keep_last`` versions are kept. The state dict travels as safetensors bytes; the transport
adds a SHA-256 checksum that is verified on every load, so a half-written or corrupted version
is skipped (counted in ``stats["corrupt"]``), never loaded. With ``wire_dtype="bf16"`` floating
tensors are sent as bfloat16 (half the bytes) and cast back to their original dtype on load.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Mapping

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from verl_ext.hetero.protocol import WEIGHTS_TOPIC
from verl_ext.hetero.safetensors_meta import read_metadata
from verl_ext.hetero.transport import CorruptMessage, Transport

WEIGHTS_FORMAT = "heterorl.weights/1"
WIRE_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def version_key(version: int) -> str:
    """Transport key of a version; zero-padded so lexical order is numeric order."""
    return f"v{version:010d}"


def _parse_key(key: str) -> int | None:
    if len(key) == 11 and key[0] == "v" and key[1:].isdigit():
        return int(key[1:])
    return None


def serialize_state_dict(state_dict: Mapping[str, torch.Tensor], version: int, wire_dtype: str | None = None) -> bytes:
    """safetensors bytes of ``state_dict`` (CPU, contiguous); the original dtypes and the version
    ride in the metadata so :func:`deserialize_state_dict` restores them."""
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
    metadata = {"format": WEIGHTS_FORMAT, "version": str(int(version)), "dtypes": json.dumps(dtypes)}
    return st_save(tensors, metadata=metadata)


def deserialize_state_dict(data: bytes) -> tuple[int, dict[str, torch.Tensor]]:
    """Inverse of :func:`serialize_state_dict`: (version, state_dict in the original dtypes)."""
    metadata = read_metadata(data)
    if metadata.get("format") != WEIGHTS_FORMAT:
        raise ValueError(f"not a weights message: format={metadata.get('format')!r}, expected {WEIGHTS_FORMAT!r}")
    dtypes = json.loads(metadata["dtypes"])
    tensors = st_load(data)
    return int(metadata["version"]), {name: tensors[name].to(getattr(torch, dtypes[name])) for name in tensors}


class WeightStore:
    """Publish and fetch versioned state dicts through a :class:`Transport`.

    Args:
        transport: where versions live (any Transport, or a DelayChannel wrapping one so each
            sampler sees a version only after its drawn delay).
        keep_last: K, how many most recent versions the publisher keeps; older ones are deleted
            after each publish (>= 1).
        wire_dtype: None (as is), "fp32", "bf16" or "fp16": dtype floating tensors travel in.
        topic: transport topic for weights.
    """

    def __init__(self, transport: Transport, keep_last: int = 2, wire_dtype: str | None = None,
                 topic: str = WEIGHTS_TOPIC):
        if keep_last < 1:
            raise ValueError(f"WeightStore: keep_last={keep_last} must be >= 1")
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"WeightStore: wire_dtype={wire_dtype!r} must be one of {list(WIRE_DTYPES)}")
        self.transport, self.keep_last, self.wire_dtype, self.topic = transport, keep_last, wire_dtype, topic
        self.stats: Counter[str] = Counter()
        self._bad: set[tuple[int, str]] = set()  # (version, sha256) already counted as corrupt

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Store ``state_dict`` as ``version`` (int >= 0), then delete versions older than the
        newest ``keep_last``. Publishing an existing version replaces it."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"WeightStore.publish: version={version!r} must be an int >= 0")
        self.transport.put(self.topic, version_key(version), serialize_state_dict(state_dict, version, self.wire_dtype))
        self.stats["published"] += 1
        for old in self.versions()[: -self.keep_last]:
            self.transport.delete(self.topic, version_key(old))

    def versions(self) -> list[int]:
        """Committed (and, through a DelayChannel, visible) versions, ascending."""
        return sorted(v for v in map(_parse_key, self.transport.keys(self.topic)) if v is not None)

    def latest_version(self) -> int | None:
        """Newest committed version, or None; cheap (lists keys, loads nothing)."""
        versions = self.versions()
        return versions[-1] if versions else None

    def get(self, version: int) -> dict[str, torch.Tensor]:
        """The state dict of ``version``. KeyError if absent (never published, pruned, or not
        yet visible); :class:`CorruptMessage` if it fails its checksum."""
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
        stored_version, state = deserialize_state_dict(data)
        if stored_version != version:
            raise CorruptMessage(f"weights {key} hold version {stored_version}, expected {version}")
        self.stats["loaded"] += 1
        return state

    def latest(self, newer_than: int | None = None) -> tuple[int, dict[str, torch.Tensor]] | None:
        """(version, state_dict) of the newest loadable version, or None if there is none (or
        none newer than ``newer_than``). Corrupt versions are skipped and counted once each, and
        the next older one is tried; versions pruned while reading are skipped too."""
        for version in reversed(self.versions()):
            if newer_than is not None and version <= newer_than:
                return None
            try:
                return version, self.get(version)
            except (KeyError, CorruptMessage):
                continue
        return None
