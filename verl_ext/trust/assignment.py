"""Work the learner assigns: which prompt fills slot k of a sampler's batch b, and the seed it is drawn with.

A sampler claims batch b; its prompts are a pure function of (run seed, :func:`prompt_stream` of the
sampler, b), so the learner's rewards check holds each group to the prompt of the slot its signed
record names (``prompt_not_assigned``), not to any training prompt. Under checkable sampling a
group's Gumbel seed is :func:`assigned_seed`: an HMAC of (sampler, b, k, version) under a key the
learner derives from its secret and publishes (:func:`gumbel_key`), so a sampler cannot draw a
prompt with several seeds and send the best draw; the gate also takes one group per slot
(``slot_reused``). What is left to a sampler: withholding a draw it does not like
(docs/reliability.md, "Seeds and prompts the learner assigns").
"""

from __future__ import annotations

import hashlib
import hmac
import zlib

from verl_ext.hetero.records import SEED_LIMIT
from verl_ext.hetero.seeding import MAX_SAMPLERS

GUMBEL_KEY_LABEL = b"heterorl gumbel seeds v1"
"""What the learner's secret is keyed with to make the published seed key (the secret stays hidden)."""

_NAMED_PREFIXES = ("sampler-", "pool-")
"""Ids whose number picks their stream: the embedded engine's samplers and the verl engine's pools."""


def gumbel_key(secret: bytes) -> bytes:
    """The seed key the learner publishes (32 bytes): HMAC-SHA256 of a fixed label under its secret.
    Knowing it tells nothing of the secret (which keys the draw of groups to re-score)."""
    return hmac.new(bytes(secret), GUMBEL_KEY_LABEL, hashlib.sha256).digest()


def assigned_seed(key: bytes, sampler_id: str, batch: int, slot: int, version: int) -> int:
    """The Gumbel seed of slot ``slot`` of ``sampler_id``'s batch ``batch`` drawn with weight version
    ``version`` (an int in [0, 2^63)). Fixed by those four: no choice is left to the sampler."""
    message = f"{sampler_id}\x00{int(batch)}\x00{int(slot)}\x00{int(version)}".encode()
    digest = hmac.new(bytes(key), message, hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "little") % SEED_LIMIT


def prompt_stream(sampler_id: str) -> int:
    """The stream of ``sampler_id``'s prompts: ``sampler-i`` / ``pool-i`` (i < 64) draw from stream
    i + 1, as they always have; any other id from a fixed hash of it, past every such stream."""
    for prefix in _NAMED_PREFIXES:
        number = str(sampler_id)[len(prefix) :]
        canonical = number.isascii() and number.isdigit() and str(int(number)) == number
        if str(sampler_id).startswith(prefix) and canonical and int(number) < MAX_SAMPLERS:
            return int(number) + 1
    return MAX_SAMPLERS + 1 + zlib.crc32(str(sampler_id).encode())
