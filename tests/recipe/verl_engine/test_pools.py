"""Remote sampler pools for the verl engine (recipe/gepo/pool.py, verl_engine/pool_ingress.py):
start-up refusals in-process, and one real run: the verl engine's learner (FSDP2, its own Ray
cluster) trained only on groups a pool in another Ray cluster generated with verl's agent loop,
signed, sent through a folder exchange, checked and admitted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from recipe.gepo.pool import check_pool_config
from recipe.gepo.remote_sampler import compose_config
from recipe.gepo.verl_engine.launch_plan import engine_settings, validate
from verl_ext.hetero.protocol import ROLLOUT_TOPIC, TransportSpec

ROOT = Path(__file__).resolve().parents[3]
COMMON = ["+verl_preset=cpu_toy", "hetero.engine=verl", "hetero.transport=fs"]


def test_the_plan_of_a_learner_fed_by_pools_names_the_exchange_and_its_checks(tmp_path):
    enrolment = tmp_path / "enrolment.json"
    enrolment.write_text("{}")
    cfg = compose_config([*COMMON, f"hetero.transport_url={tmp_path}/x", f"hetero.trust.enrolment_file={enrolment}"])
    from recipe.gepo.verl_engine.launch_plan import render

    plan = render(validate(cfg))
    assert f"through {tmp_path}/x" in plan and "signatures of enrolled keys" in plan
    assert "q re-scored in fp32 on each pool's first 4 groups, then 0.1 of them" in plan
    settings = engine_settings(cfg)
    assert settings.actor_rollout_ref.rollout.agent.agent_loop_manager_class == (
        "recipe.gepo.verl_engine.pool_ingress.PoolAgentLoopManager"
    )


@pytest.mark.parametrize(
    "overrides, match",
    [
        ([], "needs hetero.trust.enrolment_file"),
        (["hetero.trust.enrolment_file=/no/such/file.json"], "enrolment_file='/no/such/file.json': no such file"),
        (
            ["hetero.trust.sign_records=false", "+actor_rollout_ref.rollout.agent.agent_loop_manager_class=my.Manager"],
            "agent_loop_manager_class='my.Manager'",
        ),
        (
            ["hetero.trust.sign_records=false", "actor_rollout_ref.rollout.dtype=bfloat16"],
            "rollout.dtype=bfloat16 with hetero.trust.verify_fraction=0.1: re-scoring bf16 pools needs bf16 bounds",
        ),
        (["hetero.trust.sign_records=false", "hetero.trust.max_divergence=0.5"], "hetero.trust.max_divergence=0.5"),
    ],
)
def test_a_learner_fed_by_pools_refuses_what_it_cannot_do_at_start(overrides, match):
    with pytest.raises(Exception, match=match):
        validate(compose_config([*COMMON, *overrides]))


@pytest.mark.parametrize(
    "overrides, index, key, match",
    [
        (["hetero.transport=ray"], 32, "k", "a pool feeds a verl-engine learner through an exchange"),
        ([], 32, "k", "hetero.transport_url is empty"),
        (["hetero.transport_url=/x"], 64, "k", "--index 64"),
        (["hetero.transport_url=/x"], 32, None, "give --key"),
        (["hetero.transport_url=/x", "actor_rollout_ref.rollout.name=hf"], 32, "k", "rollout.name='hf'"),
    ],
)
def test_a_pool_refuses_a_config_it_cannot_serve_naming_the_key(overrides, index, key, match):
    with pytest.raises(ValueError, match=match):
        check_pool_config(compose_config([*COMMON, *overrides]), index, key)


@pytest.fixture(scope="module")
def toy_admission():
    """The learner's admission of pool groups on the toy task: its prompts, tokenizer and a builder."""
    from verl.utils import hf_tokenizer

    from recipe.gepo.sections import HeteroConfig
    from recipe.gepo.verl_engine.pool_ingress import PoolPrompts
    from recipe.gepo.verl_engine.runner import resolve_task_files

    cfg = resolve_task_files(compose_config([*COMMON, "hetero.trust.sign_records=false"]))
    tokenizer = hf_tokenizer(cfg.actor_rollout_ref.model.path)
    prompts = PoolPrompts(cfg.data.train_files, tokenizer)
    return cfg, HeteroConfig.from_omegaconf(cfg.hetero), tokenizer, prompts


def toy_group(tokenizer, prompts, uid, answers, row=0, lie=False, pool="pool-32"):
    """A group as a pool sends it: a training prompt tokenized as verl's agent loop does, one
    response per answer text, its rewards as the pool computes them (flipped when ``lie``)."""
    import numpy as np
    import pandas as pd

    from verl_ext.hetero.records import RolloutGroup

    record = pd.read_parquet(prompts.source_files[0]).iloc[row]
    ids = tokenizer.apply_chat_template([dict(m) for m in record["prompt"]], add_generation_prompt=True, tokenize=True)
    ids = list(getattr(ids, "input_ids", ids))
    responses = [tokenizer.encode(a, add_special_tokens=False) + [tokenizer.eos_token_id] for a in answers]
    width = max(map(len, responses))
    text = tokenizer.decode(ids, skip_special_tokens=False)
    if tokenizer.bos_token and text.startswith(tokenizer.bos_token):
        text = text[len(tokenizer.bos_token) :]
    truth = prompts.answer_for(text)
    rewards = np.array([prompts.score(a, {"prompt": text, "answer": truth}) for a in answers], np.float32)
    if lie:
        rewards = 1.0 - rewards
    return RolloutGroup(
        group_uid=uid,
        prompt_ids=np.array(ids),
        response_ids=np.array([r + [0] * (width - len(r)) for r in responses]),
        response_mask=np.array([[1] * len(r) + [0] * (width - len(r)) for r in responses], np.int8),
        sampler_logprobs=np.full((len(answers), width), -0.5, np.float32),
        rewards=rewards,
        advantages=np.zeros(len(answers), np.float32),
        policy_version=0,
        sampler_id=pool,
        sampler_precision="fp32",
    ), truth


def test_the_learner_recomputes_a_pools_rewards_against_its_own_answers(toy_admission, tmp_path):
    from recipe.gepo.verl_engine.pool_ingress import RefusalNotes, admission, report_trust
    from verl_ext.rundir import read_events
    from verl_ext.hetero.records import RecordRejected

    cfg, hetero, tokenizer, prompts = toy_admission
    assert len(prompts) > 100
    buffer, gate = admission(hetero, cfg, tokenizer, prompts)
    _, truth = toy_group(tokenizer, prompts, "probe", ["0"])
    honest, _ = toy_group(tokenizer, prompts, "honest", [truth, "1", "2", "3"])
    assert honest.rewards.tolist()[0] == 1.0 and honest.rewards.sum() == 1.0
    gate.admit(honest)
    assert buffer.add(honest, validated=True)
    liar, _ = toy_group(tokenizer, prompts, "liar", [truth, "1", "2", "3"], row=1, lie=True)
    with pytest.raises(RecordRejected, match="reported .1.0, 1.0, 1.0, 1.0., recomputed") as refused:
        gate.admit(liar)
    assert refused.value.reason == "bad_rewards"
    with pytest.raises(RecordRejected) as refused:  # one lie shown: the pool is quarantined
        gate.admit(toy_group(tokenizer, prompts, "next", [truth, "1", "2", "3"])[0])
    assert refused.value.reason == "quarantined"
    (line,) = report_trust(RefusalNotes(), gate, tmp_path, 3)  # in the learner's log and events.jsonl
    assert line.startswith("version 3: quarantined: sampler_id=pool-32, group_uid=liar, reason=bad_rewards")
    assert [(e["step"], e["event"], e["sampler_id"]) for e in read_events(tmp_path)] == [(3, "quarantined", "pool-32")]
    # a prompt the learner does not hold: no answer of its own to score against, refused
    stranger, _ = toy_group(tokenizer, prompts, "stranger", ["1", "2", "3", "4"], row=2, pool="pool-33")
    stranger.prompt_ids = np.concatenate(
        [stranger.prompt_ids[:-1], [stranger.prompt_ids[-2]], stranger.prompt_ids[-1:]]
    )
    stranger.prompt_mask = np.ones(stranger.prompt_ids.shape, np.int8)
    with pytest.raises(RecordRejected) as refused:
        gate.admit(stranger)
    assert refused.value.reason == "unknown_prompt"
    assert gate.metrics()["trust/failed"] >= 1


def test_a_group_admitted_before_a_checkpoint_but_not_trained_is_admitted_again_after_a_resume(toy_admission):
    """The ingress restores the gate's books from the checkpoint and reads the exchange again: a
    group it had admitted but not yet trained comes back under its own uid and is admitted (it
    was refused as its own replay, and never trained); its content or its batch slot under
    another uid is still refused."""
    from recipe.gepo.verl_engine.pool_ingress import admission
    from verl_ext.hetero.records import RecordRejected

    cfg, hetero, tokenizer, prompts = toy_admission
    buffer, gate = admission(hetero, cfg, tokenizer, prompts)
    _, truth = toy_group(tokenizer, prompts, "probe", ["0"])
    group, _ = toy_group(tokenizer, prompts, "r32-a-b5-0", [truth, "1", "2", "3"])
    group.batch_index, group.batch_slot = 5, 0
    gate.accepted(group, gate.admit(group))
    assert buffer.add(group, validated=True)
    state = gate.state_dict()  # the checkpoint; the learner crashes before training the group

    _, resumed = admission(hetero, cfg, tokenizer, prompts)
    resumed.load_state_dict(state)
    resumed.accepted(group, resumed.admit(group))  # no RecordRejected: the same group again
    copy, _ = toy_group(tokenizer, prompts, "r32-a-b6-0", [truth, "1", "2", "3"])
    copy.batch_index, copy.batch_slot = 6, 0
    with pytest.raises(RecordRejected) as refused:
        resumed.admit(copy)
    assert refused.value.reason == "replayed"
    other, _ = toy_group(tokenizer, prompts, "r32-a-b5-0x", [truth, "2", "1", "0"], row=1)
    other.batch_index, other.batch_slot = 5, 0
    with pytest.raises(RecordRejected) as refused:
        resumed.admit(other)
    assert refused.value.reason == "slot_reused"


@pytest.mark.slow  # a Ray cluster and TransferQueue: ~30 s
def test_slots_verl_restored_as_finished_are_issued_to_the_ingress_again():
    """verl's checkpoint holds the trainer's TransferQueue: slots the old ingress filled come back
    finished, and verl would train them from its copy, unseen by the new ingress.
    reopen_restored_slots makes them pending; verl's own re-issue on resume then clears their
    trajectories and hands the prompts to the agent loop manager (the pools' ingress) again."""
    import ray
    import torch
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    from recipe.gepo.verl_engine.pool_ingress import reopen_restored_slots

    issued = []
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
        rows = TensorDict({"input_ids": torch.zeros(3, 4, dtype=torch.long)}, batch_size=3)
        tags = [{"is_prompt": True, "status": s, "global_steps": 3} for s in ("finished", "pending", "finished")]
        tq.kv_batch_put(keys=["filled", "waiting", "failed"], partition_id="train", fields=rows, tags=tags)
        tq.kv_put(key="failed", partition_id="train", tag={**tags[2], "status": "failure"})
        trajectory = TensorDict({"input_ids": torch.zeros(1, 4, dtype=torch.long)}, batch_size=1)
        tq.kv_batch_put(keys=["filled_0_0"], partition_id="train", fields=trajectory, tags=[{"status": "success"}])

        assert reopen_restored_slots(tq) == 2
        trainer = type("Resumed", (), {"trainer_mode": "separate_async", "global_steps": 4})()
        trainer.agent_loop_manager = type("Ingress", (), {"generate_sequences": lambda self, b: issued.append(b)})()
        assert PPOTrainer._reissue_inflight_prompts(trainer) == 3
        left = tq.kv_list("train")["train"]
    finally:
        tq.close()
        ray.shutdown()
    assert "filled_0_0" not in left  # the old ingress's group is not trained from verl's copy
    assert {k: t["status"] for k, t in left.items()} == dict.fromkeys(("filled", "waiting", "failed"), "pending")
    assert len(issued) == 1 and len(issued[0]) == 3


@pytest.fixture(scope="module")
def rescoring(toy_admission):
    """The admission with the ingress's re-scoring model, version 0's weights handed to it as
    :meth:`PoolIngress.published` does (read back from a real exchange, held to their SHA-256)."""
    from recipe.gepo.verl_engine.pool_ingress import admission, fetch_published, load_scorer
    from verl_ext.hetero.weights import WeightStore

    cfg, hetero, tokenizer, prompts = toy_admission
    scorer = load_scorer(cfg.actor_rollout_ref.model.path)
    buffer, gate = admission(hetero, cfg, tokenizer, prompts, scorer)
    transport = TransportSpec("fsspec", url=f"memory://pool-rescore-{time.time_ns()}").open()
    store = WeightStore(transport)
    store.publish(0, scorer.state_dict())
    gate.remember(0, fetch_published(transport, 0, store.published_sha256(0)))
    gate.version_wait_s = 0.2
    return cfg, tokenizer, prompts, scorer, buffer, gate, transport, store


def _true_q(scorer, group, temperature=1.0):
    from verl_ext.trust.verifier import group_log_probs

    group.sampler_logprobs = (group_log_probs(scorer, group, temperature) * group.response_mask).astype(np.float32)
    return group


def test_the_ingress_re_scores_a_pools_q_under_the_version_it_claims(rescoring):
    """hetero.trust.verify_fraction on the verl engine: a pool's q is re-scored by the ingress's own
    fp32 model under the claimed version's published weights; q x 1.5 is refused and quarantines the
    pool, honest q passes, and a version the ingress does not hold refuses the group without blame."""
    from verl_ext.hetero.records import RecordRejected

    cfg, tokenizer, prompts, scorer, buffer, gate, _, _ = rescoring
    assert gate.rescoring and gate.verifier.scorer is scorer
    _, truth = toy_group(tokenizer, prompts, "probe", ["0"])
    honest = _true_q(scorer, toy_group(tokenizer, prompts, "h0", [truth, "1", "2", "3"], pool="pool-40")[0])
    assert gate.admit(honest) is True  # on probation: re-scored, passed, vouched for
    liar = _true_q(scorer, toy_group(tokenizer, prompts, "l0", [truth, "1", "2", "3"], row=3, pool="pool-41")[0])
    liar.sampler_logprobs = liar.sampler_logprobs * 1.5
    with pytest.raises(RecordRejected) as refused:
        gate.admit(liar)
    assert refused.value.reason == "bad_logprobs" and gate.ledger.refusal("pool-41") == "quarantined"
    future = _true_q(scorer, toy_group(tokenizer, prompts, "f0", [truth, "1", "2", "3"], row=4, pool="pool-42")[0])
    future.policy_version = 1  # published to nobody: its check cannot be made
    buffer.set_learner_version(1)
    with pytest.raises(RecordRejected) as refused:
        gate.admit(future)
    assert refused.value.reason == "unverifiable_version" and gate.ledger.refusal("pool-42") is None
    assert gate.metrics()["trust/checked"] >= 2


def test_weights_read_back_for_re_scoring_are_held_to_the_published_sha256(rescoring):
    from recipe.gepo.verl_engine.pool_ingress import fetch_published
    from verl_ext.hetero.protocol import WEIGHTS_TOPIC, version_key

    *_, transport, store = rescoring
    sha = store.published_sha256(0)
    message = fetch_published(transport, 0, sha)
    transport.put(WEIGHTS_TOPIC, version_key(0), message[:-1] + bytes([message[-1] ^ 1]))  # rewritten by someone
    with pytest.raises(ValueError, match="version 0 on the exchange has SHA-256"):
        fetch_published(transport, 0, sha)
    with pytest.raises(ValueError, match="version 7 is not on the exchange"):
        fetch_published(transport, 7, sha)


def _run(args, **kwargs):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, check=True, **kwargs
    )


def _wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the learner exited (rc={proc.returncode}) before step {step}")
        if metrics.is_file() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines()):
            return
        time.sleep(1)
    raise AssertionError(f"no step {step} within {timeout_s} s")


@pytest.mark.slow
def test_a_learner_killed_and_resumed_trains_every_pool_group_at_most_once_and_loses_none(tmp_path):
    """Learner and pool in two Ray clusters, one folder between them, bf16 XOR-delta weights.
    The learner is killed (SIGKILL, its whole process group) after step 3 and started again
    while the pool keeps generating; 6 GEPO steps in all."""
    key, enrolment, exchange, run_dir = tmp_path / "pool.key", tmp_path / "enrol.json", tmp_path / "x", tmp_path / "run"
    public = _run(["-m", "verl_ext.trust.signing", "keygen", str(key), "pool-32"]).stdout.strip()
    enrolment.write_text('{"keys": {}}')  # empty: the pool is enrolled once the learner runs
    shared = [
        *COMMON,
        f"hetero.transport_url={exchange}",
        "hetero.delay.dist=none",
        "hetero.max_delay=2",
        f"trainer.default_local_dir={run_dir}",
        "hetero.max_queued_groups=8",  # back-pressure: the pool waits while the learner holds 8
        "hetero.weight_sync=delta",
        "hetero.weights_bf16=true",
    ]
    learner_cmd = [
        sys.executable, "-m", "recipe.gepo.main_gepo", "--config-dir", "configs", *shared,
        f"hetero.trust.enrolment_file={enrolment}", "trainer.total_training_steps=6", "trainer.save_freq=1",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    out = {name: open(tmp_path / f"{name}.log", "w") for name in ("learner1", "learner2", "pool")}
    procs = []

    def start(cmd, log, **kwargs):
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out[log], stderr=subprocess.STDOUT, **kwargs))
        return procs[-1]

    try:
        first = start(learner_cmd, "learner1", start_new_session=True)
        time.sleep(5)  # the learner clears the exchange's old groups when it starts: let it begin first
        _run(["-m", "verl_ext.trust.signing", "enrol", str(enrolment), "pool-32", public])  # re-read when it changes
        pool = start([sys.executable, "-m", "recipe.gepo.pool", "--index", "32", "--key", str(key), *shared], "pool")
        _wait_for_step(run_dir / "metrics.jsonl", 3, first, timeout_s=900)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
        second = start(learner_cmd, "learner2", start_new_session=True)
        assert second.wait(timeout=1200) == 0, (tmp_path / "learner2.log").read_text()[-6000:]
        assert pool.wait(timeout=180) == 0, (tmp_path / "pool.log").read_text()[-6000:]  # the stop marker ends it
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for f in out.values():
            f.close()
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in steps if "pool/groups_filled" in row] == [1, 2, 3, 4, 5, 6]
    assert all(row["trust/refused"] == 0 for row in steps if "trust/refused" in row)
    # the ingress re-scored the pool's q (hetero.trust.verify_fraction, default 0.1; probation: its first
    # 4 groups) under each claimed version read back from the exchange, and no honest group failed
    last = steps[-1]
    print({k: v for k, v in last.items() if k.startswith(("trust/", "pool/version"))})
    assert last["trust/checked"] >= 4 and last["trust/failed"] == 0 and last["trust/quarantined"] == 0
    assert last["pool/versions_fetched"] >= 3 and last["pool/version_fetch_errors"] == 0
    audit = [json.loads(line) for line in (run_dir / "pool_trained.jsonl").read_text().splitlines()]
    trained = [g for row in audit for g in row["groups"]]
    assert len(trained) == 6 * 4 and len(set(trained)) == len(trained)  # every step the pool's, none twice
    counters = json.loads((tmp_path / "pool.log").read_text().strip().splitlines()[-1])
    assert counters["version"] >= 4 and counters["weight_loads"] >= 3  # it followed the resumed learner
    sent = {
        f"{counters['launch']}-b{b}-{i}"
        for b in range(counters["first_batch"], counters["next_batch"])
        for i in range(4)
    }
    left = set(TransportSpec("fsspec", url=str(exchange)).open().keys(ROLLOUT_TOPIC))
    # trained groups leave the exchange one checkpoint later (a resume may start from the previous one)
    before_last = {g for row in audit if row["step"] < 6 for g in row["groups"]}
    assert set(trained) <= sent and not before_last & left
    assert sent - set(trained) - left == set()  # and no group is lost: trained, or still there


def test_the_learner_waits_for_pools_and_stops_after_the_timeout_naming_who_it_heard_from():
    """hetero.wait_timeout_s on the verl engine's pools (PoolWatch, ticked by the ingress's thread):
    prompts waiting while a pool fills them never time out; with no group for the timeout, the
    message names each pool's last group and the quarantined ones."""
    from recipe.gepo.verl_engine.pool_ingress import PoolWatch

    watch = PoolWatch(timeout_s=30)
    assert watch.tick(waiting=4, now=0.0) is None
    watch.filled("pool-1", now=20.0)  # a pool filled a slot: the wait starts again
    assert watch.tick(waiting=3, now=45.0) is None and watch.tick(waiting=3, now=49.0) is None
    assert watch.tick(waiting=0, now=200.0) is None  # nothing waits: never starved
    assert watch.tick(waiting=2, now=300.0) is None
    message = watch.tick(waiting=2, now=330.0, quarantined=["pool-2"])
    assert message is not None and "no pool group admitted for 30 s while 2 training prompts wait" in message
    assert "hetero.wait_timeout_s=30" in message and "pool-1 310 s ago" in message and "quarantined: pool-2" in message


@pytest.fixture(scope="module")
def toy_scorer(toy_admission):
    from recipe.gepo.verl_engine.pool_ingress import load_scorer

    return load_scorer(toy_admission[0].actor_rollout_ref.model.path)


def _ingress_books(toy_admission, scorer, *overrides):
    """The buffer and gate the ingress builds for the toy pools' config with ``overrides`` (the
    learner's prompts and tokenizer are the fixture's: no override here changes them)."""
    from recipe.gepo.sections import HeteroConfig
    from recipe.gepo.verl_engine.pool_ingress import admission

    base, _, tokenizer, prompts = toy_admission
    cfg = compose_config([*COMMON, "hetero.trust.sign_records=false", *overrides])
    hetero = HeteroConfig.from_omegaconf(cfg.hetero)
    return admission(hetero, base, tokenizer, prompts, scorer)


def _enrolled(tmp_path):
    from verl_ext.trust.signing import Enrolment, SamplerKey

    path = tmp_path / "enrolment.json"
    enrolment = Enrolment()
    enrolment.enrol("pool-32", SamplerKey.generate("pool-32").public_hex())
    enrolment.save(path)
    return path


def test_the_ingress_names_each_pools_first_refusal_of_a_kind_once(toy_admission, tmp_path):
    """A pool whose key nobody enrolled (or that runs another model, another run, ...) gets one line
    in the learner's log naming it and the reason, at its first refused group; the rest are counted."""
    from recipe.gepo.verl_engine.pool_ingress import RefusalNotes
    from verl_ext.hetero.exchange import RolloutInbox, send_group
    from verl_ext.trust.signing import SamplerKey

    enrolled = ["hetero.trust.sign_records=true", f"hetero.trust.enrolment_file={_enrolled(tmp_path)}"]
    buffer, gate = _ingress_books(toy_admission, None, *enrolled)
    gate.reload_enrolment()
    notes = RefusalNotes()
    buffer.on_reject = notes.pending.append
    transport = TransportSpec("fsspec", url=f"memory://refusal-notes-{time.time_ns()}").open()
    inbox = RolloutInbox(transport, buffer, enrolment=gate.enrolment, gate=gate)
    _, _, tokenizer, prompts = toy_admission
    stranger = SamplerKey.generate("pool-40")
    for i in range(3):
        send_group(
            transport,
            toy_group(tokenizer, prompts, f"r40-x-b0-{i}", ["1", "2"], row=i, pool="pool-40")[0],
            key=stranger,
        )
    inbox.poll()
    (line,) = notes.lines()
    assert line.startswith("refused pool-40's groups (unenrolled;") and "r40-x-b0-" in line
    send_group(transport, toy_group(tokenizer, prompts, "r40-x-b1-0", ["3", "4"], pool="pool-40")[0], key=stranger)
    inbox.poll()
    assert notes.lines() == [] and buffer.metrics()["hetero/rejected/unenrolled"] == 4


INGRESS_KEYS = {
    "hetero.order": (lambda tmp: ["hetero.order=newest"], lambda b, g: b.order == "newest"),
    "hetero.max_buffered_per_sampler": (
        lambda tmp: ["hetero.max_buffered_per_sampler=3"],
        lambda b, g: b.sampler_capacity == 3,
    ),
    "hetero.trust.verify_fraction": (
        lambda tmp: ["hetero.trust.verify_fraction=0.5"],
        lambda b, g: g.rescoring and g.ledger.verify_fraction == 0.5,
    ),
    "hetero.trust.probation_groups": (
        lambda tmp: ["hetero.trust.probation_groups=2"],
        lambda b, g: g.ledger.probation_groups == 2,
    ),
    "hetero.trust.hold_unchecked": (lambda tmp: ["hetero.trust.hold_unchecked=false"], lambda b, g: not g.withholding),
    "hetero.trust.logprob_tolerance": (
        lambda tmp: ["hetero.trust.logprob_tolerance=0.01"],
        lambda b, g: g.bounds.tolerance("fp32", "fp32").token_max == 0.01,
    ),
    "hetero.trust.trust_penalty": (
        lambda tmp: ["hetero.trust.trust_penalty=0.2"],
        lambda b, g: g.ledger.penalty == 0.2,
    ),
    "hetero.trust.trust_recovery": (
        lambda tmp: ["hetero.trust.trust_recovery=0.2"],
        lambda b, g: g.ledger.recovery == 0.2,
    ),
    "hetero.trust.quarantine_below": (
        lambda tmp: ["hetero.trust.quarantine_below=0.1"],
        lambda b, g: g.ledger.quarantine_below == 0.1,
    ),
    "hetero.trust.check_rewards": (
        lambda tmp: ["hetero.trust.check_rewards=false"],
        lambda b, g: not g.verifier.check_rewards,
    ),
    "hetero.trust.sign_records": (lambda tmp: ["hetero.trust.sign_records=true"], lambda b, g: g.enrolment is not None),
    "hetero.trust.enrolment_file": (
        lambda tmp: ["hetero.trust.sign_records=true", f"hetero.trust.enrolment_file={_enrolled(tmp)}"],
        lambda b, g: g.enrolment is not None and (g.reload_enrolment() or "pool-32" in g.enrolment.keys),
    ),
}
"""Pool keys the ingress reads (POOL_KEYS): how the buffer and gate it builds show each one."""


@pytest.mark.parametrize("key", sorted(INGRESS_KEYS))
def test_each_pool_key_the_ingress_reads_changes_its_buffer_or_gate(key, tmp_path, toy_admission, toy_scorer):
    overrides, shows = INGRESS_KEYS[key]
    assert not shows(*_ingress_books(toy_admission, toy_scorer)), f"{key}: the default already shows it"
    assert shows(*_ingress_books(toy_admission, toy_scorer, *overrides(tmp_path))), key


LOOP_KEYS = {
    "hetero.max_delay": ("hetero.max_delay=5", "loop", "max_delay", 5),
    "hetero.sampler_skip_stale": ("hetero.sampler_skip_stale=false", "loop", "skip_stale", False),
    "hetero.max_queued_groups": ("hetero.max_queued_groups=3", "loop", "max_queued_groups", 3),
    "hetero.keep_weight_versions": ("hetero.keep_weight_versions=7", "loop", "keep_weight_versions", 7),
    "hetero.weights_bf16": ("hetero.weights_bf16=true", "store", "wire_dtype", "bf16"),
    "hetero.weight_sync": ("hetero.weight_sync=delta", "store", "delta", True),
    "hetero.max_delta_chain": ("hetero.max_delta_chain=3", "store", "max_delta_chain", 3),
}
"""Pool keys a pool's loop reads (recipe/gepo/pool.py: ``SamplerLoop.init_loop(**sampler_loop_options())``,
``WeightStore(**weight_store_options())``), as the embedded engine's samplers do."""


@pytest.mark.parametrize("key", sorted(LOOP_KEYS))
def test_each_pool_key_a_pool_reads_reaches_its_loop_or_weight_store(key):
    from recipe.gepo.sections import HeteroConfig

    override, where, argument, value = LOOP_KEYS[key]

    def options(*extra):
        hetero = HeteroConfig.from_omegaconf(
            compose_config([*COMMON, "hetero.trust.sign_records=false", *extra]).hetero
        )
        return hetero.sampler_loop_options() if where == "loop" else hetero.weight_store_options()

    assert options()[argument] != value and options(override)[argument] == value


def test_a_pool_builds_its_loop_from_the_shared_options():
    """The pool's source passes the section's options, not its own copy of them (the contract above)."""
    source = (ROOT / "recipe/gepo/pool.py").read_text()
    assert "**hetero.sampler_loop_options()" in source and "**hetero.weight_store_options()" in source
