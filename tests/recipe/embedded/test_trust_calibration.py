"""bf16 bounds calibrated on the run's own model (``python -m recipe.gepo.calibrate``,
``hetero.trust.bounds_file``): the command measures honest bf16 groups of the tiny toy model as the
gate re-scores them, the real TrustGate then holds bf16 samplers to those bounds, and a config whose
calibration was measured for another model or temperature is refused at start."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from recipe.gepo.calibrate import main as calibrate_main
from recipe.gepo.embedded.engine_config import EngineConfig
from recipe.gepo.embedded.policy import load_policy
from verl_ext.trust.verifier import group_log_probs
from recipe.gepo.options import ConfigError
from verl_ext.trust.bounds import BOUND_FIELDS, TOLERANCES, bounds_file_payload, read_bounds_file

from .helpers import TINY, compose_cfg
from .test_trust_gate import Lab


@pytest.fixture(scope="module")
def calibration(tiny_model_path, tmp_path_factory):
    """The command run on the tiny model (a bf16 sampler against the default fp32 scorer)."""
    out = tmp_path_factory.mktemp("calibration") / "bounds.json"
    calibrate_main(
        [
            "--out",
            str(out),
            "--groups",
            "64",
            *TINY,
            f"actor_rollout_ref.model.path={tiny_model_path}",
            "hetero.mode=async",
        ]
    )
    return out


def _bf16(model_path):
    model, _ = load_policy(model_path)
    return model.to(torch.bfloat16).eval()


def _scaled(groups, factor):
    """q reported as factor x log q: a small lie on every token (log q stays <= 0)."""
    for g in groups:
        g.sampler_logprobs = (g.sampler_logprobs * factor).astype(np.float32)
    return groups


def test_the_command_writes_bounds_from_the_models_own_spread(calibration, tiny_model_path):
    bounds, measured = read_bounds_file(str(calibration))
    data = json.loads(calibration.read_text())
    assert measured["model"] == tiny_model_path and measured["scorer_precision"] == "fp32"
    assert measured["groups"] == 64 and measured["temperature"] == 1.0 and "rule" in data
    honest, mine, table = measured["honest"], bounds["bf16"], TOLERANCES["bf16"]
    print({name: (getattr(mine, name), getattr(table, name)) for name in BOUND_FIELDS})
    # every per-group bound above the largest honest value it was measured from
    assert mine.token_max > honest["token_max_largest"] > 0
    assert mine.group_mean_abs > honest["group_mean_abs_largest"]
    assert mine.group_kl > honest["group_kl_largest"]
    # the CUSUMs' references above the honest mean: honest sums drift down
    assert mine.reference > honest["group_mean_abs_median"]
    # this model's bf16 arithmetic moves log q far less than SmolLM2's: tighter than the table
    assert mine.token_max < table.token_max and mine.group_mean_abs < table.group_mean_abs


def test_a_calibration_catches_a_lie_the_table_lets_through(calibration, tiny_model_path, tmp_path):
    bf16 = _bf16(tiny_model_path)
    table = Lab(tiny_model_path, tmp_path / "table", "hetero.trust.verify_fraction=1")
    mine = Lab(
        tiny_model_path, tmp_path / "mine", "hetero.trust.verify_fraction=1", f"hetero.trust.bounds_file={calibration}"
    )
    assert mine.gate.verifier.tolerance("bf16") == read_bounds_file(str(calibration))[0]["bf16"]
    assert mine.gate.verifier.tolerance("fp32") == table.gate.verifier.tolerance("fp32")  # fp32 untouched
    assert table.gate.precisions == ("fp32",) and mine.gate.precisions == ("bf16", "fp32")
    # honest bf16 groups (prompts of another stream than the calibration's) pass the calibrated run;
    # the run without a calibration does not accept bf16 at all
    honest = [g for _ in range(4) for g in mine.groups("honest", n=8, model=bf16)]
    assert [mine.offer(g) for g in honest] == [None] * len(honest)
    refused = [table.offer(g) for g in table.groups("honest", n=8, model=bf16)]
    assert refused == ["precision_not_accepted"] * 8
    # a sampler reporting q x 1.02 on every group: the table's bounds would admit all of it (this
    # model's log q are small: 1.02 x moves them under SmolLM2's honest spread), the calibration refuses it
    table.gate.precisions = None  # the table's bf16 bounds, as a gate accepting any known precision applies them
    verdicts = {}
    for name, lab in (("table", table), ("calibrated", mine)):
        liar = _scaled([g for _ in range(3) for g in lab.groups("liar", n=8, model=bf16)], 1.02)
        verdicts[name] = [lab.offer(g) for g in liar]
    print(verdicts)
    assert verdicts["table"] == [None] * 24
    assert "bad_logprobs" in verdicts["calibrated"]
    assert verdicts["calibrated"].index("bad_logprobs") < 12  # within a dozen checked groups
    assert mine.gate.ledger.refusal("liar") == "quarantined"


def _engine(tmp_path, model_path, *overrides):
    cfg = compose_cfg(
        TINY + [f"actor_rollout_ref.model.path={model_path}", f"trainer.default_local_dir={tmp_path}", *overrides]
    )
    return EngineConfig.from_omegaconf(cfg)


def test_a_calibration_of_another_model_is_refused_at_start(tmp_path, tiny_model_path):
    path = tmp_path / "bounds.json"
    measured = {"model": "another/model", "scorer_precision": "fp32", "temperature": 1.0}
    path.write_text(json.dumps(bounds_file_payload("bf16", TOLERANCES["bf16"], measured)))
    with pytest.raises(ConfigError, match=r"hetero.trust.bounds_file=.*measured with model='another/model'"):
        _engine(tmp_path, tiny_model_path, "hetero.mode=async", f"hetero.trust.bounds_file={path}")
    path.write_text(json.dumps(bounds_file_payload("bf16", TOLERANCES["bf16"], {**measured, "model": tiny_model_path})))
    engine = _engine(tmp_path, tiny_model_path, "hetero.mode=async", f"hetero.trust.bounds_file={path}")
    assert engine.hetero.trust.bounds().calibrated["bf16"].tie_margin == 1.2


def test_a_run_that_rescores_in_bf16_needs_bounds_for_its_own_model(tmp_path, tiny_model_path):
    """The table's bf16 bounds are SmolLM2's: an async run whose learner re-scores in bf16 is refused
    without a bounds file, naming both keys; replay (no re-scores), verify_fraction=0 and a file
    measured for this model and a bf16 scorer start."""
    bf16 = ["hetero.sampler_precision=bf16"]
    with pytest.raises(ConfigError, match=r"hetero.sampler_precision=bf16 .*hetero.trust.bounds_file is empty"):
        _engine(tmp_path, tiny_model_path, "hetero.mode=async", *bf16)
    assert _engine(tmp_path, tiny_model_path, "hetero.mode=replay", *bf16).hetero.sampler_precision == "bf16"
    _engine(tmp_path, tiny_model_path, "hetero.mode=async", "hetero.trust.verify_fraction=0", *bf16)
    table = _engine(tmp_path, tiny_model_path, "hetero.mode=async", "hetero.trust.bounds_file=table", *bf16)
    assert table.hetero.trust.bounds().calibrated == {}  # the table's bounds, named on purpose
    path = tmp_path / "bounds.json"
    measured = {"model": tiny_model_path, "scorer_precision": "bf16", "temperature": 1.0}
    path.write_text(json.dumps(bounds_file_payload("bf16", TOLERANCES["bf16"], measured)))
    engine = _engine(tmp_path, tiny_model_path, "hetero.mode=async", f"hetero.trust.bounds_file={path}", *bf16)
    assert "bf16" in engine.hetero.trust.bounds().calibrated


@pytest.mark.parametrize("fact, value", [("temperature", 0.7), ("scorer_precision", "bf16")])
def test_a_calibration_of_another_temperature_or_scorer_is_refused(tmp_path, fact, value):
    """(Replay and the verl engine refuse the option itself: tests/recipe/test_options.py.)"""
    from verl_ext.trust.config import TrustConfig

    path = tmp_path / "bounds.json"
    measured = {"model": "m", "scorer_precision": "fp32", "temperature": 1.0}
    path.write_text(json.dumps(bounds_file_payload("bf16", TOLERANCES["bf16"], {**measured, fact: value})))
    trust = TrustConfig(bounds_file=str(path))
    trust.validate()
    with pytest.raises(ValueError, match=rf"hetero.trust.bounds_file=.*measured with {fact}="):
        trust.check_calibration(**measured)


@pytest.fixture(scope="module")
def checkable_calibration(tiny_model_path, tmp_path_factory):
    """The command with checkable sampling on: the bounds include the near-tie test."""
    out = tmp_path_factory.mktemp("calibration") / "bounds.json"
    overrides = [*TINY, f"actor_rollout_ref.model.path={tiny_model_path}", "hetero.mode=async", CHECKABLE]
    calibrate_main(["--out", str(out), "--groups", "64", *overrides])
    return out


CHECKABLE = "hetero.trust.checkable_sampling=true"


def test_a_sampler_drawing_from_other_weights_is_caught_by_its_near_ties(
    checkable_calibration, tiny_model_path, tmp_path
):
    """Tokens drawn from weights a little off the declared version's, q what the declared weights
    give those tokens (the log-q checks see an honest q): each token within the token check's margin
    of its seed's choice (the calibration's margin widened here, so that no token is a mismatch on
    this 4-token task), but such near ties come more often than honest bf16 arithmetic makes them,
    and the calibration's near-tie test adds them up."""
    from .test_checkable_sampling_gate import _groups

    data = json.loads(checkable_calibration.read_text())
    mine = data["bounds"]["bf16"]
    assert mine["near_tie_rate"] and mine["near_tie_limit"]
    mine["tie_margin"] = 2.0
    widened = tmp_path / "widened.json"
    widened.write_text(json.dumps(data))
    lab = Lab(
        tiny_model_path, tmp_path, "hetero.trust.verify_fraction=1", CHECKABLE, f"hetero.trust.bounds_file={widened}"
    )
    bf16 = _bf16(tiny_model_path)
    honest = [g for _ in range(8) for g in _groups(lab, "honest", bf16, n=8)]
    # (the tiny task repeats prompts: an identical group is a replay, refused without blame)
    assert set(lab.offer(g) for g in honest) <= {None, "replayed"}
    assert lab.gate.cusum.ties.get("honest", 0.0) < mine["near_tie_limit"]
    other = _bf16(tiny_model_path)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for p in other.parameters():
            p.add_(3e-3 * torch.sign(torch.randn(p.shape, generator=generator)).to(p.dtype))
    liar = [g for _ in range(16) for g in _groups(lab, "liar", other, n=8)]
    for g in liar:  # q as the declared weights give it for these tokens: the log-q checks see an honest q
        g.sampler_logprobs = (group_log_probs(bf16, g, 1.0) * g.response_mask).astype(np.float32)
    reasons = [lab.offer(g) for g in liar]
    details = [e["detail"] for e in lab.gate.drain_events() if e.get("sampler_id") == "liar" and "detail" in e]
    print(
        reasons.index("bad_logprobs") if "bad_logprobs" in reasons else None,
        details[:1],
        lab.gate.verifier.token_counts,
    )
    assert "token_mismatch" not in reasons and "bad_logprobs" in reasons
    assert details and "near ties" in details[0], details


@pytest.mark.parametrize(
    "override, message",
    [
        ("hetero.max_dealy=3", "error: unknown key(s) hetero.max_dealy (did you mean hetero.max_delay?)"),
        ("hetero.max_delay=-2", "error: hetero.max_delay=-2"),
        ("algorithm_preset=nope", "error: algorithm_preset=nope: there is no algorithm_preset/nope.yaml"),
    ],
)
def test_a_refused_override_is_one_error_line(tmp_path, monkeypatch, capsys, override, message):
    monkeypatch.delenv("HETERORL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_:
        calibrate_main(["--out", str(tmp_path / "bounds.json"), override])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and err[0].startswith(message), err
    assert not (tmp_path / "bounds.json").exists()
