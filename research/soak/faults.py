"""The fault kinds of the soak (see ``research/soak/__main__.py``), how often each is drawn, and how each
damages a message: files written straight into the fs transport's exchange folder (a transport
fault, on purpose: ``<exchange>/<topic>/<key>.msg`` + the ``<key>.ok`` commit marker, see
``verl_ext/hetero/transport.py``) and rollout groups edited to be rejected by a named reason."""

from __future__ import annotations

import json
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from verl_ext.hetero.protocol import SAMPLER_ACTOR_PREFIX
from verl_ext.hetero.records import RolloutGroup
from verl_ext.hetero.transport import COMMIT_SUFFIX, DATA_SUFFIX, TEMP_PREFIX, checksum

# sampler uids: "s<i>-b<batch>-<j>", or "s<i>-<launch id>-b<batch>-<j>" when the engine namespaces
# each sampler launch; everything the injector writes starts with "fault-"
SAMPLER_UID = re.compile(r"^s\d+-(?:[0-9A-Za-z]+-)?b\d+-\d+$")
# the lying samplers' uids (--liars, research/soak/liars.py): "sampler-<i>-<lie>-liars-b<batch>-<j>"
LIAR_UID = re.compile(r"^sampler-\d+-[a-z]+-liars-b\d+-\d+$")
SAMPLER_ACTOR = re.compile(rf"^{re.escape(SAMPLER_ACTOR_PREFIX)}(\d+)-(\d+)$")

# fault kind -> relative frequency (learner_crash is scheduled separately)
FAULT_WEIGHTS = {
    "sampler_kill": 3.0,
    "rollout_half_written": 1.0,
    "rollout_truncated": 1.0,
    "rollout_corrupt": 1.0,
    "weights_half_written": 0.7,
    "weights_truncated": 0.7,
    "weights_corrupt": 0.7,
    "duplicate_message": 1.0,
    "duplicate_other_key": 0.5,
    "future_version": 1.0,
    "bad_nonfinite_logprob": 0.6,
    "bad_positive_logprob": 0.6,
    "bad_group_size": 0.6,
    "bad_empty_response": 0.6,
    "bad_nonfinite_reward": 0.6,
    "bad_reward_range": 0.6,
    "clock_skew_rollout": 0.8,
    "clock_skew_weights": 0.6,
}
# --wan: the fs transport's file-level faults cannot be injected into Ray's object store
FS_ONLY = {k for k in FAULT_WEIGHTS if k.startswith(("rollout_", "weights_"))}
WAN_FAULT_WEIGHTS = {"link_cut": 3.0, "link_slow": 3.0, "worker_gone": 4.0}  # ~40% of the faults
# bad-group kind -> the ledger's rejection reason it must produce
BAD_REASON = {
    "bad_nonfinite_logprob": "nonfinite_logprob",
    "bad_positive_logprob": "positive_logprob",
    "bad_group_size": "group_size",
    "bad_empty_response": "empty_response",
    "bad_nonfinite_reward": "nonfinite_reward",
    "bad_reward_range": "reward_range",
    "future_version": "future_version",
}


@dataclass
class Fault:
    kind: str
    at: float  # seconds since the soak started
    key: str = ""  # transport key / uid / actor name it concerns
    detail: dict[str, Any] = field(default_factory=dict)
    outcome: str = "pending"  # survived | NOT SURVIVED: ... | not judged: ...


def fault_weights(wan: bool) -> dict[str, float]:
    """The kinds to draw from: all of :data:`FAULT_WEIGHTS`, or across the link (``--wan``) those
    not tied to the fs transport plus the network faults."""
    if not wan:
        return dict(FAULT_WEIGHTS)
    return {**{k: v for k, v in FAULT_WEIGHTS.items() if k not in FS_ONLY}, **WAN_FAULT_WEIGHTS}


# --------------------------------------------------------------------------- bad groups
def _first_generated(group: RolloutGroup) -> tuple[int, int]:
    r0, c0 = np.argwhere(group.response_mask.astype(bool))[0]
    return int(r0), int(c0)


def _set_logprob(value: float) -> Callable[[RolloutGroup], None]:
    def edit(group: RolloutGroup) -> None:
        group.sampler_logprobs = group.sampler_logprobs.copy()
        group.sampler_logprobs[_first_generated(group)] = value

    return edit


def _drop_last_response(group: RolloutGroup) -> None:
    for name in ("response_ids", "response_mask", "sampler_logprobs", "rewards", "advantages"):
        setattr(group, name, getattr(group, name)[:-1].copy())


def _empty_first_response(group: RolloutGroup) -> None:
    group.response_mask = group.response_mask.copy()
    group.response_mask[0, :] = 0


def _set_first_reward(value: float) -> Callable[[RolloutGroup], None]:
    def edit(group: RolloutGroup) -> None:
        group.rewards = group.rewards.copy()
        group.rewards[0] = value

    return edit


# bad-group kind (but future_version, which needs the latest weights) -> its edit, in place
BAD_GROUP_EDITS: dict[str, Callable[[RolloutGroup], None]] = {
    "bad_nonfinite_logprob": _set_logprob(np.nan),
    "bad_positive_logprob": _set_logprob(0.7),
    "bad_group_size": _drop_last_response,
    "bad_empty_response": _empty_first_response,
    "bad_nonfinite_reward": _set_first_reward(np.inf),
    "bad_reward_range": _set_first_reward(100.0),
}


# --------------------------------------------------------------------------- damaged files
class ExchangeDamage:
    """Damaged messages written straight into the fs transport's exchange folder, bypassing the
    transport: a temporary or an uncommitted payload (``half_written``), a committed payload
    shorter than its marker says (``truncated``), one whose bytes do not match the marker's
    SHA-256 (``corrupt``). None of them may ever be loaded."""

    def __init__(self, exchange: Path, rng: random.Random):
        self.exchange, self.rng = exchange, rng

    def write(self, topic: str, key: str, payload: bytes, damage: str, nonce: int) -> dict:
        """Leave ``payload`` under (topic, key) ``half_written``, ``truncated`` or ``corrupt``;
        returns what to add to the fault's detail."""
        if damage == "half_written":
            return {"variant": self._half_written(topic, key, payload, nonce)}
        data = payload[: len(payload) // 2] if damage == "truncated" else self._corrupt(payload)
        self._write_raw(topic, key, data, len(payload), checksum(payload))
        return {}

    def _folder(self, topic: str) -> Path:
        folder = self.exchange / topic
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _write_raw(self, topic: str, key: str, payload: bytes, committed_size: int, sha: str) -> None:
        """A committed message whose marker does not match its payload (truncated / corrupt)."""
        folder = self._folder(topic)
        (folder / f"{key}{DATA_SUFFIX}").write_bytes(payload)
        marker = {"topic": topic, "key": key, "size": committed_size, "sha256": sha, "sent_at": time.time()}
        (folder / f"{key}{COMMIT_SUFFIX}").write_text(json.dumps(marker))

    def _half_written(self, topic: str, key: str, payload: bytes, nonce: int) -> str:
        folder = self._folder(topic)
        cut = payload[: max(1, len(payload) // 2)]
        if self.rng.random() < 0.5:  # killed while writing the temporary
            (folder / f"{TEMP_PREFIX}{key}{DATA_SUFFIX}.{nonce:08x}").write_bytes(cut)
            return "temporary"
        (folder / f"{key}{DATA_SUFFIX}").write_bytes(payload)  # killed before the commit marker
        return "uncommitted"

    def _corrupt(self, payload: bytes) -> bytes:
        data = bytearray(payload)
        for _ in range(8):
            i = self.rng.randrange(len(data))
            data[i] ^= 0xFF
        return bytes(data)
