"""The safetensors header is read in one place: ``read_metadata`` gives what
the library wrote, and names what is wrong with bytes that are not safetensors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save as st_save

from verl_ext.hetero.safetensors_meta import read_metadata
from verl_ext.hetero.weights import WEIGHTS_FORMAT, deserialize_state_dict, serialize_state_dict


def test_reads_what_safetensors_wrote():
    data = st_save({"w": torch.ones(2, 3)}, metadata={"format": "x", "n": "7"})
    assert read_metadata(data) == {"format": "x", "n": "7"}
    assert read_metadata(st_save({"w": torch.ones(1)})) == {}
    assert read_metadata(serialize_state_dict({"w": torch.ones(1)}, version=4))["format"] == WEIGHTS_FORMAT


@pytest.mark.parametrize(
    "data, why",
    [
        (b"\x01\x00", "shorter than the 8-byte header length"),
        ((100).to_bytes(8, "little") + b"{}", "header length 100 exceeds the 2 bytes"),
        ((10).to_bytes(8, "little") + b"{not json}", "header is not JSON"),
        ((2).to_bytes(8, "little") + b"[]", "header is a list"),
        ((21).to_bytes(8, "little") + b'{"__metadata__": [1]}', "__metadata__ is a list"),
    ],
)
def test_bad_bytes_are_named(data, why):
    with pytest.raises(ValueError, match=why):
        read_metadata(data)


def test_weights_refuse_other_safetensors_bytes():
    with pytest.raises(ValueError, match="not a weights message"):
        deserialize_state_dict(st_save({"w": torch.ones(1)}, metadata={"format": "other"}))
    version, state = deserialize_state_dict(
        serialize_state_dict({"w": torch.arange(3.0)}, version=5, wire_dtype="bf16")
    )
    assert version == 5 and torch.equal(state["w"], torch.arange(3.0))
