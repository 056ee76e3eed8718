"""The ``__metadata__`` of safetensors bytes: the one place that reads the header by hand (the
``safetensors`` package loads tensors from bytes but returns no metadata). Weights and rollout
records both carry their format tag and scalar fields there."""

from __future__ import annotations

import json


def read_metadata(data: bytes) -> dict[str, str]:
    """``__metadata__`` of safetensors ``data`` ({} when the header has none).

    Layout: 8 bytes little-endian header length N, then N bytes of JSON, then the tensor data.
    Raises ValueError naming what is wrong when ``data`` cannot hold such a header."""
    if len(data) < 8:
        raise ValueError(f"not safetensors bytes: {len(data)} bytes, shorter than the 8-byte header length")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > len(data) - 8:
        raise ValueError(
            f"not safetensors bytes: header length {header_len} exceeds the {len(data) - 8} bytes after it"
        )
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"not safetensors bytes: header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"not safetensors bytes: header is a {type(header).__name__}, not a JSON object")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"not safetensors bytes: __metadata__ is a {type(metadata).__name__}, not a JSON object")
    return metadata
