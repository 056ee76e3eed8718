"""Log-prob checks that hold for bf16 samplers as for fp32 ones: the sampler declares its precision
in its signed record, the learner's bounds come from that precision's measured honest spread, and a
per-sampler CUSUM adds up small systematic lies. Real groups: the tiny toy model sampling in bf16 on
the CPU, re-scored by the real TrustGate in fp32 with the weights the learner published."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from recipe.gepo.embedded.policy import load_policy
from verl_ext.trust.verifier import group_log_probs
from verl_ext.trust.bounds import TOLERANCES, MismatchCusum, bounds_file_payload, group_mismatch, precision_of
from verl_ext.hetero.records import RolloutGroup

from .test_trust_gate import Lab


def _bf16(model_path):
    model, _ = load_policy(model_path)
    return model.to(torch.bfloat16).eval()


def _first_failure(lab, groups) -> int | None:
    """1-based index of the first group the gate refuses, or None."""
    for i, group in enumerate(groups, start=1):
        if lab.offer(group) is not None:
            return i
    return None


def test_honest_bf16_groups_pass_and_a_temperature_liar_is_caught_at_once(tiny_model_path, tmp_path):
    lab = Lab(tiny_model_path, tmp_path, "hetero.trust.verify_fraction=1")
    lab.gate.precisions = None  # the table's bf16 bounds, as a gate accepting any known precision applies them
    bf16 = _bf16(tiny_model_path)
    honest = [g for _ in range(6) for g in lab.groups("sampler-0", n=8, model=bf16)]
    assert {g.sampler_precision for g in honest} == {"bf16"}
    # the old bound (1e-3 on any token) would have refused them
    spreads = [group_mismatch(g.sampler_logprobs, group_log_probs(lab.model, g, 1.0), g.response_mask) for g in honest]
    print(
        f"honest bf16: max a token {max(m.token_max for m in spreads):.3g}, "
        f"group means {min(m.mean_abs for m in spreads):.3g}..{max(m.mean_abs for m in spreads):.3g}"
    )
    assert np.mean([m.token_max > 1e-3 for m in spreads]) > 0.5
    assert _first_failure(lab, honest) is None  # 48 checked groups, none refused, the CUSUM at rest
    assert lab.gate.metrics()["trust/checked"] == 48 and lab.gate.cusum.sums["sampler-0"] < 0.05
    # a liar draws at temperature 1.0 and reports q at 0.7
    liar = lab.groups("sampler-1", n=4, model=bf16)
    for g in liar:
        g.sampler_logprobs = (group_log_probs(bf16, g, 0.7) * g.response_mask).astype(np.float32)
    reasons = [lab.offer(g) for g in liar]
    caught = next(i for i, r in enumerate(reasons) if r is not None)
    print(f"T=0.7 liar: {reasons}")
    assert caught <= 2 and reasons[caught] == "bad_logprobs" and set(reasons[caught + 1 :]) <= {"quarantined"}
    assert lab.gate.ledger.refusal("sampler-1") == "quarantined"
    assert lab.gate.drain_events()[-1]["reason"] == "bad_logprobs"


@pytest.mark.parametrize("precision, bias, within", [("bf16", 0.04, 20), ("fp32", 3e-4, 12)])
def test_a_small_systematic_lie_adds_up_while_honest_noise_does_not(tiny_model_path, tmp_path, precision, bias, within):
    """q lowered by ``bias`` on every token: under every per-group bound (the fp32 one is 1e-3 a
    token), caught by the sum over the sampler's checked groups."""
    lab = Lab(tiny_model_path, tmp_path, "hetero.trust.verify_fraction=1")
    lab.gate.precisions = None  # the table's bounds of the declared precision (a run needs a calibration for bf16)
    model = _bf16(tiny_model_path) if precision == "bf16" else lab.model
    tol = lab.gate.verifier.tolerance(precision)
    groups = [g for _ in range(3) for g in lab.groups("sampler-2", n=8, model=model)]
    for g in groups:
        g.sampler_logprobs = (g.sampler_logprobs - bias * g.response_mask).astype(np.float32)  # log q stays <= 0
        m = group_mismatch(g.sampler_logprobs, group_log_probs(lab.model, g, 1.0), g.response_mask)
        assert m.token_max <= tol.token_max and m.mean_abs <= tol.group_mean_abs and m.kl <= tol.group_kl
    caught = _first_failure(lab, groups)
    print(f"{precision}: q lowered by {bias:g} a token, refused at checked group {caught}")
    assert caught is not None and caught > 2 and caught <= within, caught  # not at once: it added up
    assert "a small lie, repeated" in lab.gate.drain_events()[-1]["detail"]


def test_cusum_keeps_honest_noise_at_rest_and_restarts_after_an_alarm():
    from verl_ext.trust.bounds import Mismatch

    tol, cusum = TOLERANCES["bf16"], MismatchCusum()
    rng = np.random.default_rng(0)
    for _ in range(2000):  # honest: means around SmolLM2's measured 0.033 a token, tails to 0.06
        assert (
            cusum.add(
                "honest", Mismatch(0.3, float(np.clip(rng.normal(0.033, 0.008), 0, None)), 1e-3, 100), tol, "bf16"
            )
            is None
        )
    lie = Mismatch(0.3, tol.reference + 0.04, 1e-3, 100)  # noisier than honest, zero-mean
    alarms = [i for i in range(1, 40) if cusum.add("liar", lie, tol, "bf16") is not None]
    assert alarms[:2] == [8, 16]  # 0.04 a group over the reference: 0.32 > 0.3 at the 8th; then from 0 again
    shifted = Mismatch(0.3, 0.05, 1e-3, 100, mean_signed=-0.05)  # q one way on every token, |Δ| under the reference
    alarms = [i for i in range(1, 20) if cusum.add("shifted", shifted, tol, "bf16") is not None]
    assert alarms[0] == 4  # 0.03 a group over the bias reference: 0.12 > 0.1 at the 4th
    again = MismatchCusum()
    again.load_state_dict(cusum.state_dict())
    assert again.sums == cusum.sums and again.bias == cusum.bias


def test_an_undeclared_or_unknown_precision_is_refused_by_name(tiny_model_path, tmp_path):
    lab = Lab(tiny_model_path, tmp_path)
    undeclared, unknown, declared = lab.groups("sampler-3", n=3)
    undeclared.sampler_precision = None
    unknown.sampler_precision = "fp8"
    assert lab.offer(undeclared) == "undeclared_precision"
    assert lab.offer(unknown) == "unknown_precision"
    assert lab.offer(declared) is None  # without blame
    assert lab.gate.metrics()["trust/refused/unknown_precision"] == 1


def test_the_precision_travels_in_the_record():
    model = torch.nn.Linear(2, 2)
    assert precision_of(model) == "fp32" and precision_of(model.to(torch.bfloat16)) == "bf16"
    assert precision_of(model.to(torch.float16)) == "float16"  # named as torch names it: refused as unknown
    group = RolloutGroup(
        "u",
        np.array([1, 2]),
        np.array([[3, 4]]),
        np.ones((1, 2), np.int8),
        np.full((1, 2), -0.5, np.float32),
        np.zeros(1, np.float32),
        np.zeros(1, np.float32),
        0,
        "s",
        sampler_precision="bf16",
    )
    assert RolloutGroup.from_bytes(group.to_bytes()).sampler_precision == "bf16"
    group.sampler_precision = None
    assert RolloutGroup.from_bytes(group.to_bytes()).sampler_precision is None


def test_a_sampler_cannot_widen_its_bounds_by_the_precision_it_declares(tiny_model_path, tmp_path):
    """A run accepts the precision its config names (hetero.sampler_precision) and those its
    bounds_file calibrated: an fp32 run refuses a group declaring bf16 (wider bounds) and a bf16
    run one declaring fp32, without blame (a misconfigured sampler, not a lie shown)."""
    fp32_run = Lab(tiny_model_path, tmp_path / "fp32", "hetero.trust.verify_fraction=1")
    assert fp32_run.gate.precisions == ("fp32",)
    declared_bf16 = [g for g in fp32_run.groups("sampler-4", n=4, model=_bf16(tiny_model_path))]
    assert {g.sampler_precision for g in declared_bf16} == {"bf16"}
    assert [fp32_run.offer(g) for g in declared_bf16] == ["precision_not_accepted"] * 4
    assert fp32_run.gate.ledger.refusal("sampler-4") is None  # no blame
    bounds = tmp_path / "bounds_bf16.json"  # a bf16 scorer needs bounds for its model (the table's values here)
    measured = {"model": str(tiny_model_path), "scorer_precision": "bf16", "temperature": 1.0}
    bounds.write_text(json.dumps(bounds_file_payload("bf16", TOLERANCES["bf16"], measured)))
    bf16_run = Lab(
        tiny_model_path,
        tmp_path / "bf16",
        "hetero.sampler_precision=bf16",
        "hetero.trust.verify_fraction=1",
        f"hetero.trust.bounds_file={bounds}",
    )
    assert bf16_run.gate.verifier.scorer_precision == "bf16" and bf16_run.gate.precisions == ("bf16",)
    declared_fp32 = bf16_run.groups("sampler-5", n=4)  # the fp32 model: declared fp32
    assert [bf16_run.offer(g) for g in declared_fp32] == ["precision_not_accepted"] * 4
