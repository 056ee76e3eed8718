"""Heterogeneity core, engine-agnostic: delay models, rollout records, the staleness-bounded
buffer, versioned weights, transports and the delay channel. See docs/heterogeneity.md."""

from verl_ext.hetero.buffer import BufferTimeout, Ledger, RolloutBuffer, make_buffer_actor
from verl_ext.hetero.delay import (
    DelayModel,
    DelaySummary,
    SamplerDelays,
    make_delay_model,
    sampler_rngs,
)
from verl_ext.hetero.delay_channel import DelayChannel
from verl_ext.hetero.exchange import RolloutInbox, send_group
from verl_ext.hetero.records import RecordRejected, RecordSpec, RolloutGroup, validate_group
from verl_ext.hetero.transport import (
    CorruptMessage,
    FsspecTransport,
    MessageInfo,
    RayTransport,
    Transport,
    make_transport,
)
from verl_ext.hetero.weights import WeightStore

__all__ = [
    "BufferTimeout", "CorruptMessage", "DelayChannel", "DelayModel", "DelaySummary", "FsspecTransport",
    "Ledger", "MessageInfo", "RayTransport", "RecordRejected", "RecordSpec", "RolloutBuffer", "RolloutGroup",
    "RolloutInbox", "SamplerDelays", "Transport", "WeightStore", "make_buffer_actor", "make_delay_model",
    "make_transport", "sampler_rngs", "send_group", "validate_group",
]
