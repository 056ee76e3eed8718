"""``hetero.stale_policy=wait`` in both modes.

Async: samplers announce each group before generating it (``expected/<uid>``); the learner does
not step past the version that would make an announced group stale until it arrives, or fails
after ``hetero.wait_timeout_s`` naming it; announcements of a dead sampler are withdrawn. The
learner and sampler are the engine's own classes in-process (no Ray), over a real fs exchange.

Replay: the drawn staleness is capped at the bound, which is what waiting for the group at the
edge means there, so no group is ever stale; ``wait`` would give exactly the run ``drop`` gives and
is refused there.
"""

from __future__ import annotations

import threading
import time

import pytest

from recipe.gepo.embedded.learner_actor import LearnerWorker
from recipe.gepo.embedded.sampler import SamplerWorker
from recipe.gepo.embedded.engine_config import EngineConfig
from recipe.gepo.main_gepo import run
from recipe.gepo.options import OptionNotHonoured
from verl_ext.trust.signing import SamplerKey
from verl_ext.hetero.buffer import BufferTimeout
from verl_ext.hetero.exchange import send_group
from verl_ext.hetero.protocol import EXPECTED_TOPIC, ROLLOUT_TOPIC, Announcement, TransportSpec, announce, clear_topic
from verl_ext.hetero.records import RolloutGroup

from .helpers import read_metrics, train_lines
from .helpers import wait_until as _until

LATE_S = 1.5  # the straggler arrives this long after the learner wants to step


KEY = SamplerKey.generate("sampler-7")
"""The key of the sampler these tests play (``_groups``); ``_learner`` enrols it, as the engine
enrols the samplers it launches."""


def _learner(tiny_cfg, tmp_path, policy: str, *overrides: str) -> LearnerWorker:
    cfg = tiny_cfg(
        tmp_path / "run",
        "hetero.mode=async",
        "hetero.max_delay=1",
        f"hetero.stale_policy={policy}",
        "hetero.transport=fs",
        # the wait is for groups to arrive: a straggler past its sampler's probation that no later
        # group's check vouches for would be withheld, and dropped at the bound like a late one
        "hetero.trust.hold_unchecked=false",
        *overrides,
    )
    worker = LearnerWorker(
        EngineConfig.from_omegaconf(cfg),
        cfg.actor_rollout_ref.model.path,
        TransportSpec("fsspec", url=str(tmp_path / "exchange")),
    )
    worker.start()  # publishes version 0, starts polling rollouts (and announcements under wait)
    worker.enrol(KEY.sampler_id, KEY.public_hex())
    return worker


def _groups(worker: LearnerWorker, prefix: str, version: int, n: int, draw: int = 0) -> list[RolloutGroup]:
    """Real groups of the learner's model as it is now, stamped ``version``: call it while the model
    is at that version (a group whose q comes from other weights is a lie the trust gate may check).
    Their prompts are the ones the learner assigns sampler-7's batch ``version + 100 * draw``."""
    from recipe.gepo.embedded.rollout_groups import RolloutSettings, generate_groups
    from verl_ext.trust.assignment import prompt_stream

    s = worker.engine.settings
    assert n <= s.prompts_per_step
    batch = version + 100 * draw
    items = worker.task.train_items(s.prompts_per_step, stream=prompt_stream("sampler-7"), index=batch)[:n]
    return generate_groups(
        worker.model,
        worker.tokenizer,
        items,
        worker.task.score,
        RolloutSettings(s.group_size, s.temperature, s.max_new_tokens),
        worker.engine.algorithm,
        policy_version=version,
        sampler_id="sampler-7",
        seed=batch,
        uid_prefix=prefix,
        batch_index=batch,
    )


def _to_version_1(worker: LearnerWorker) -> None:
    transport = worker.source.transport
    for g in _groups(worker, "first", 0, 2):
        send_group(transport, g, key=KEY)
    _until(lambda: len(worker.buffer) == 2, "the first batch")
    worker.step()
    assert worker.learner.version == 1


@pytest.mark.usefixtures("local_ray")  # the learner built here starts its trust checker
# drop, the contrast (~10 s), in the slow tier: the suite's time (wait, the feature, stays)
@pytest.mark.parametrize("policy", ["wait", pytest.param("drop", marks=pytest.mark.slow)])
def test_async_wait_holds_the_step_for_an_announced_group_at_the_edge(tiny_cfg, tmp_path, policy):
    worker = _learner(tiny_cfg, tmp_path, policy)
    try:
        transport = worker.source.transport
        straggler = _groups(worker, "slow", 0, 1, draw=1)[0]  # drawn with version 0's weights
        _to_version_1(worker)
        # a sampler with version 0 announces a group: usable at v1 (1 - 0 <= max_delay), stale at v2
        announce(transport, straggler.group_uid, 0, "sampler-7")
        for g in _groups(worker, "fresh", 1, 2):
            send_group(transport, g, key=KEY)
        _until(lambda: len(worker.buffer) == 2, "the fresh groups")
        if policy == "wait":
            _until(lambda: worker.buffer.metrics(reset=False)["hetero/expected"] == 1, "the announcement")
        threading.Timer(LATE_S, lambda: send_group(transport, straggler, key=KEY)).start()
        t0 = time.monotonic()
        metrics = worker.step()
        elapsed = time.monotonic() - t0
        status = worker.buffer.ledger.status
        if policy == "wait":
            assert elapsed >= LATE_S * 0.9, elapsed
            assert status[straggler.group_uid] == "consumed"  # trained on, not lost
            assert metrics["hetero/wait_s"] >= LATE_S * 0.9 and metrics["hetero/staleness_max"] == 1
            # the arrived group's announcement is cleared from the exchange
            _until(lambda: transport.keys(EXPECTED_TOPIC) == [], "the announcement to be cleared")
        else:
            assert elapsed < LATE_S, elapsed  # drop does not wait (and reads no announcements)
            _until(lambda: straggler.group_uid in status, "the straggler")
            assert status[straggler.group_uid] == "dropped:stale"
    finally:
        worker.shutdown()


@pytest.mark.usefixtures("local_ray")  # the learner built here starts its trust checker
def test_async_wait_fails_after_the_timeout_naming_the_group_and_a_dead_samplers_are_withdrawn(tiny_cfg, tmp_path):
    worker = _learner(tiny_cfg, tmp_path, "wait", "hetero.wait_timeout_s=1.5")
    try:
        transport = worker.source.transport
        _to_version_1(worker)
        announce(transport, "s9-dead-b0-0", 0, "sampler-9")
        for g in _groups(worker, "fresh", 1, 2):
            send_group(transport, g, key=KEY)
        _until(lambda: worker.buffer.metrics(reset=False)["hetero/expected"] == 1, "the announcement")
        with pytest.raises(BufferTimeout, match=r"still waiting for 1 expected groups: s9-dead-b0-0 \(v0, sampler-9\)"):
            worker.step()
        assert worker.learner.version == 1
        # the driver withdraws a dead sampler's announcements when it restarts it: no more waiting
        clear_topic(transport, EXPECTED_TOPIC, prefix="s9-dead-")
        _until(lambda: worker.buffer.metrics(reset=False)["hetero/expected"] == 0, "the withdrawal")
        t0 = time.monotonic()
        worker.step()
        assert time.monotonic() - t0 < 1.5 and worker.learner.version == 2
    finally:
        worker.shutdown()


@pytest.mark.slow  # ~12 s; the default run's edge test drives announced groups under wait end to end
@pytest.mark.usefixtures("local_ray")  # the learner built here starts its trust checker
def test_async_sampler_announces_its_groups_only_under_wait(tiny_cfg, tmp_path):
    for policy in ("wait", "drop"):
        cfg = tiny_cfg(
            tmp_path / policy / "run", "hetero.mode=async", f"hetero.stale_policy={policy}", "hetero.delay.dist=none"
        )
        spec = TransportSpec("fsspec", url=str(tmp_path / policy / "exchange"))
        learner = LearnerWorker(EngineConfig.from_omegaconf(cfg), cfg.actor_rollout_ref.model.path, spec)
        learner.source._stop.set()  # no poller: the announcements stay for the test to read
        learner.start()
        sampler = SamplerWorker(
            0, EngineConfig.from_omegaconf(cfg), cfg.actor_rollout_ref.model.path, spec, 1.0, "s0-t"
        )
        learner.enrol(sampler.sampler_id, sampler.public_key())  # as RemoteRuntime does before run()
        sampler.run(max_batches=1)
        transport = spec.open()
        sent = sorted(transport.keys(ROLLOUT_TOPIC))
        assert len(sent) == cfg.data.train_batch_size
        if policy == "wait":
            assert sorted(transport.keys(EXPECTED_TOPIC)) == sent
            record = Announcement.from_bytes(transport.get(EXPECTED_TOPIC, sent[0]))
            assert record == Announcement(policy_version=0, sampler_id="sampler-0")
            # arrived: the learner clears them once they are in the buffer (their checks, in the
            # checker process, pass first: an announced group awaiting its verdict is still waited for)
            inbox = learner.source.inbox

            def cleared() -> bool:
                inbox.poll()
                inbox.poll_announcements()
                return transport.keys(EXPECTED_TOPIC) == []

            _until(cleared, "the announcements cleared")
            assert len(learner.buffer) == len(sent)
        else:
            assert transport.keys(EXPECTED_TOPIC) == []
        learner.shutdown()


def test_replay_caps_the_draw_and_refuses_wait(tiny_cfg, tmp_path):
    """Replay's capped draw is what waiting means there, so wait would give drop's run: refused."""
    overrides = (
        "hetero.mode=replay",
        "hetero.max_delay=2",
        "hetero.delay.low=2",
        "hetero.delay.high=9",
        "trainer.total_training_steps=4",
        "trainer.test_freq=0",
    )
    with pytest.raises(OptionNotHonoured, match=r"hetero.stale_policy='wait' is not honoured by .*mode=replay"):
        run(tiny_cfg(tmp_path / "wait", *overrides, "hetero.stale_policy=wait"))
    assert not (tmp_path / "wait").exists()
    run(tiny_cfg(tmp_path / "drop", *overrides))
    steps = train_lines(read_metrics(tmp_path / "drop"))
    assert max(line["hetero/staleness_max"] for line in steps) == 2  # draws past the bound sit at it
    assert all(line["hetero/dropped"] == 0 and line["hetero/expected"] == 0 for line in steps)
