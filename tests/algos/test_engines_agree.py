"""The one actor objective (``verl_ext.algos.objective.compute_actor_loss``) in both engines.

Cross-engine: the same micro-batch (three prompt groups of the toy model's tokens) goes through
the embedded learner (``Learner.loss``: its own forward, entropy from its logits, a frozen
reference copy of the initial weights) and through verl's real FSDP2 engine on the CPU
(``tests/algos/verl_fsdp_objective.py``, a separate single-rank gloo process: verl's
``TrainingWorker``, ``forward_backward_batch``, the worker loss ``hetero_ppo_loss`` installed as
the verl engine installs it). For every algorithm preset, with the entropy bonus and the
KL-to-reference term on, the loss and the gradient of every parameter must agree.

Rollout correction in both engines: ``Learner(rollout_correction=...)`` against verl's driver-side
weights (``compute_rollout_correction_and_add_to_batch`` on the recomputed proximal log-probs)
handed to the worker loss.

Per option, in the embedded engine: ``entropy_coeff`` adds exactly -coef x grad(entropy),
``use_kl_loss`` pulls the weights toward the reference, ``rollout_correction`` weights the loss
with verl's truncated IS weights (and the learner equals the replay engine's TruncatedISLearner).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from verl import DataProto
from verl.trainer.config import RolloutCorrectionConfig
from verl.trainer.ppo.rollout_corr_helper import (
    compute_rollout_correction_and_add_to_batch,
    compute_rollout_correction_weights,
)
from verl.utils.config import omega_conf_to_dataclass

from tests.subsets import default_run_keeps
from recipe.gepo.embedded.learner import Learner, collate_groups, log_probs_and_entropy
from recipe.gepo.embedded.policy import load_policy
from verl_ext.sampling import sequence_token_log_probs
from verl_ext.hetero.records import RolloutGroup
from verl_ext.algos.objective import RolloutCorrection, compute_actor_loss, rollout_correction_settings

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.stem for p in (ROOT / "recipe" / "gepo" / "config" / "algorithm_preset").glob("*.yaml"))
TEMPERATURE = 0.8
ACTOR = "actor_rollout_ref.actor"
# entropy bonus and KL-to-reference on, both large enough to move the gradient visibly
OBJECTIVE = [
    "actor_rollout_ref.actor.entropy_coeff=0.05",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.5",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    f"actor_rollout_ref.rollout.temperature={TEMPERATURE}",
    "actor_rollout_ref.rollout.n=4",
    "data.max_response_length=8",  # > the batch's response width (6): loss_scale_factor is not the padded length
]
# verl's engine runs the 12 sequences as one micro-batch, and as two of 6 (partial prompt
# groups), where the global-batch normalisation must make their sum the whole batch's objective
MICRO_BATCH_SIZES = [12, 6]
# losses that normalise within the micro-batch the loss sees, so a split changes them
NOT_SPLITTABLE = {
    "delta_l": "delta_l normalises its length weights x_i within the micro-batch (delta_l_aggregate's docstring)",
    "gmpo": "verl's geo_mean averages over the micro-batch's sequences, ignoring global_batch_size",
    "m2po": "M2PO's second-moment mask is taken over the tokens of the micro-batch (as AReaL's)",
    "gepo_tc_ess": "the clip band's ESS is measured over the micro-batch's tokens",
}
# a split changes these only when a token sits between the two bands; on this test's batch none
# does, so the two engines agree at every split and the test asserts that (no expected failure)
SPLIT_EQUAL_ON_THIS_BATCH = {"gepo_tc_ess", "m2po"}

# rollout correction in both engines: the embedded Learner(rollout_correction=...) vs verl's
# driver-side weights handed to the worker loss (verl_engine.old_log_prob=recompute)
# (key -> (preset, settings)): truncated IS at both levels, IcePop's bounds, and rejection sampling
# (which removes tokens from the loss's mask in both engines)
CORRECTED = {
    "grpo-tis": ("grpo", RolloutCorrection(rollout_is="token", rollout_is_threshold=1.1)),
    "gspo-tis": ("gspo", RolloutCorrection(rollout_is="sequence", rollout_is_threshold=1.5)),
    "grpo-icepop": ("grpo", RolloutCorrection(rollout_is="token", rollout_is_threshold="0.9_1.1")),
    "grpo-rs": (
        "grpo",
        RolloutCorrection(
            rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25"
        ),
    ),
}


@functools.cache
def composed(preset: str, *overrides: str) -> DictConfig:
    """``gepo_trainer`` with an algorithm preset and overrides, composed once per distinct set:
    a hydra compose costs ~0.4 s of CPU and this module asks for the same ~30 sets ~100 times.
    Callers only read it (``omega_conf_to_dataclass`` builds a fresh dataclass each call)."""
    with initialize_config_dir(config_dir=str(ROOT / "recipe" / "gepo" / "config"), version_base=None):
        return compose(config_name="gepo_trainer", overrides=[f"algorithm_preset={preset}", *overrides])


def _preset_corrections() -> dict:
    """The presets that switch rollout correction on, with their own settings (the OBJECTIVE
    overrides leave ``algorithm`` alone; composed with them, the cache serves actor_config too)."""
    out = {}
    for preset in PRESETS:
        settings = rollout_correction_settings(composed(preset, *OBJECTIVE).algorithm)
        if settings is not None:
            out[f"{preset}-preset"] = (preset, settings)
    return out


CORRECTED.update(_preset_corrections())


@pytest.fixture(scope="module")
def tiny_model_path() -> str:
    """The tests' cached toy warm start (same arguments as tests/recipe/embedded/conftest.py)."""
    import tempfile

    from verl_ext.data.toy.checkpoints import warm_start

    cache = Path(os.environ.get("HETERORL_TEST_CACHE", Path(tempfile.gettempdir()) / "heterorl-test-cache"))
    return str(warm_start(cache, digits=1, steps=50, n_eval=32, batch_size=32, warmup_steps=5))


def actor_config(preset: str, *overrides: str):
    return omega_conf_to_dataclass(composed(preset, *OBJECTIVE, *overrides).actor_rollout_ref.actor)


def perturb_(model, scale: float = 0.02, seed: int = 7) -> None:
    """Move the weights off the reference (so KL-to-reference and its gradient are not zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))


def make_groups(model, tokenizer, seed: int = 0, sizes=((3, [4, 6, 2, 5]), (5, [1, 3, 6, 6]), (2, [5, 2, 4, 3]))):
    """Three prompt groups of G=4 random toy-vocabulary sequences; q = the model's own log-probs
    plus noise (ratios near 1, some clipped), per-sequence advantages r - mean."""
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    groups = []
    for gi, (prompt_len, lengths) in enumerate(sizes):
        width = max(lengths)
        mask = (np.arange(width)[None, :] < np.asarray(lengths)[:, None]).astype(np.int8)
        prompt = rng.integers(3, vocab, size=prompt_len)
        response = rng.integers(3, vocab, size=(len(lengths), width)) * mask + tokenizer.pad_token_id * (1 - mask)
        rewards = rng.integers(0, 2, size=len(lengths)).astype(np.float32)
        groups.append(
            RolloutGroup(
                group_uid=f"g{gi}",
                prompt_ids=prompt.astype(np.int64),
                response_ids=response.astype(np.int64),
                response_mask=mask,
                sampler_logprobs=np.zeros((len(lengths), width), np.float32),
                rewards=rewards,
                advantages=rewards - rewards.mean(),
                policy_version=0,
                sampler_id="s0",
            )
        )
    batch = collate_groups(groups, tokenizer.pad_token_id)
    with torch.no_grad():
        own = sequence_token_log_probs(
            model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"], TEMPERATURE
        )
    noisy = own + 0.15 * torch.from_numpy(rng.standard_normal(own.shape)).float()
    row = 0
    for group in groups:
        g, r = group.response_ids.shape
        group.sampler_logprobs = (noisy[row : row + g, :r].numpy() * group.response_mask).astype(np.float32)
        row += g
    return groups


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def learner_loss_and_grads(learner: Learner, groups):
    learner.model.zero_grad(set_to_none=True)
    loss, metrics, batch = learner.loss(groups)
    loss.backward()
    return loss.detach(), metrics, grads_of(learner.model), batch


def selected_runs(request) -> tuple[list[str], list[str]]:
    """The presets and rollout-corrected keys this session's selected tests of this module compare
    (verl's side costs ~1 s a run: the default run asks for a representative few, `make test-all` for all)."""
    presets, corrected = set(), set()
    for item in request.session.items:
        params = getattr(item, "callspec", None) and item.callspec.params
        if item.module is not request.module or not params:
            continue
        if "preset" in params:
            presets.add(params["preset"])
        if params.get("key") in CORRECTED:
            corrected.add(params["key"])
            presets.add(CORRECTED[params["key"]][0])
    return [p for p in PRESETS if p in presets], [k for k in CORRECTED if k in corrected]


@pytest.fixture(scope="module")
def setup(request, tiny_model_path, tmp_path_factory):
    """The initial model (= the reference), the perturbed model being trained (saved for verl's
    engine), the groups, and the verl engine's results for the presets the session's tests compare
    (one process)."""
    presets, corrected = selected_runs(request)
    tmp = tmp_path_factory.mktemp("objective")
    initial, tokenizer = load_policy(tiny_model_path)
    trained = copy.deepcopy(initial)
    perturb_(trained)
    trained.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    groups = make_groups(initial, tokenizer)
    batch = collate_groups(groups, tokenizer.pad_token_id)
    with torch.no_grad():  # the driver's reference log-probs (verl's ref worker: the initial weights)
        ref = sequence_token_log_probs(
            initial,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["response_ids"],
            batch["response_mask"],
            TEMPERATURE,
        )
    inp = {
        "model_path": str(tmp / "model"),
        "presets": presets,
        "overrides": OBJECTIVE,
        "micro_batch_sizes": MICRO_BATCH_SIZES,
        "temperature": TEMPERATURE,
        "uids": [g.group_uid for g in groups for _ in range(g.group_size)],
        "prompts": batch["prompt_ids"],
        "prompt_mask": batch["prompt_mask"],
        "responses": batch["response_ids"],
        "response_mask": batch["response_mask"],
        "old_log_probs": batch["sampler_logprobs"],
        "advantages": batch["advantages"],
        "ref_log_prob": ref * batch["response_mask"],
    }
    # rollout correction, verl's way: the driver recomputes old_log_probs with the actor (the
    # proximal policy: the trained weights before the update) and computes rollout_is_weights from
    # them and the sampler's rollout_log_probs with verl's own helper
    with torch.no_grad():
        proximal = (
            sequence_token_log_probs(
                trained,
                batch["prompt_ids"],
                batch["prompt_mask"],
                batch["response_ids"],
                batch["response_mask"],
                TEMPERATURE,
            )
            * batch["response_mask"]
        )
    inp["corrected"] = []
    for key in corrected:
        preset, settings = CORRECTED[key]
        driver = DataProto.from_dict(
            tensors={
                "old_log_probs": proximal,
                "rollout_log_probs": batch["sampler_logprobs"],
                "response_mask": batch["response_mask"].long(),
            }
        )
        rc_config = RolloutCorrectionConfig(**dataclasses.asdict(settings))
        driver, _ = compute_rollout_correction_and_add_to_batch(driver, rc_config)
        inp["corrected"].append(
            {
                "key": key,
                "preset": preset,
                "old_log_probs": proximal,
                "rollout_is_weights": driver.batch["rollout_is_weights"],
                "response_mask": driver.batch["response_mask"],
            }
        )
    torch.save(inp, tmp / "in.pt")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    script = ROOT / "tests" / "algos" / "verl_fsdp_objective.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp / "in.pt"), str(tmp / "out.pt")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    verl = torch.load(tmp / "out.pt", weights_only=False)
    return {"initial": initial, "tokenizer": tokenizer, "groups": groups, "verl": verl}


def _cases():
    for preset in PRESETS:
        for mbs in MICRO_BATCH_SIZES:
            marks = []
            if mbs < 12 and preset in NOT_SPLITTABLE and preset not in SPLIT_EQUAL_ON_THIS_BATCH:
                marks = [pytest.mark.xfail(strict=True, reason=NOT_SPLITTABLE[preset])]
            yield pytest.param(preset, mbs, marks=marks, id=f"{preset}-micro{mbs}")


# one per kind of loss and both micro-batch sizes by default (group, token, sequence, clipped-IS, TOPR)
FAST_CASES = ("gepo-micro12", "gepo-micro6", "grpo-micro6", "gspo-micro12", "cispo-micro6", "topr-micro12")


@pytest.mark.parametrize("preset, micro_batch_size", default_run_keeps(_cases(), FAST_CASES))
def test_both_engines_give_the_same_loss_and_gradient(setup, preset, micro_batch_size):
    config = actor_config(preset)
    assert config.entropy_coeff == 0.05 and config.use_kl_loss
    learner = Learner(copy.deepcopy(setup["initial"]), config, TEMPERATURE, setup["tokenizer"].pad_token_id)
    perturb_(learner.model)  # the same weights verl's engine loaded; the reference stays the initial copy
    loss, metrics, grads, _ = learner_loss_and_grads(learner, setup["groups"])
    theirs = setup["verl"][preset][micro_batch_size]

    assert metrics["actor/entropy_loss"] > 0 and metrics["actor/kl_loss"] > 0
    assert theirs["metrics"]["micro_batches"] == 12 // micro_batch_size
    assert theirs["metrics"]["actor/has_group_denominator"] == 1.0
    assert theirs["loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-6)
    # the loss-valued metrics are shares of the global batch: their sum over micro-batches is the whole's
    for key, name in (
        ("actor/loss", "actor/policy_loss"),
        ("actor/pg_loss", "actor/pg_loss"),
        ("actor/entropy_loss", "actor/entropy_loss"),
        ("actor/kl_loss", "kl_loss"),
    ):
        assert theirs["metrics"][name] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
    # a loss's own scalars (LossTerms.metrics) reach verl's metrics as well; over one micro-batch they agree
    for key in ("actor/m2po_masked_frac", "actor/tc_band_scale"):
        if key in metrics:
            assert key in theirs["metrics"], key
            if micro_batch_size == 12:
                assert theirs["metrics"][key] == pytest.approx(metrics[key], rel=1e-4, abs=1e-6), key
    assert ("actor/tc_band_scale" in metrics) == (preset == "gepo_tc_ess")
    assert set(grads) == set(theirs["grads"])
    total = sum(g.square().sum() for g in grads.values()).sqrt()
    assert total > 0
    for name, grad in grads.items():
        torch.testing.assert_close(theirs["grads"][name], grad, rtol=1e-3, atol=1e-4 * float(total), msg=name)


@pytest.mark.parametrize("key", list(CORRECTED))
@pytest.mark.parametrize("micro_batch_size", MICRO_BATCH_SIZES)
def test_both_engines_apply_the_same_rollout_correction(setup, key, micro_batch_size):
    preset, settings = CORRECTED[key]
    learner = Learner(
        copy.deepcopy(setup["initial"]),
        actor_config(preset),
        TEMPERATURE,
        setup["tokenizer"].pad_token_id,
        rollout_correction=settings,
    )
    perturb_(learner.model)
    loss, metrics, grads, _ = learner_loss_and_grads(learner, setup["groups"])
    assert 0 < metrics["is/tis_truncated_frac"] <= 1  # the threshold bites somewhere
    if settings.rollout_is == "token":
        assert metrics["is/tis_truncated_frac"] < 1  # ... and not everywhere
    if settings.rollout_rs is not None:
        assert 0 < metrics["is/rs_rejected_frac"] < 1  # rejection removed some tokens, not all
    else:
        assert "is/rs_rejected_frac" not in metrics
    theirs = setup["verl"][key][micro_batch_size]
    plain = setup["verl"][preset][micro_batch_size]
    assert abs(plain["loss"] - theirs["loss"]) > 1e-4  # the correction changes the objective
    assert theirs["loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-6)
    total = sum(g.square().sum() for g in grads.values()).sqrt()
    for name, grad in grads.items():
        torch.testing.assert_close(theirs["grads"][name], grad, rtol=1e-3, atol=1e-4 * float(total), msg=name)


# ---- each option in the embedded engine ---------------------------------------------------------


@pytest.fixture(scope="module")
def model_and_groups(tiny_model_path):
    initial, tokenizer = load_policy(tiny_model_path)
    return initial, tokenizer, make_groups(initial, tokenizer, seed=3)


def _learner(model_and_groups, *overrides, rollout_correction=None, preset="gepo"):
    initial, tokenizer, _ = model_and_groups
    config = actor_config(preset, *overrides)
    return Learner(
        copy.deepcopy(initial), config, TEMPERATURE, tokenizer.pad_token_id, rollout_correction=rollout_correction
    )


def test_entropy_coeff_adds_minus_coef_times_the_entropy_gradient(model_and_groups):
    groups = model_and_groups[2]
    off = _learner(model_and_groups, f"{ACTOR}.entropy_coeff=0", f"{ACTOR}.use_kl_loss=false")
    on = _learner(model_and_groups, f"{ACTOR}.entropy_coeff=0.3", f"{ACTOR}.use_kl_loss=false")
    assert not off.with_entropy and on.with_entropy
    loss_off, m_off, g_off, _ = learner_loss_and_grads(off, groups)
    loss_on, m_on, g_on, batch = learner_loss_and_grads(on, groups)
    assert "actor/entropy_loss" not in m_off
    # the entropy alone: token-mean per sequence, mean over sequences (gepo's loss_agg_mode)
    on.model.zero_grad(set_to_none=True)
    _, entropy = log_probs_and_entropy(on.model, batch, TEMPERATURE, with_entropy=True)
    mask = batch["response_mask"].float()
    mean_entropy = ((entropy * mask).sum(-1) / mask.sum(-1)).mean()
    mean_entropy.backward()
    g_entropy = grads_of(on.model)
    assert m_on["actor/entropy_loss"] == pytest.approx(mean_entropy.item(), rel=1e-5)
    assert loss_on.item() == pytest.approx(loss_off.item() - 0.3 * mean_entropy.item(), rel=1e-5)
    for name in g_off:
        torch.testing.assert_close(g_on[name], g_off[name] - 0.3 * g_entropy[name], rtol=1e-4, atol=1e-6)
    # and a few steps of pure entropy bonus raise the entropy
    pure = _learner(
        model_and_groups, f"{ACTOR}.entropy_coeff=1.0", f"{ACTOR}.use_kl_loss=false", f"{ACTOR}.optim.lr=3e-3"
    )
    before = pure.loss(groups)[1]["actor/entropy_loss"]
    for _ in range(3):
        pure.train_step(groups)
    assert pure.loss(groups)[1]["actor/entropy_loss"] > before


def test_use_kl_loss_keeps_a_frozen_reference_and_pulls_toward_it(model_and_groups):
    initial, tokenizer, groups = model_and_groups
    learner = _learner(
        model_and_groups, f"{ACTOR}.entropy_coeff=0", f"{ACTOR}.kl_loss_coef=1.0", f"{ACTOR}.optim.lr=1e-3"
    )
    assert learner.reference is not None and learner.reference is not learner.model
    assert not any(p.requires_grad for p in learner.reference.parameters())
    # at the reference the KL term is 0 and adds no gradient
    m0 = learner.loss(groups)[1]
    assert m0["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7) and m0["actor/kl_coef"] == 1.0
    perturb_(learner.model, scale=0.05)
    kl_before = learner.loss(groups)[1]["actor/kl_loss"]
    assert kl_before > 1e-4
    # steps on a zero-advantage batch: only the KL term (and the zero-at-q sampler penalty) pull
    flat = [dataclasses.replace(g, advantages=np.zeros_like(g.advantages)) for g in groups]
    for _ in range(5):
        learner.train_step(flat)
    assert learner.loss(groups)[1]["actor/kl_loss"] < 0.8 * kl_before
    ref_state = {k: v for k, v in learner.reference.state_dict().items()}
    for k, v in initial.state_dict().items():
        assert torch.equal(ref_state[k], v), k  # the reference did not move
    assert "reference" not in learner.state_dict()
    # without the option there is no reference model and no KL metric
    off = _learner(model_and_groups, f"{ACTOR}.use_kl_loss=false")
    assert off.reference is None and "actor/kl_loss" not in off.loss(groups)[1]


def test_objective_refuses_a_term_it_cannot_compute():
    config = actor_config("grpo")
    lp = torch.zeros(2, 3, requires_grad=True)
    args = (config, lp, torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="entropy_coeff=0.05"):
        compute_actor_loss(*args, ref_log_prob=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="use_kl_loss=true"):
        compute_actor_loss(*args, entropy=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="not both"):
        compute_actor_loss(
            *args,
            entropy=torch.zeros(2, 3),
            ref_log_prob=torch.zeros(2, 3),
            rollout_is_weights=torch.ones(2, 3),
            rollout_correction=RolloutCorrection("token"),
        )
    with pytest.raises(TypeError, match="RolloutCorrection"):
        Learner(torch.nn.Linear(1, 1), config, 1.0, 0, rollout_correction={"rollout_is": "token"})


def test_rollout_correction_settings_parse_and_refuse():
    def algo(*overrides):
        with initialize_config_dir(config_dir=str(ROOT / "recipe" / "gepo" / "config"), version_base=None):
            return compose(config_name="gepo_trainer", overrides=["algorithm_preset=grpo", *overrides]).algorithm

    assert rollout_correction_settings(algo()) is None
    got = rollout_correction_settings(
        algo(
            "algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_is_threshold=3.5"
        )
    )
    assert got == RolloutCorrection(rollout_is="sequence", rollout_is_threshold=3.5, rollout_is_batch_normalize=False)
    # verl's typed AlgoConfig too (what main_gepo hands the drivers)
    typed = omega_conf_to_dataclass(algo("algorithm.rollout_correction.rollout_is=token"))
    assert rollout_correction_settings(typed) == RolloutCorrection("token", 2.0, False)
    # IcePop's bounds and rejection sampling: verl's values, parsed by verl
    icepop = rollout_correction_settings(
        algo(
            "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=0.5_5.0"
        )
    )
    assert icepop.icepop and icepop.bounds() == (0.5, 5.0)
    rs_only = rollout_correction_settings(
        algo(
            "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.9_1.1",
        )
    )
    assert rs_only.rollout_is is None and rs_only.rollout_rs == "seq_mean_k1"
    for bad, named in (
        ("algorithm.rollout_correction.bypass_mode=true", "bypass_mode"),
        ("algorithm.rollout_correction.rollout_is_threshold=2.0_0.5", "rollout_is_threshold='2.0_0.5'"),
        ("algorithm.rollout_correction.rollout_is_threshold=abc", "rollout_is_threshold='abc'"),
        ("algorithm.rollout_correction.rollout_rs=token_k9", "rollout_rs='token_k9'"),
        ("algorithm.rollout_correction.rollout_rs=token_k1", "rollout_rs_threshold=None"),
    ):
        with pytest.raises(ValueError, match=re.escape(named)):
            rollout_correction_settings(algo("algorithm.rollout_correction.rollout_is=token", bad))
    with pytest.raises(ValueError, match="rollout_is='tok'"):
        RolloutCorrection("tok")


def test_rollout_correction_weights_the_loss_with_verls_truncated_is(model_and_groups):
    initial, tokenizer, groups = model_and_groups
    settings = RolloutCorrection(rollout_is="token", rollout_is_threshold=1.05)
    plain = (f"{ACTOR}.entropy_coeff=0", f"{ACTOR}.use_kl_loss=false")
    tis = _learner(model_and_groups, *plain, preset="grpo", rollout_correction=settings)
    loss, metrics, grads, batch = learner_loss_and_grads(tis, groups)
    mask = batch["response_mask"].bool()
    with torch.no_grad():
        p = sequence_token_log_probs(
            tis.model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["response_ids"],
            batch["response_mask"],
            TEMPERATURE,
        )
    weights, _ = compute_rollout_correction_weights((p - batch["sampler_logprobs"]) * mask, mask.float(), "token", 1.05)
    raw = torch.exp(p - batch["sampler_logprobs"])[mask]
    assert 0 < metrics["is/tis_truncated_frac"] < 1  # some weights truncated, not all
    assert metrics["is/tis_truncated_frac"] == pytest.approx(float((raw > 1.05).double().mean()))
    assert metrics["is/tis_weight_mean"] == pytest.approx(float(weights[mask].mean()), rel=1e-6)
    assert metrics["is/weight_mean"] == pytest.approx(float(raw.double().mean()), rel=1e-5)  # sampler-vs-learner
    # the loss is verl's vanilla loss with old = sg(p) and those weights (ratio 1: -A x w per token)
    adv = batch["advantages"]
    mean_per_seq = ((-adv * weights) * mask).sum(-1) / mask.sum(-1)
    assert metrics["actor/pg_loss"] == pytest.approx(mean_per_seq.mean().item(), rel=1e-5, abs=1e-7)
    # without correction the gradient differs
    _, _, g_plain, _ = learner_loss_and_grads(_learner(model_and_groups, *plain, preset="grpo"), groups)
    assert any(not torch.allclose(grads[n], g_plain[n], atol=1e-7) for n in grads)


class _TruncatedISLearnerBefore(Learner):
    """The replay engine's TruncatedISLearner as it was before the objective owned rollout
    correction (recipe/gepo/embedded/replay.py at 9f1726a^), verbatim: the behaviour to keep."""

    def __init__(self, *args, rollout_correction: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.rollout_correction = rollout_correction

    def policy_loss(self, log_prob, batch, group_log_denominator):
        from verl_ext.algos.diagnostics import importance_weight_stats, sampler_learner_kl

        mask = batch["response_mask"].bool()
        proximal = log_prob.detach()
        is_weights, _ = compute_rollout_correction_weights(
            (proximal - batch["sampler_logprobs"]) * mask, mask.float(), **self.rollout_correction
        )
        loss, metrics = compute_actor_loss(
            self.actor_config,
            log_prob,
            proximal,
            batch["advantages"],
            mask,
            group_log_denominator=group_log_denominator,
            group_index=batch["group_index"],
            rollout_is_weights=is_weights.detach(),
        )
        raw = torch.exp((proximal - batch["sampler_logprobs"]).clamp(-20.0, 20.0))
        metrics.update(importance_weight_stats(raw, mask))
        metrics["is/kl_sampler_learner"] = sampler_learner_kl(proximal, batch["sampler_logprobs"], mask)
        metrics["is/tis_weight_mean"] = float(is_weights[mask].mean())
        threshold = self.rollout_correction["rollout_is_threshold"]
        metrics["is/tis_truncated_frac"] = float((raw[mask] > threshold).double().mean())
        return loss, metrics


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_learner_rollout_correction_equals_the_replay_truncated_is_learner(model_and_groups, level):
    """``Learner(rollout_correction=...)`` gives what replay's TruncatedISLearner gave, bit for
    bit: metrics (same keys, same order) and the weights after two steps."""
    initial, tokenizer, groups = model_and_groups
    settings = RolloutCorrection(rollout_is=level, rollout_is_threshold=1.5)
    plain = (f"{ACTOR}.entropy_coeff=0", f"{ACTOR}.use_kl_loss=false")
    ours = _learner(model_and_groups, *plain, preset="grpo", rollout_correction=settings)
    before = _TruncatedISLearnerBefore(
        copy.deepcopy(initial),
        actor_config("grpo", *plain),
        TEMPERATURE,
        tokenizer.pad_token_id,
        rollout_correction={k: v for k, v in dataclasses.asdict(settings).items() if not k.startswith("rollout_rs")},
    )
    for _ in range(2):
        m_ours, m_before = ours.train_step(groups), before.train_step(groups)
        if level == "sequence":
            # the one intended change: a sequence weight is truncated as a whole, so the share
            # counts the tokens of sequences whose weight exceeds C (it counted tokens before)
            # (0 here: no sequence weight reaches 1.5; the gspo-tis case above has some that do)
            m_before["is/tis_truncated_frac"] = m_ours["is/tis_truncated_frac"]
        assert list(m_ours.items()) == list(m_before.items())
    for (n, a), (_, b) in zip(ours.model.state_dict().items(), before.model.state_dict().items()):
        assert torch.equal(a, b), n
