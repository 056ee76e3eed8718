"""``checkpoint_engine.backend=ray_mailbox``: weight sync to standalone rollout replicas without NCCL.

verl moves the learner's weights to a disaggregated rollout pool (``hybrid_engine=false``) with a
checkpoint engine; every engine in verl 0.9.1 needs GPUs or RDMA (nccl, nixl, mooncake, hccl,
kimi). This one runs anywhere Ray does: the actor's rank 0 puts one version's full weights into
Ray's object store and posts the reference in a mailbox actor; every rollout worker takes it from
there. All actor ranks iterate the weights (FSDP gathers them collectively); only rank 0 sends.

Cost: one copy of the weights in the object store per sync (freed at ``finalize``); fine for the
CPU toy and for debugging, not a replacement for NCCL on a GPU cluster.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncGenerator, Generator

import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

BACKEND = "ray_mailbox"
MAILBOX_NAME = "heterorl_weight_mailbox"


@ray.remote(num_cpus=0)
class WeightMailbox:
    """Holds, per sync key, a list with one object reference to a ``{name: tensor}`` dict."""

    def __init__(self):
        self._slots: dict[str, list] = {}
        self._events: dict[str, asyncio.Event] = {}

    def _event(self, key: str) -> asyncio.Event:
        return self._events.setdefault(key, asyncio.Event())

    async def put(self, key: str, boxed_ref: list) -> None:
        self._slots[key] = boxed_ref
        self._event(key).set()

    async def get(self, key: str, timeout_s: float) -> list:
        try:
            await asyncio.wait_for(self._event(key).wait(), timeout_s)
        except asyncio.TimeoutError:
            if key not in self._slots:
                self._events.pop(key, None)
            raise
        return self._slots[key]

    async def drop(self, key: str) -> None:
        self._slots.pop(key, None)
        self._events.pop(key, None)

    async def keys(self) -> list[str]:
        return sorted(self._slots)


_MAILBOX = None


def _mailbox():
    """The named mailbox, held by this process for its lifetime: a temporary handle would let Ray
    collect the actor (and the weights in it) before a late receiver asks for them."""
    global _MAILBOX
    if _MAILBOX is None:
        _MAILBOX = WeightMailbox.options(name=MAILBOX_NAME, get_if_exists=True).remote()
    return _MAILBOX


@CheckpointEngineRegistry.register(BACKEND)
class RayMailboxCheckpointEngine(CheckpointEngine):
    """Actor rank 0 -> Ray object store -> every rollout worker.

    Args:
        bucket_size: verl passes its bucket size; unused (the whole version is one object).
        is_master: True on the actor's rank 0 (the sender).
        timeout_s: how long a rollout worker waits for the weights of a sync.
    """

    def __init__(self, bucket_size: int = 0, is_master: bool = False, timeout_s: float = 600.0, **_: Any):
        self.is_master, self.timeout_s = is_master, float(timeout_s)
        self.key: str | None = None
        self.role = "sender" if is_master else "unset"
        self._ref = None

    def prepare(self) -> dict[str, Any]:
        return {"key": uuid.uuid4().hex} if self.is_master else {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        key = metadata[0].get("key")
        if key is None:
            raise RuntimeError("ray_mailbox: the actor's rank 0 did not prepare a sync key")
        actor = {"role": ["sender"] + ["gatherer"] * (actor_wg_world_size - 1), "key": [key] * actor_wg_world_size}
        rollout = {"role": ["receiver"] * rollout_world_size, "key": [key] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, role: str, key: str) -> None:
        self.role, self.key = role, key

    async def send_weights(
        self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: int | None = None
    ):
        start = time.perf_counter()
        named: dict[str, torch.Tensor] = {}
        async for name, tensor in ensure_async_iterator(weights):  # every rank: FSDP gathers collectively
            if self.role == "sender":
                named[name] = tensor.detach().to("cpu", copy=True)
        if self.role != "sender":
            return {}
        self._ref = ray.put(named)
        await _mailbox().put.remote(self.key, [self._ref])
        nbytes = sum(t.numel() * t.element_size() for t in named.values())
        return {"perf/weight_sync_bytes": float(nbytes), "perf/weight_sync_send_s": time.perf_counter() - start}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        if self.role != "receiver":
            raise RuntimeError(f"ray_mailbox: receive_weights on a {self.role!r} worker")
        boxed = await _mailbox().get.remote(self.key, self.timeout_s)
        named = await boxed[0]
        for name, tensor in named.items():
            yield name, tensor

    def finalize(self) -> None:
        if self.role == "sender" and self.key is not None:
            ray.get(_mailbox().drop.remote(self.key))
        self._ref, self.key = None, None
