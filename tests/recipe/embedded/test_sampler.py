"""The async sampler and learner in-process (no Ray): samplers do not generate groups the
learner must drop, pause while the learner's queue is full (back-pressure), and catch up
through weight deltas under ``hetero.weight_sync=delta``.

Weights reach the sampler after a constant 2 s delay through its ``DelayChannel``; the newest
version number is read undelayed. Real toy model, real fsspec transport in a temp folder.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from recipe.gepo.embedded.async_shared import weight_store
from recipe.gepo.embedded.learner_actor import LearnerWorker
from recipe.gepo.embedded.sampler import SamplerWorker
from recipe.gepo.embedded.engine_config import EngineConfig
from verl_ext.hetero.protocol import (
    CONTROL_TOPIC,
    ROLLOUT_TOPIC,
    STATUS_KEY,
    LearnerStatus,
    SamplerProgress,
    TransportSpec,
    clear_stop,
    read_record,
    request_stop,
    sampler_progress,
)
from verl_ext.hetero.weights import WeightStore

DELAY_S = 2.0


def _sampler(tiny_cfg, tmp_path, *overrides):
    cfg = tiny_cfg(
        tmp_path / "run",
        "hetero.mode=async",
        "hetero.max_delay=1",
        "hetero.delay.dist=constant",
        f"hetero.delay.value={DELAY_S}",
        *overrides,
    )
    spec = TransportSpec("fsspec", url=str(tmp_path / "exchange"))
    transport = spec.open()
    published = WeightStore(transport, keep_last=8)
    sampler = SamplerWorker(0, EngineConfig.from_omegaconf(cfg), cfg.actor_rollout_ref.model.path, spec, 1.0, "s0-test")
    return sampler, published, transport


def _run_for(sampler, transport, seconds: float) -> dict:
    """``sampler.run()`` until a stop marker written after ``seconds``."""
    stopper = threading.Timer(seconds, lambda: request_stop(transport))
    stopper.start()
    try:
        return sampler.run()
    finally:
        stopper.cancel()
        clear_stop(transport)


def test_sampler_waits_instead_of_generating_groups_past_the_bound(tiny_cfg, tmp_path):
    sampler, published, transport = _sampler(tiny_cfg, tmp_path)
    state = {k: v.clone() for k, v in sampler.model.state_dict().items()}
    published.publish(0, state)
    time.sleep(DELAY_S + 0.2)
    sampler._refresh_weights()
    assert sampler.version == 0 and not sampler.weights_too_stale(published.latest_version())
    for version in (1, 2, 3):  # the learner moved 3 versions on; the sampler sees them 2 s later
        published.publish(version, state)
    assert sampler.weights_too_stale(published.latest_version())  # 3 - 0 > max_delay = 1

    counters = _run_for(sampler, transport, 1.0)
    assert counters["batches"] == 0 and transport.keys(ROLLOUT_TOPIC) == []
    assert counters["stale_wait_s"] >= 0.5

    time.sleep(DELAY_S)  # version 3 is now visible: the sampler loads it and generates again
    counters = _run_for(sampler, transport, 1.0)
    assert sampler.version == 3 and counters["batches"] >= 1
    assert len(transport.keys(ROLLOUT_TOPIC)) == counters["groups"] > 0


def test_sampler_generates_stale_groups_when_the_gate_is_off(tiny_cfg, tmp_path):
    sampler, published, transport = _sampler(tiny_cfg, tmp_path, "hetero.sampler_skip_stale=false")
    state = {k: v.clone() for k, v in sampler.model.state_dict().items()}
    published.publish(0, state)
    time.sleep(DELAY_S + 0.2)
    for version in (1, 2, 3):
        published.publish(version, state)
    assert not sampler.weights_too_stale(published.latest_version())
    counters = _run_for(sampler, transport, 1.0)
    assert sampler.version == 0 and counters["batches"] >= 1 and counters["stale_wait_s"] == 0.0
    assert len(transport.keys(ROLLOUT_TOPIC)) == counters["groups"] > 0  # all of them past the bound


def test_sampler_pauses_while_the_learner_queue_is_full(tiny_cfg, tmp_path):
    sampler, published, transport = _sampler(tiny_cfg, tmp_path, "hetero.max_queued_groups=4", "hetero.delay.value=0")
    published.publish(0, {k: v.clone() for k, v in sampler.model.state_dict().items()})
    transport.put(CONTROL_TOPIC, STATUS_KEY, LearnerStatus(version=0, queue_depth=4).to_bytes())
    counters = _run_for(sampler, transport, 1.0)
    assert counters["batches"] == 0 and counters["queue_wait_s"] >= 0.5 and counters["stale_wait_s"] == 0.0

    transport.put(CONTROL_TOPIC, STATUS_KEY, LearnerStatus(version=0, queue_depth=3).to_bytes())
    counters = _run_for(sampler, transport, 1.0)
    assert counters["batches"] >= 1 and len(transport.keys(ROLLOUT_TOPIC)) == counters["groups"]


@pytest.mark.slow  # ~16 s; test_sampler_pauses_while_the_learner_queue_is_full covers back-pressure by default
@pytest.mark.usefixtures("local_ray")  # the learner built here starts its trust checker
def test_learner_publishes_its_queue_depth_for_back_pressure(tiny_cfg, tmp_path):
    cfg = tiny_cfg(tmp_path / "run", "hetero.mode=async", "hetero.max_queued_groups=4")
    spec = TransportSpec("fsspec", url=str(tmp_path / "exchange"))
    learner = LearnerWorker(EngineConfig.from_omegaconf(cfg), cfg.actor_rollout_ref.model.path, spec)
    transport = spec.open()
    try:
        assert learner.start() == 0
        assert read_record(transport, LearnerStatus, CONTROL_TOPIC, STATUS_KEY) == LearnerStatus(
            version=0, queue_depth=0
        )
        sampler = SamplerWorker(
            0, EngineConfig.from_omegaconf(cfg), cfg.actor_rollout_ref.model.path, spec, 1.0, "s0-test"
        )
        learner.enrol(sampler.sampler_id, sampler.public_key())  # as RemoteRuntime does before run()
        sampler.run(max_batches=2)  # 2 prompts a batch: 4 groups reach the learner's buffer
        deadline = time.monotonic() + 30
        while len(learner.buffer) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        learner.step()  # consumes 2, publishes the depth left
        assert read_record(transport, LearnerStatus, CONTROL_TOPIC, STATUS_KEY) == LearnerStatus(
            version=1, queue_depth=2
        )
    finally:
        learner.shutdown()


def test_sampler_catches_up_through_deltas_and_counts_the_path(tiny_cfg, tmp_path):
    """hetero.weight_sync=delta: the sampler's first load is a full version, catching up 2
    versions is one delta load of fewer bytes, and its weights are bit-identical to the full
    version's; the counters the driver sums into perf/sampler_weight_* say which path ran."""
    sampler, _, transport = _sampler(tiny_cfg, tmp_path, "hetero.weight_sync=delta", "hetero.weights_bf16=true")
    learner = weight_store(sampler.hetero, transport)  # what the learner actor publishes with
    assert learner.delta and learner.wire_dtype == "bf16" and sampler.weights.delta
    trainee = {k: v.clone() for k, v in sampler.model.state_dict().items()}
    params = [v.requires_grad_() for k, v in trainee.items() if v.is_floating_point()]
    opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.0)
    learner.publish(0, trainee)
    time.sleep(DELAY_S + 0.2)
    sampler._refresh_weights()
    assert sampler.version == 0
    full_bytes = sampler.stats["weight_bytes_fetched"]
    for version in (1, 2):  # two small optimizer steps
        opt.zero_grad()
        sum((p.float() ** 2).sum() for p in params).backward()
        opt.step()
        learner.publish(version, trainee)
    time.sleep(DELAY_S + 0.2)
    sampler._refresh_weights()
    counters = sampler.counters()
    assert sampler.version == 2
    assert counters["weight_full_loads"] == 1 and counters["weight_delta_loads"] == 1 and counters["weight_loads"] == 2
    assert 0 < counters["weight_bytes_fetched"] - full_bytes < full_bytes / 2  # two deltas, < half a version
    want = WeightStore(transport).get(2)
    for name, tensor in sampler.model.state_dict().items():  # bit patterns, not values
        assert torch.equal(tensor.reshape(-1).view(torch.uint8), want[name].reshape(-1).view(torch.uint8)), name


def test_sampler_claims_each_batch_index_before_drawing_its_prompts(tiny_cfg, tmp_path):
    """What a restart resumes from (supervisor.RemoteRuntime._reached): the exchange names the
    launch and the first batch index it has not claimed."""
    sampler, published, transport = _sampler(tiny_cfg, tmp_path, "hetero.delay.value=0")
    assert sampler_progress(transport, sampler.sampler_id) is None
    published.publish(0, {k: v.clone() for k, v in sampler.model.state_dict().items()})
    counters = sampler.run(start_batch=5, max_batches=2)
    assert counters["next_batch"] == 7
    assert sampler_progress(transport, sampler.sampler_id) == SamplerProgress(launch="s0-test", next_batch=7)
    assert {key.split("-b")[1].split("-")[0] for key in transport.keys(ROLLOUT_TOPIC)} == {"5", "6"}


def test_a_sampler_holding_a_version_a_resumed_learner_lost_loads_the_newest_left(tiny_cfg, tmp_path):
    """A learner that crashed after publishing versions 3-4 resumes from its checkpoint at 2 and
    deletes them (``delete_newer_than``); it publishes 3 anew. A sampler holding the lost 4 loads
    3 at once, instead of generating groups the learner refuses as future_version until it passes
    4 (the liar soak's seed 42 stayed stuck so for its last minute). A sampler behind is not moved."""
    sampler, published, transport = _sampler(tiny_cfg, tmp_path, "hetero.delay.value=0")
    state = {k: v.clone() for k, v in sampler.model.state_dict().items()}
    for version in range(5):
        published.publish(version, state)
    sampler._refresh_weights()
    assert sampler.version == 4
    published.delete_newer_than(2)  # the resumed learner at its checkpoint's version
    sampler._refresh_weights()
    assert sampler.version == 2 and sampler.counters()["lost_version_reloads"] == 1
    published.publish(3, {k: v + 1e-3 if v.is_floating_point() else v for k, v in state.items()})
    sampler._refresh_weights()
    assert sampler.version == 3 and sampler.counters()["lost_version_reloads"] == 1
    loaded = dict(sampler.model.state_dict())
    assert all(torch.equal(loaded[k], v) for k, v in WeightStore(transport).get(3).items())
