"""Heterogeneity core, engine-agnostic: delay models and the one delay schedule, rollout records,
the staleness rule and the staleness-bounded buffer, versioned weights, transports, the delay
channel, the async wire protocol and the run's seeds. See docs/heterogeneity.md.

Names are imported lazily (PEP 562), so ``import verl_ext.hetero.delay`` does not pay for torch
or Ray.
"""

import importlib

_EXPORTS = {
    "buffer": ["BufferTimeout", "Ledger", "RolloutBuffer", "make_buffer_actor"],
    "delay": ["DelayModel", "DelaySchedule", "DelaySummary", "make_delay_model", "to_steps"],
    "delay_channel": ["DelayChannel"],
    "exchange": ["RolloutInbox", "send_group"],
    "protocol": ["Announcement", "LearnerStatus", "TransportSpec"],
    "records": ["RecordRejected", "RecordSpec", "RolloutGroup", "validate_group"],
    "staleness": ["is_stale", "staleness_metrics"],
    "transport": ["CorruptMessage", "FsspecTransport", "MessageInfo", "RayTransport", "Transport", "make_transport"],
    "weights": ["WeightStore"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name):
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"verl_ext.hetero.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module 'verl_ext.hetero' has no attribute {name!r}")
