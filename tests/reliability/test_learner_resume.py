"""Learner crash and resume through the async engine's ``LearnerWorker`` (real model, real fs
exchange): no rollout group lost or consumed twice, by group uid; and the resumed learner does
not leave the crashed learner's later weight versions for samplers to pick up.

Exactly-once of the inbox alone is unit-tested in tests/hetero/test_hetero_transport.py;
here it is the engine's wiring: checkpoint_state -> acknowledge -> crash -> start(checkpoint)."""

from recipe.gepo.embedded.learner_actor import LearnerWorker
from recipe.gepo.embedded.engine_config import EngineConfig
from verl_ext.hetero.protocol import TransportSpec
from verl_ext.hetero.exchange import send_group

from .conftest import TRUSTING, compose_trainer
from .test_bad_data import group


def new_worker(root, model_path, batch):
    cfg = compose_trainer(
        "hetero.transport=fs",
        f"data.train_batch_size={batch}",
        "task.eval_size=4",
        f"trainer.default_local_dir={root / 'run'}",
        *TRUSTING,
    )
    spec = TransportSpec("fsspec", url=str(root / "exchange"))
    worker = LearnerWorker(EngineConfig.from_omegaconf(cfg), model_path, spec)
    worker.source._stop.set()  # no background poller: the test polls by hand, deterministically
    return worker


def test_crash_after_a_checkpoint_loses_nothing_and_uses_nothing_twice(tmp_path, toy_model_path):
    batch = 2
    a = new_worker(tmp_path, toy_model_path, batch)
    a.start()
    sent = [group(f"r-{i}") for i in range(7)]
    for g in sent[:5]:
        send_group(a.source.transport, g)
    a.source.inbox.poll()
    a.step()  # consumes 2
    checkpoint = a.checkpoint_state()  # "saved"
    assert a.acknowledge(checkpoint["buffer"]) == 5  # the 2 consumed + 3 buffered leave the exchange
    a.step()  # consumes 2 more, never checkpointed
    for g in sent[5:]:
        send_group(a.source.transport, g)
    a.source.inbox.poll()
    used_before_crash = {uid for uid, s in a.buffer.ledger.status.items() if s == "consumed"}
    a.source._stop.set()  # the crash: the actor is gone, nothing else happens

    b = new_worker(tmp_path, toy_model_path, batch)
    b.start(checkpoint)
    assert b.learner.version == 1
    b.source._stop.set()
    b.source.inbox.poll()
    consumed_runs = [uid for uid, s in b.buffer.ledger.status.items() if s == "consumed"]
    while len(b.buffer) >= batch:
        before = {uid for uid, s in b.buffer.ledger.status.items() if s == "consumed"}
        b.step()
        after = {uid for uid, s in b.buffer.ledger.status.items() if s == "consumed"}
        assert len(after - before) == batch
        consumed_runs += sorted(after - before)
    assert len(consumed_runs) == len(set(consumed_runs)), "a group was consumed twice after the resume"
    status = b.buffer.ledger.status
    assert set(status) == {g.group_uid for g in sent}, "a group was lost across the crash"
    assert sum(s == "consumed" for s in status.values()) == 6 and sum(s == "buffered" for s in status.values()) == 1
    # the groups the crashed learner trained on after its checkpoint were trained on again by
    # the resumed one (whose weights never saw them), not skipped
    assert used_before_crash - {uid for uid in status if status[uid] == "consumed"} == set()
    assert b.learner.version == 3  # checkpoint at 1, then two steps


def test_resume_withdraws_the_crashed_learners_later_weight_versions(tmp_path, toy_model_path):
    """Otherwise samplers load them, stamp their groups with a version the resumed learner has not
    reached, and those groups are rejected as future_version (16 in the 10-minute soak)."""
    a = new_worker(tmp_path, toy_model_path, 2)
    a.start()
    checkpoint = a.checkpoint_state()  # version 0
    for version in range(1, 7):  # the crashed learner went on after its last checkpoint
        a.source.weights.publish(version, a.model.state_dict())
    assert a.source.weights.versions() == [3, 4, 5, 6]  # the store keeps 4: 1 and 2 are gone
    a.source._stop.set()

    b = new_worker(tmp_path, toy_model_path, 2)
    b.start(checkpoint)
    b.source._stop.set()
    assert b.source.weights.versions() == [0]
    # every number the crashed learner published is lost, the pruned ones too: samplers may hold them
    assert b.source.gate.lost_versions == set(range(1, 7))


def test_a_group_from_just_published_weights_is_accepted(tmp_path, toy_model_path):
    worker = new_worker(tmp_path, toy_model_path, 2)
    worker.start()
    for i in range(2):
        send_group(worker.source.transport, group(f"v0-{i}"))
    worker.source.inbox.poll()
    worker.step()
    assert worker.source.weights.latest_version() == 1
    send_group(worker.source.transport, group("made-with-v1", version=1))  # a sampler that loaded v1 at once
    worker.source.inbox.poll()
    assert worker.buffer.ledger.status["made-with-v1"] == "buffered"
