"""``checkpoint_engine.backend=ray_mailbox`` (verl_ext/cpu/checkpoint_engine.py) over a real local Ray.

Two Ray actors each hold a ``RayMailboxCheckpointEngine`` -- the actor's rank 0 (sender) and one
rollout worker (receiver) -- and are driven in the order verl's ``CheckpointEngineManager`` uses
(``verl/checkpoint_engine/base.py``: prepare on all, ``build_topology``, ``init_process_group``
with the per-rank kwargs, ``send_weights`` and ``receive_weights`` concurrently, ``finalize``).

What is pinned: the receiver gets exactly the sender's names and tensors (dtypes included), the
sender reports the bytes it sent, finalize leaves no key in the mailbox actor, a receiver whose
weights never come fails with a timeout after ``timeout_s``, and the topology/role rules. A
receiver that asks after the send still gets the weights (the mailbox outlives the sync).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import ray
import torch

from verl_ext.cpu import checkpoint_engine
from verl_ext.cpu.checkpoint_engine import MAILBOX_NAME, RayMailboxCheckpointEngine

NAMESPACE = f"heterorl-cpu-mailbox-{uuid.uuid4().hex[:6]}"


def _holder_class():
    """The Ray actor class, defined in a function so Ray ships it by value (no test-module import
    in the workers)."""

    class EngineHolder:
        """What verl's actor worker / CheckpointEngineWorker do with their checkpoint engine."""

        def __init__(self, is_master: bool, timeout_s: float = 600.0):
            self.reset(is_master, timeout_s)

        def reset(self, is_master: bool, timeout_s: float = 600.0):
            """A new engine, as verl builds one per worker (actors are reused: start-up is slow here)."""
            self.engine = RayMailboxCheckpointEngine(bucket_size=1 << 20, is_master=is_master, timeout_s=timeout_s)

        def prepare(self):
            return self.engine.prepare()

        def init_process_group(self, **kwargs):
            self.engine.init_process_group(**kwargs)
            return self.engine.role, self.engine.key

        async def send(self, named: dict, global_steps: int):
            # a generator, as verl's engines hand out their per-tensor parameters
            return await self.engine.send_weights(((name, t) for name, t in named.items()), global_steps=global_steps)

        async def receive(self, global_steps: int):
            got = []
            async for name, tensor in self.engine.receive_weights(global_steps=global_steps):
                got.append((name, tensor.clone()))
            return got

        def finalize(self):
            self.engine.finalize()
            return self.engine.key

    return ray.remote(num_cpus=0)(EngineHolder)


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def workers(ray_cluster):
    """Two Ray actors holding an engine each: "actor" (an actor rank) and "rollout" (a rollout worker)."""
    holder = _holder_class()
    pair = {"actor": holder.remote(is_master=True), "rollout": holder.remote(is_master=False)}
    yield pair
    for handle in pair.values():
        ray.kill(handle)


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.rand(8, generator=g, dtype=torch.float64),
        "step_counter": torch.tensor([3, 1, 4], dtype=torch.int64),
    }


def _connect(sender, receiver) -> str:
    """Steps 1-3 of CheckpointEngineManager.update_weights: prepare on all workers (actor ranks
    first), build_topology from the class, init_process_group with each rank's slice of the kwargs."""
    metadata = ray.get([sender.prepare.remote(), receiver.prepare.remote()])
    assert metadata[1] == {} and isinstance(metadata[0]["key"], str)
    actor_kwargs, rollout_kwargs = RayMailboxCheckpointEngine.build_topology(1, 1, metadata)
    roles = ray.get(
        [
            sender.init_process_group.remote(**{k: v[0] for k, v in actor_kwargs.items()}),
            receiver.init_process_group.remote(**{k: v[0] for k, v in rollout_kwargs.items()}),
        ]
    )
    key = metadata[0]["key"]
    assert roles == [("sender", key), ("receiver", key)]
    return key


def _check_received(received, weights) -> None:
    assert [name for name, _ in received] == list(weights)
    for name, tensor in received:
        assert tensor.dtype == weights[name].dtype and torch.equal(tensor, weights[name]), name


def test_weights_go_sender_to_receiver_and_finalize_empties_the_mailbox(workers):
    """verl's manager protocol, one actor rank and one rollout worker: identical names and tensors
    arrive, the sender reports the bytes, and after finalize on both the mailbox holds no key.

    The test holds a handle to the mailbox for the whole sync so it can look inside afterwards
    (the engines also hold one for their process's lifetime)."""
    sender, receiver = workers["actor"], workers["rollout"]
    ray.get([sender.reset.remote(is_master=True), receiver.reset.remote(is_master=False)])
    mailbox = checkpoint_engine._mailbox()
    try:
        key = _connect(sender, receiver)
        # 4. receive and send concurrently (the receiver is waiting before anything is sent)
        weights = _weights()
        received_ref = receiver.receive.remote(global_steps=4)
        sent_ref = sender.send.remote(weights, global_steps=4)
        sent, received = ray.get([sent_ref, received_ref], timeout=120)

        _check_received(received, weights)
        assert sent["perf/weight_sync_bytes"] == float(sum(t.numel() * t.element_size() for t in weights.values()))
        assert ray.get(ray.get_actor(MAILBOX_NAME).keys.remote()) == [key]  # held until finalize
        # 5. finalize on all workers
        assert ray.get([sender.finalize.remote(), receiver.finalize.remote()]) == [None, None]
        assert ray.get(ray.get_actor(MAILBOX_NAME).keys.remote()) == []
    finally:
        del mailbox


def test_receiver_without_weights_times_out(workers):
    """A rollout worker whose sync key never receives weights fails with a timeout after timeout_s."""
    receiver = workers["rollout"]
    ray.get(receiver.reset.remote(is_master=False, timeout_s=1.0))
    ray.get(receiver.init_process_group.remote(role="receiver", key=f"never-sent-{uuid.uuid4().hex}"))
    start = time.monotonic()
    with pytest.raises(TimeoutError) as err:
        ray.get(receiver.receive.remote(global_steps=1), timeout=60)
    elapsed = time.monotonic() - start
    assert isinstance(err.value, ray.exceptions.RayTaskError)  # raised in the worker, not by ray.get's timeout
    assert 0.9 <= elapsed < 30


def test_receiver_that_asks_after_the_send_still_gets_the_weights(workers):
    """The sender may finish before a rollout worker asks (verl runs both sides concurrently, with no
    ordering): the weights must wait in the mailbox until finalize."""
    sender, receiver = workers["actor"], workers["rollout"]
    ray.get([sender.reset.remote(is_master=True), receiver.reset.remote(is_master=False, timeout_s=3.0)])
    _connect(sender, receiver)
    weights = _weights()
    ray.get(sender.send.remote(weights, global_steps=9), timeout=60)
    time.sleep(1.0)  # the receiver is merely late
    try:
        _check_received(ray.get(receiver.receive.remote(global_steps=9), timeout=60), weights)
    finally:
        ray.get([sender.finalize.remote(), receiver.finalize.remote()])


def test_topology_and_roles():
    """build_topology: the actor's rank 0 sends, other actor ranks only gather (FSDP), every rollout
    worker receives, all under rank 0's key; without that key it refuses. Only receivers receive."""
    actor, rollout = RayMailboxCheckpointEngine.build_topology(3, 2, [{"key": "k"}, {}, {}, {}, {}])
    assert actor == {"role": ["sender", "gatherer", "gatherer"], "key": ["k", "k", "k"]}
    assert rollout == {"role": ["receiver", "receiver"], "key": ["k", "k"]}
    with pytest.raises(RuntimeError, match="did not prepare a sync key"):
        RayMailboxCheckpointEngine.build_topology(1, 1, [{}, {}])

    assert RayMailboxCheckpointEngine(is_master=False).prepare() == {}
    keys = {RayMailboxCheckpointEngine(is_master=True).prepare()["key"] for _ in range(3)}
    assert len(keys) == 3  # a fresh key per sync

    sender = RayMailboxCheckpointEngine(is_master=True)
    sender.init_process_group(role="sender", key="k")

    async def first():
        return await sender.receive_weights().__anext__()

    with pytest.raises(RuntimeError, match="'sender'"):
        asyncio.run(first())


def test_gatherer_iterates_but_sends_nothing():
    """An actor rank that is not rank 0 consumes the weight generator (FSDP gathers collectively)
    and posts nothing (it never touches Ray, so no cluster is needed)."""
    gatherer = RayMailboxCheckpointEngine(is_master=False)
    gatherer.init_process_group(role="gatherer", key="k")
    consumed = []

    def weights():
        for name, tensor in _weights().items():
            consumed.append(name)
            yield name, tensor

    assert asyncio.run(gatherer.send_weights(weights())) == {}
    assert consumed == list(_weights())
