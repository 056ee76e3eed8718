"""Typed rollout records: one prompt group per record, validated on arrival.

A :class:`RolloutGroup` carries everything the learner needs from a sampler for one prompt and
its G responses. Arrays are numpy (picklable, cheap to ship through Ray, no torch needed on the
wire); :meth:`RolloutGroup.to_bytes` serialises to safetensors with the scalar fields as JSON
metadata, and :meth:`RolloutGroup.as_torch` gives torch tensors for the learner.

:func:`validate_group` checks a record against a :class:`RecordSpec`; a bad record raises
:class:`RecordRejected`, which names the field, the sampler and the group uid. The buffer turns
that into a counted rejection; it never reaches the learner.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from verl_ext.hetero.safetensors_meta import read_metadata

RECORD_FORMAT = "heterorl.rollout_group/1"

_ARRAY_FIELDS = (
    "prompt_ids",
    "prompt_mask",
    "response_ids",
    "response_mask",
    "sampler_logprobs",
    "rewards",
    "advantages",
)
_SCALAR_FIELDS = (
    "group_uid",
    "policy_version",
    "sampler_id",
    "created_at",
    "extra",
    "sampler_precision",
    "sampling_seed",
    "batch_index",
    "batch_slot",
)


class RecordRejected(ValueError):
    """A rollout record failed validation. ``field`` is the offending field ("record" for
    whole-record problems such as a duplicate uid), ``reason`` a short machine-readable tag used
    as the rejection counter key, ``message`` a human explanation."""

    def __init__(self, field: str, reason: str, message: str, sampler_id: str = "?", group_uid: str = "?"):
        self.field, self.reason, self.sampler_id, self.group_uid = field, reason, sampler_id, group_uid
        super().__init__(f"rollout group {group_uid!r} from sampler {sampler_id!r}: field {field!r}: {message}")


@dataclass
class RolloutGroup:
    """One prompt and its G sampled responses.

    Shapes: P = prompt length, G = group size, R = padded response length (max over the group).

    Attributes:
        group_uid: unique id of this group across the run (e.g. ``"s3-v17-42"``); the ledger and
            the exactly-once guarantee key on it.
        prompt_ids: int64 (P,), the prompt token ids (shared by the G responses).
        prompt_mask: int8 (P,), 1 for real prompt tokens, 0 for padding.
        response_ids: int64 (G, R), response token ids, right-padded.
        response_mask: int8 (G, R), 1 for generated tokens, 0 for padding.
        sampler_logprobs: float32 (G, R), log q of each generated token under the sampler's policy
            (temperature applied); padding positions are ignored.
        rewards: float32 (G,), scalar reward per response.
        advantages: float32 (G,) per-sequence or (G, R) per-token advantages, computed by the
            sampler ("localized reward computation").
        policy_version: learner version (number of optimizer steps) of the weights that generated
            the group.
        sampler_id: which sampler produced it (string, e.g. ``"sampler-2"``).
        created_at: wall-clock seconds since the epoch when generation finished.
        extra: JSON-serialisable metadata (data source, ground truth, ...); not validated.
        sampler_precision: the arithmetic the sampler computed q in (``"fp32"`` / ``"bf16"``,
            :func:`verl_ext.trust.bounds.precision_of`); None when undeclared. Signed with the
            record; the learner's trust gate picks its log-prob tolerance by it and refuses a
            record without a known one.
        sampling_seed: the seed of the group's Gumbel-max draw (``verl_ext.trust.gumbel``: the
            learner re-derives its tokens from it); None when drawn otherwise. Signed with the
            record.
        batch_index: the sampler's claimed batch the group's prompt was assigned in (the learner
            recomputes that batch's prompts, ``verl_ext.trust.assignment``); None when unassigned.
        batch_slot: the prompt's place in that batch (0-based); None when unassigned.
    """

    group_uid: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    sampler_logprobs: np.ndarray
    rewards: np.ndarray
    advantages: np.ndarray
    policy_version: int
    sampler_id: str
    created_at: float = field(default_factory=time.time)
    prompt_mask: np.ndarray | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    sampler_precision: str | None = None
    sampling_seed: int | None = None
    batch_index: int | None = None
    batch_slot: int | None = None

    def __post_init__(self):
        # Coerce once so that torch tensors or lists from a sampler become numpy arrays; dtype
        # problems surface in validation with the field named, not here.
        for name in _ARRAY_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if hasattr(value, "detach"):  # torch tensor
                value = value.detach().cpu().numpy()
            setattr(self, name, np.asarray(value))
        if self.prompt_mask is None:
            self.prompt_mask = np.ones(self.prompt_ids.shape, dtype=np.int8)
        if isinstance(self.sampler_id, (int, np.integer)):  # engines often number their samplers
            self.sampler_id = str(self.sampler_id)

    @property
    def group_size(self) -> int:
        """G, the number of responses."""
        return int(self.response_ids.shape[0]) if self.response_ids.ndim >= 1 else 0

    @property
    def response_lengths(self) -> np.ndarray:
        """int64 (G,): generated tokens per response."""
        return self.response_mask.astype(bool).sum(axis=-1).astype(np.int64)

    def staleness(self, learner_version: int) -> int:
        """Learner versions between the generating policy and ``learner_version``."""
        return int(learner_version) - int(self.policy_version)

    def to_bytes(self) -> bytes:
        """Serialise to safetensors; scalar fields travel as JSON in the header metadata."""
        tensors = {name: np.ascontiguousarray(getattr(self, name)) for name in _ARRAY_FIELDS}
        meta = {
            "group_uid": self.group_uid,
            "policy_version": int(self.policy_version),
            "sampler_id": str(self.sampler_id),
            "created_at": float(self.created_at),
            "extra": self.extra,
        }
        if self.sampler_precision is not None:  # absent = undeclared (a record from before it existed)
            meta["sampler_precision"] = str(self.sampler_precision)
        if self.sampling_seed is not None:  # absent = not drawn by seeded Gumbel-max
            meta["sampling_seed"] = int(self.sampling_seed)
        for name in ("batch_index", "batch_slot"):  # absent = unassigned
            if getattr(self, name) is not None:
                meta[name] = int(getattr(self, name))
        return st_save(tensors, metadata={"format": RECORD_FORMAT, "record": json.dumps(meta)})

    @classmethod
    def from_bytes(cls, data: bytes) -> "RolloutGroup":
        """Inverse of :meth:`to_bytes`. Raises ValueError, and only ValueError, on bytes that are
        not a rollout group (any bytes: a sampler may send anything)."""
        try:
            tensors = st_load(data)
            meta_block = read_metadata(data)
        except Exception as err:  # safetensors raises several types for garbage input
            raise ValueError(f"not a safetensors rollout group: {err}") from None
        if meta_block.get("format") != RECORD_FORMAT:
            raise ValueError(f"not a rollout group: format={meta_block.get('format')!r}, expected {RECORD_FORMAT!r}")
        try:
            meta = json.loads(meta_block["record"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a rollout group: its record metadata does not parse ({err})") from None
        if not isinstance(meta, dict) or not set(meta) <= set(_SCALAR_FIELDS):
            raise ValueError(f"not a rollout group: record metadata {str(meta)[:200]!r} has unknown or no fields")
        missing = [name for name in _ARRAY_FIELDS if name not in tensors]
        if missing or not set(tensors) <= set(_ARRAY_FIELDS):
            raise ValueError(f"not a rollout group: arrays {sorted(tensors)}, expected {list(_ARRAY_FIELDS)}")
        try:
            return cls(**{name: tensors[name] for name in _ARRAY_FIELDS}, **meta)
        except TypeError as err:  # a required scalar field missing
            raise ValueError(f"not a rollout group: {err}") from None

    def as_torch(self) -> dict[str, Any]:
        """Arrays as torch tensors (int64 ids, bool masks, float32 values) plus the scalar fields."""
        import torch

        out: dict[str, Any] = {
            name: torch.from_numpy(np.ascontiguousarray(getattr(self, name))) for name in _ARRAY_FIELDS
        }
        out["prompt_mask"] = out["prompt_mask"].bool()
        out["response_mask"] = out["response_mask"].bool()
        out.update({name: getattr(self, name) for name in _SCALAR_FIELDS})
        return out

    def nbytes(self) -> int:
        """Bytes held by the arrays (for queue-size accounting)."""
        return int(sum(getattr(self, name).nbytes for name in _ARRAY_FIELDS))


@dataclass(frozen=True)
class RecordSpec:
    """What a valid rollout group looks like.

    Attributes:
        group_size: G every group must have; None accepts any G >= 1.
        allow_empty_responses: accept responses with zero generated tokens (their length-normalised
            log-prob is undefined, so the default rejects them).
        reward_range: (min, max) inclusive bounds on rewards; None checks only finiteness.
        logprob_tolerance: how far above 0 a log-prob may be before rejection (float rounding in
            fp16/bf16 samplers produces tiny positive values).
        vocab_size: token ids must lie in [0, vocab_size) (the learner's embedding rows); None:
            only >= 0.
        max_prompt_length / max_response_length: bounds on P and R; None: unbounded.
    """

    group_size: int | None = None
    allow_empty_responses: bool = False
    reward_range: tuple[float, float] | None = None
    logprob_tolerance: float = 1e-4
    vocab_size: int | None = None
    max_prompt_length: int | None = None
    max_response_length: int | None = None

    def __post_init__(self):
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"RecordSpec: group_size={self.group_size} must be >= 1")
        if self.reward_range is not None and not self.reward_range[0] <= self.reward_range[1]:
            raise ValueError(f"RecordSpec: reward_range={self.reward_range} must have min <= max")
        if not self.logprob_tolerance >= 0:
            raise ValueError(f"RecordSpec: logprob_tolerance={self.logprob_tolerance} must be >= 0")
        for name in ("vocab_size", "max_prompt_length", "max_response_length"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"RecordSpec: {name}={value} must be >= 1")


SEED_LIMIT = 2**63
"""Gumbel seeds and policy versions lie in [0, SEED_LIMIT) (numpy's and torch's int64)."""


def validate_group(group: Any, spec: RecordSpec = RecordSpec(), learner_version: int | None = None) -> None:
    """Raise :class:`RecordRejected` if ``group`` is not a valid :class:`RolloutGroup`.

    Checks: type; uid non-empty; array dtypes; shapes agree (prompt (P,), responses (G, R),
    rewards (G,), advantages (G,) or (G, R)); masks are 0/1; group size as configured; no empty
    responses unless allowed; log-probs finite and <= tolerance on generated tokens; rewards and
    advantages finite (rewards within ``spec.reward_range``); token ids in [0, ``spec.vocab_size``),
    P and R within the spec's bounds; ``policy_version`` an int in [0, 2^63) and not newer than
    ``learner_version`` (when given); ``sampler_id`` / ``sampler_precision`` strings, ``extra`` a
    dict, ``sampling_seed``, ``batch_index`` and ``batch_slot`` None or ints in [0, 2^63). Never
    raises anything but RecordRejected.
    """
    if not isinstance(group, RolloutGroup):
        raise RecordRejected("record", "type", f"expected RolloutGroup, got {type(group).__name__}")
    sampler, uid = str(getattr(group, "sampler_id", "?")), str(getattr(group, "group_uid", "?"))

    def reject(field_name: str, reason: str, message: str):
        raise RecordRejected(field_name, reason, message, sampler_id=sampler, group_uid=uid)

    if not isinstance(group.group_uid, str) or not group.group_uid:
        reject("group_uid", "uid", f"must be a non-empty string, got {group.group_uid!r}")
    if not isinstance(group.sampler_id, str) or not group.sampler_id:
        reject("sampler_id", "sampler_id", f"must be a non-empty string, got {str(group.sampler_id)[:80]!r}")
    if isinstance(group.policy_version, bool) or not isinstance(group.policy_version, (int, np.integer)):
        reject("policy_version", "version", f"must be an int, got {group.policy_version!r}")
    if not 0 <= group.policy_version < SEED_LIMIT:
        reject("policy_version", "version", f"{group.policy_version} must be in [0, 2^63)")
    if (
        isinstance(group.created_at, bool)
        or not isinstance(group.created_at, (int, float))
        or not math.isfinite(group.created_at)
    ):
        reject("created_at", "created_at", f"must be a finite number of seconds, got {group.created_at!r}")
    if group.sampler_precision is not None and not isinstance(group.sampler_precision, str):
        reject("sampler_precision", "precision", f"must be a string, got {str(group.sampler_precision)[:80]!r}")
    seed = group.sampling_seed
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < SEED_LIMIT
    ):
        reject("sampling_seed", "seed", f"must be None or an int in [0, 2^63), got {str(seed)[:80]!r}")
    for name in ("batch_index", "batch_slot"):
        value = getattr(group, name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < SEED_LIMIT
        ):
            reject(name, "assignment", f"must be None or an int in [0, 2^63), got {str(value)[:80]!r}")
    if not isinstance(group.extra, dict):
        reject("extra", "extra", f"must be a dict, got {type(group.extra).__name__}")
    for name in _ARRAY_FIELDS:
        if not isinstance(getattr(group, name), np.ndarray):
            reject(name, "type", f"must be an array, got {type(getattr(group, name)).__name__}")

    for name in ("prompt_ids", "response_ids", "prompt_mask", "response_mask"):
        if not (np.issubdtype(getattr(group, name).dtype, np.integer) or getattr(group, name).dtype == np.bool_):
            reject(name, "dtype", f"dtype {getattr(group, name).dtype} must be an integer type")
    for name in ("sampler_logprobs", "rewards", "advantages"):
        if not np.issubdtype(getattr(group, name).dtype, np.floating):
            reject(name, "dtype", f"dtype {getattr(group, name).dtype} must be a floating type")

    if group.prompt_ids.ndim != 1 or group.prompt_ids.shape[0] == 0:
        reject("prompt_ids", "shape", f"shape {group.prompt_ids.shape} must be (P,) with P >= 1")
    if group.prompt_mask.shape != group.prompt_ids.shape:
        reject("prompt_mask", "shape", f"shape {group.prompt_mask.shape} != prompt_ids {group.prompt_ids.shape}")
    if group.response_ids.ndim != 2:
        reject("response_ids", "shape", f"shape {group.response_ids.shape} must be (G, R)")
    G, R = group.response_ids.shape
    for name in ("response_mask", "sampler_logprobs"):
        if getattr(group, name).shape != (G, R):
            reject(name, "shape", f"shape {getattr(group, name).shape} != response_ids {(G, R)}")
    if group.rewards.shape != (G,):
        reject("rewards", "shape", f"shape {group.rewards.shape} must be (G,) = {(G,)}")
    if group.advantages.shape not in ((G,), (G, R)):
        reject("advantages", "shape", f"shape {group.advantages.shape} must be (G,) = {(G,)} or (G, R) = {(G, R)}")

    for name in ("prompt_mask", "response_mask"):
        values = getattr(group, name)
        if not ((values == 0) | (values == 1)).all():  # np.isin's 30 us a call, on every group read
            reject(name, "mask", "must contain only 0 and 1")
    if G < 1:
        reject("response_ids", "group_size", "group has no responses")
    if R < 1:
        reject("response_ids", "shape", f"shape {(G, R)}: responses have no positions")
    for name, length, bound in (
        ("prompt_ids", group.prompt_ids.shape[0], spec.max_prompt_length),
        ("response_ids", R, spec.max_response_length),
    ):
        if bound is not None and length > bound:
            reject(name, "too_long", f"length {length} > {bound}")
    for name in ("prompt_ids", "response_ids"):
        ids = getattr(group, name)
        if (ids < 0).any() or (spec.vocab_size is not None and (ids >= spec.vocab_size).any()):
            reject(name, "token_id", f"ids in [{int(ids.min())}, {int(ids.max())}] outside [0, {spec.vocab_size})")
    if spec.group_size is not None and G != spec.group_size:
        reject("response_ids", "group_size", f"group size {G} != configured group_size {spec.group_size}")
    lengths = group.response_lengths
    if not spec.allow_empty_responses and (lengths == 0).any():
        reject("response_mask", "empty_response", f"responses {np.flatnonzero(lengths == 0).tolist()} have no tokens")

    generated = group.response_mask.astype(bool)
    logprobs = group.sampler_logprobs[generated]
    if not np.isfinite(logprobs).all():
        reject("sampler_logprobs", "nonfinite_logprob", f"{int((~np.isfinite(logprobs)).sum())} non-finite values")
    if logprobs.size and logprobs.max() > spec.logprob_tolerance:
        reject("sampler_logprobs", "positive_logprob", f"max {float(logprobs.max()):.4g} > 0: not a log-probability")
    if not np.isfinite(group.rewards).all():
        reject("rewards", "nonfinite_reward", "contains NaN or Inf")
    if spec.reward_range is not None:
        low, high = spec.reward_range
        if group.rewards.min() < low or group.rewards.max() > high:
            reject(
                "rewards",
                "reward_range",
                f"values in [{float(group.rewards.min()):.4g}, {float(group.rewards.max()):.4g}] "
                f"outside reward_range [{low}, {high}]",
            )
    advantages = group.advantages if group.advantages.ndim == 1 else group.advantages[generated]
    if not np.isfinite(advantages).all():
        reject("advantages", "nonfinite_advantage", "contains NaN or Inf")
    # last: what is wrong with the record itself is reported before what is wrong with its timing
    if learner_version is not None and group.policy_version > learner_version:
        reject(
            "policy_version",
            "future_version",
            f"{group.policy_version} is newer than the learner's version {learner_version}",
        )
