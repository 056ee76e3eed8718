"""hetero.trust.checkable_sampling end to end on the CPU, with the real toy model, the real trust gate
and buffer: the sampler's groups drawn by seeded Gumbel-max (rollout.generate_groups(checkable=True)),
the seed in the signed record, the gate re-deriving each checked group's tokens from the logits of
its re-scoring forward. Honest fp32 and bf16 samplers pass; a sampler drawing at T=0.7 whose q is
the T=1 q of its own tokens (the log-q check alone passes it) is caught by the token check; a seed
changed after signing breaks the signature, and a group without a seed is refused by name."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from recipe.gepo.embedded.policy import load_policy
from verl_ext.trust.verifier import group_log_probs
from verl_ext.trust.signing import Enrolment, SamplerKey
from verl_ext.hetero.records import RecordRejected, RolloutGroup

from .test_trust_gate import Lab

ON = "hetero.trust.checkable_sampling=true"


def _groups(lab, sampler, model=None, temperature=None, n=2, checkable=True):
    return lab.groups(sampler, n=n, model=model, temperature=temperature, checkable=checkable, seed_base=100)


@pytest.fixture(scope="module")
def lab(tiny_model_path, tmp_path_factory):
    lab = Lab(tiny_model_path, tmp_path_factory.mktemp("checkable"), ON)
    # the token check of fp32 and bf16 samplers side by side, with the table's margins (a run accepts
    # bf16 from samplers only in a bf16 run or with a calibration: test_trust_precision.py)
    lab.gate.precisions = None
    return lab


def test_honest_seeded_samplers_pass_in_fp32_and_bf16(lab, tiny_model_path):
    bf16, _ = load_policy(tiny_model_path)
    bf16 = bf16.to(torch.bfloat16).eval()
    before = dict(lab.gate.verifier.token_counts)
    for sampler, model, precision in (("honest-fp32", lab.model, "fp32"), ("honest-bf16", bf16, "bf16")):
        for _ in range(3):  # within probation: every group is checked
            for group in _groups(lab, sampler, model):
                assert group.sampler_precision == precision and isinstance(group.sampling_seed, int)
                assert lab.offer(group) is None
    counts = lab.gate.verifier.token_counts
    assert counts["tokens_checked"] - before.get("tokens_checked", 0) > 50  # the tokens were checked, not skipped
    assert counts["token_mismatches"] == before.get("token_mismatches", 0)
    metrics = lab.gate.metrics()
    assert metrics["trust/tokens_checked"] == counts["tokens_checked"] and metrics.get("trust/quarantined", 0) == 0


def test_the_draw_is_the_seeds(lab):
    """Same seed, same tokens (any machine re-derives them); another seed, other tokens."""
    a = _groups(lab, "s")[0]
    lab.batches -= 1
    b = _groups(lab, "s")[0]
    assert a.sampling_seed == b.sampling_seed and np.array_equal(a.response_ids, b.response_ids)
    c = dataclasses.replace(a, sampling_seed=a.sampling_seed + 1)
    lab.gate.verifier.checkable_sampling = True
    failure, _ = lab.gate.verifier.measure_logprobs(c)
    assert failure is not None and failure[0] == "token_mismatch"


def test_a_sampler_at_another_temperature_with_matching_q_is_caught_by_the_token_check(lab):
    """Drawn at T=0.7 with the seed's noise, q reported as the T=1 log-probs of those very tokens:
    the log-q check passes it, the token check does not; the sampler is quarantined."""
    liar = _groups(lab, "liar-t07", temperature=0.7, n=4)
    for g in liar:
        g.sampler_logprobs = (group_log_probs(lab.model, g, 1.0) * g.response_mask).astype(np.float32)
    verifier = lab.gate.verifier
    verifier.checkable_sampling = False
    try:
        assert all(verifier.measure_logprobs(g)[0] is None for g in liar)  # q alone: consistent
    finally:
        verifier.checkable_sampling = True
    reasons = [lab.offer(g) for g in liar]
    # the tiny model at T=0.7 picks another token at ~3% of positions: a group of short answers may have none
    caught = reasons.index("token_mismatch")
    assert set(reasons[caught + 1 :]) <= {"quarantined"} and caught < len(reasons) - 1, reasons
    assert lab.gate.ledger.refusal("liar-t07") == "quarantined"
    assert lab.gate.metrics()["trust/failed/token_mismatch"] >= 1


def test_a_group_without_a_seed_is_refused_by_name(lab):
    group = _groups(lab, "unseeded", n=1, checkable=False)[0]
    assert group.sampling_seed is None
    with pytest.raises(RecordRejected, match="sampling_seed=None.*checkable_sampling") as err:
        lab.gate.admit(group)
    assert err.value.reason == "unseeded" and err.value.field == "sampling_seed"
    assert lab.gate.ledger.refusal("unseeded") is None  # no blame: a sampler not set up for it


def test_a_seed_changed_after_signing_breaks_the_signature(lab):
    key = SamplerKey.generate("signer")
    enrolment = Enrolment()
    enrolment.enrol("signer", key.public_hex())
    group = _groups(lab, "signer", n=1)[0]
    envelope = key.seal(group.to_bytes())
    assert RolloutGroup.from_bytes(enrolment.open(envelope)[1]).sampling_seed == group.sampling_seed
    record = group.to_bytes()
    forged = dataclasses.replace(group, sampling_seed=group.sampling_seed + 1).to_bytes()
    tampered = envelope[: len(envelope) - len(record)] + forged  # the signature of the original seed
    with pytest.raises(RecordRejected) as err:
        enrolment.open(tampered)
    assert err.value.reason == "bad_signature"


def test_the_token_check_costs_milliseconds_a_group(lab):
    """What the check adds to a re-score (measured, printed; bounded loosely for a loaded CPU)."""
    groups = _groups(lab, "timing", n=4)
    verifier = lab.gate.verifier

    def seconds(check: bool) -> float:
        verifier.checkable_sampling = check
        t0 = time.thread_time()
        for g in groups:
            assert verifier.measure_logprobs(g)[0] is None
        return (time.thread_time() - t0) / len(groups)

    try:
        seconds(True)  # the version's weights loaded
        off, on = seconds(False), seconds(True)
    finally:
        verifier.checkable_sampling = True
    tokens = sum(int(g.response_mask.sum()) for g in groups) / len(groups)
    print(f"re-score {off * 1e3:.1f} ms a group, with the token check {on * 1e3:.1f} ms ({tokens:.0f} tokens)")
    assert on < off + 1.0


@pytest.mark.slow
def test_an_async_run_with_checkable_sampling_refuses_no_honest_group(tiny_model_path, tmp_path):
    """Async mode with the option on (2 samplers, 3 steps, ~40 s): the samplers draw by seeded
    Gumbel-max with the seeds the learner assigns, the learner checks the tokens of every group on
    probation, and none fails."""
    from recipe.gepo.main_gepo import run

    from .helpers import TINY, compose_cfg, read_metrics, train_lines

    cfg = compose_cfg(
        TINY
        + [
            f"actor_rollout_ref.model.path={tiny_model_path}",
            f"trainer.default_local_dir={tmp_path}",
            "hetero.mode=async",
            "hetero.num_samplers=2",
            "hetero.max_delay=2",
            "hetero.wait_timeout_s=120",
            ON,
            "trainer.total_training_steps=3",
            "trainer.test_freq=0",
            "trainer.save_freq=0",
            "trainer.experiment_name=test-checkable",
        ]
    )
    run(cfg)
    last = train_lines(read_metrics(tmp_path))[-1]
    print({k: v for k, v in last.items() if k.startswith("trust/")})
    assert last["trust/checked"] >= 4 and last["trust/failed"] == 0 and last["trust/quarantined"] == 0
    assert last["trust/tokens_checked"] > 0 and last.get("trust/token_mismatches", 0) == 0
    assert last.get("trust/refused/unseeded", 0) == 0
    # every group drawn with the seed the learner assigned its slot (published as control/gumbel-key)
    assert last.get("trust/refused/unassigned", 0) == 0 and last.get("trust/refused/slot_reused", 0) == 0
