"""Bad rollout data through the engine's real learner wiring: groups sent with ``send_group``
over the fs transport reach the async-mode ``LearnerWorker``'s inbox and buffer; each bad kind is
rejected with its named reason, counted in the step metrics (``hetero/rejected/<reason>``) and
never handed to the learner; corrupt files are counted and skipped.

(``validate_group`` itself is unit-tested in tests/hetero/; here the engine's configuration of it
is under test: the group size it expects, the reward range of the task, the version bound.)"""

import json
import zlib

import numpy as np
import pytest

from recipe.gepo.embedded.learner_actor import LearnerWorker
from recipe.gepo.embedded.engine_config import EngineConfig
from verl_ext.hetero.protocol import TransportSpec
from verl_ext.hetero.exchange import ROLLOUT_TOPIC, send_group
from verl_ext.hetero.records import RolloutGroup
from verl_ext.hetero.transport import FsspecTransport, checksum

from .conftest import TRUSTING, compose_trainer

G, R = 8, 6  # G = actor_rollout_ref.rollout.n of the default config


def group(uid, version=0, **changes):
    rng = np.random.default_rng(zlib.crc32(uid.encode()))
    mask = (np.arange(R)[None, :] < rng.integers(1, R + 1, size=G)[:, None]).astype(np.int8)
    rewards = rng.integers(0, 2, size=G).astype(np.float32)
    fields = dict(
        group_uid=uid,
        prompt_ids=rng.integers(3, 15, size=7).astype(np.int64),
        response_ids=(rng.integers(3, 15, size=(G, R)) * mask).astype(np.int64),
        response_mask=mask,
        sampler_logprobs=(-rng.uniform(0.1, 2.0, size=(G, R)) * mask).astype(np.float32),
        rewards=rewards,
        advantages=(rewards - rewards.mean()).astype(np.float32),
        policy_version=version,
        sampler_id="sampler-test",
    )
    fields.update(changes)
    return RolloutGroup(**fields)


def bad(kind):
    g = group(f"bad-{kind}")
    if kind == "nonfinite_logprob":
        g.sampler_logprobs[0, 0] = np.nan
    elif kind == "positive_logprob":
        g.sampler_logprobs[1, 0] = 0.5
    elif kind == "group_size":
        g = group(
            f"bad-{kind}",
            response_ids=g.response_ids[:5],
            response_mask=g.response_mask[:5],
            sampler_logprobs=g.sampler_logprobs[:5],
            rewards=g.rewards[:5],
            advantages=g.advantages[:5],
        )
    elif kind == "empty_response":
        g.response_mask[2, :] = 0
    elif kind == "nonfinite_reward":
        g.rewards[3] = np.inf
    elif kind == "nonfinite_advantage":
        g.advantages[0] = np.nan
    elif kind == "future_version":
        g.policy_version = 5
    return g


@pytest.fixture(scope="module")
def worker(tmp_path_factory, toy_model_path):
    root = tmp_path_factory.mktemp("exchange")
    cfg = compose_trainer(
        "hetero.transport=fs", f"trainer.default_local_dir={root / 'run'}", "task.eval_size=4", *TRUSTING
    )
    spec = TransportSpec("fsspec", url=str(root / "exchange"))
    learner = LearnerWorker(EngineConfig.from_omegaconf(cfg), toy_model_path, spec)
    return learner, FsspecTransport(spec.url)


KINDS = [
    "nonfinite_logprob",
    "positive_logprob",
    "group_size",
    "empty_response",
    "nonfinite_reward",
    "nonfinite_advantage",
    "future_version",
]


def test_bad_groups_are_rejected_by_reason_counted_and_never_trained_on(worker):
    learner, transport = worker
    for kind in KINDS:
        send_group(transport, bad(kind))
    good = [group(f"good-{i}") for i in range(learner.engine.settings.prompts_per_step)]
    for g in good:
        send_group(transport, g)
    # files a dying sampler or a bad disk leaves: truncated and bit-flipped payloads
    payload = group("torn").to_bytes()
    folder = transport.fs._strip_protocol(transport.root) + f"/{ROLLOUT_TOPIC}"
    for key, data in (("torn-1", payload[: len(payload) // 2]), ("flipped-1", bytes(b ^ 1 for b in payload))):
        with open(f"{folder}/{key}.msg", "wb") as f:
            f.write(data)
        with open(f"{folder}/{key}.ok", "w") as f:
            json.dump(
                {"topic": ROLLOUT_TOPIC, "key": key, "size": len(payload), "sha256": checksum(payload), "sent_at": 0.0},
                f,
            )

    learner.source.inbox.poll()
    status = learner.buffer.ledger.status
    for kind in KINDS:
        assert status[f"bad-{kind}"] == f"rejected:{kind}", kind
    assert "torn-1" not in status and "flipped-1" not in status
    assert learner.source.inbox.stats["corrupt"] == 2

    metrics = learner.step()  # one real learner step: it may only see the good groups
    assert {uid for uid, s in status.items() if s == "consumed"} == {g.group_uid for g in good}
    for kind in KINDS:
        assert metrics[f"hetero/rejected/{kind}"] == 1.0, kind
    assert metrics["hetero/inbox_corrupt"] == 2.0
    assert np.isfinite(metrics["actor/loss"]) and metrics["training/policy_version"] == 1.0


def test_rewards_outside_the_tasks_range_are_rejected(worker):
    learner, transport = worker
    send_group(transport, group("reward-too-high", rewards=np.full(G, 100.0, dtype=np.float32)))
    send_group(transport, group("reward-negative", rewards=np.full(G, -3.0, dtype=np.float32)))
    learner.source.inbox.poll()
    assert learner.buffer.ledger.status["reward-too-high"] == "rejected:reward_range"
    assert learner.buffer.ledger.status["reward-negative"] == "rejected:reward_range"
