"""Every algorithm preset composes on verl's ppo_trainer defaults, validates against verl's config
dataclasses, and drives its loss through the loss bridge."""

import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from verl.trainer.ppo import core_algos
from verl.utils.config import omega_conf_to_dataclass

from verl_ext.algos.objective import compute_actor_loss
from verl_ext.algos.config import HeteroPolicyLossConfig
from tests.subsets import default_run_keeps

CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipe" / "gepo" / "config"
PRESETS = sorted(p.stem for p in (CONFIG_DIR / "algorithm_preset").glob("*.yaml"))
# what each preset must select (loss mode, adv estimator, std normalisation, loss aggregation)
EXPECTED = {
    "gepo": ("gepo", "grpo", False, "seq-mean-token-mean"),
    "grpo": ("vanilla", "grpo", True, "seq-mean-token-mean"),
    "dr_grpo": ("vanilla", "grpo", False, "seq-mean-token-sum-norm"),
    "bnpo": ("vanilla", "bnpo", True, "token-mean"),
    "gspo": ("gspo", "grpo", True, "seq-mean-token-mean"),
    "gmpo": ("geo_mean", "grpo", True, "seq-mean-token-mean"),
    "delta_l": ("delta_l", "grpo", True, "token-mean"),
    "topr": ("topr", "grpo", False, "seq-mean-token-sum-norm"),
    "cispo": ("cispo", "grpo", True, "token-mean"),
    "grpo_paper": ("vanilla", "grpo", True, "seq-mean-token-mean"),
    "gspo_wide": ("gspo", "grpo", True, "seq-mean-token-mean"),
    "gepo_tr": ("gepo_tr", "grpo", False, "seq-mean-token-mean"),
    "gepo_tc": ("gepo_tc", "grpo", False, "seq-mean-token-mean"),
    "gepo_tc_ess": ("gepo_tc", "grpo", False, "seq-mean-token-mean"),
    "m2po": ("m2po", "grpo", True, "token-mean"),
    "vespo": ("vespo", "grpo", True, "token-mean"),
    "decoupled_ppo": ("vanilla", "grpo", True, "token-mean"),
    "grpo_tis": ("vanilla", "grpo", True, "seq-mean-token-mean"),
    "grpo_seq_tis": ("vanilla", "grpo", True, "seq-mean-token-mean"),
    "grpo_icepop": ("vanilla", "grpo", True, "seq-mean-token-mean"),
    "grpo_seq_mis": ("vanilla", "grpo", True, "seq-mean-token-mean"),
}
# the rollout-correction presets: grpo_paper plus exactly one of verl's RolloutCorrectionConfig factories
ROLLOUT_CORRECTION = {
    "grpo_tis": lambda R: R.decoupled_token_is(2.0),
    "grpo_seq_tis": lambda R: R.decoupled_seq_is(2.0),
    "grpo_icepop": lambda R: R.decoupled_token_icepop(5.0, 0.5),
    "grpo_seq_mis": lambda R: R.decoupled_seq_is_rs(2.0, "0.5_2.0"),
}


def compose_trainer(*overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="gepo_trainer", overrides=list(overrides))


def test_every_issue_preset_exists():
    assert set(EXPECTED) <= set(PRESETS), f"missing presets: {set(EXPECTED) - set(PRESETS)}"


def test_default_preset_is_gepo():
    cfg = compose_trainer()
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "gepo"


# by default one preset per estimator and loss aggregation (the table above is checked for every preset by `make test-all`)
@pytest.mark.parametrize("preset", default_run_keeps(PRESETS, ("gepo", "dr_grpo", "bnpo", "gspo", "cispo")))
def test_preset_composes_validates_and_runs(preset):
    cfg = compose_trainer(f"algorithm_preset={preset}")
    loss_mode, estimator, norm_std, agg = EXPECTED[preset]
    actor_cfg = cfg.actor_rollout_ref.actor
    assert actor_cfg.policy_loss.loss_mode == loss_mode
    assert cfg.algorithm.adv_estimator == estimator
    if estimator == "grpo":
        assert cfg.algorithm.norm_adv_by_std_in_grpo is norm_std
    assert actor_cfg.loss_agg_mode == agg
    # the paper's runs add 0.005 x KL(sampler || learner) to every loss
    assert actor_cfg.policy_loss.sampler_kl_coef == pytest.approx(0.005)

    actor = omega_conf_to_dataclass(actor_cfg)
    algo = omega_conf_to_dataclass(cfg.algorithm)
    assert isinstance(actor.policy_loss, HeteroPolicyLossConfig)
    assert actor.policy_loss.group_size == cfg.actor_rollout_ref.rollout.n
    assert loss_mode in core_algos.POLICY_LOSS_REGISTRY
    assert algo.adv_estimator in core_algos.ADV_ESTIMATOR_REGISTRY

    g, groups, t = actor.policy_loss.group_size, 3, 12
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(g * groups, t, generator=gen, dtype=torch.float64) * 2
    new = (old + 0.05 * torch.randn(g * groups, t, generator=gen, dtype=torch.float64)).requires_grad_(True)
    mask = torch.ones(g * groups, t, dtype=torch.bool)
    mask[:, 9:] = False
    adv = torch.randn(g * groups, 1, generator=gen, dtype=torch.float64).expand(-1, t).contiguous()
    loss, metrics = compute_actor_loss(actor, new, old, adv, mask)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(new.grad).all() and new.grad.abs().sum() > 0
    for key in ("actor/pg_loss", "actor/loss", "actor/sampler_kl_penalty", "is/weight_var", "is/kl_sampler_learner"):
        assert key in metrics, key
    # the penalty term is what separates actor/loss from the policy-gradient loss
    assert metrics["actor/loss"] == pytest.approx(
        metrics["actor/pg_loss"] + 0.005 * metrics["actor/sampler_kl_penalty"]
    )


def test_one_override_switches_algorithm_and_user_overrides_win():
    cfg = compose_trainer("algorithm_preset=gspo", "actor_rollout_ref.actor.clip_ratio_high=0.2")
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "gspo"
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.2
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == pytest.approx(3e-4)


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(Exception, match="algorithm_preset"):
        compose_trainer("algorithm_preset=not_an_algorithm")


def test_bad_loss_option_names_the_field():
    cfg = compose_trainer("actor_rollout_ref.actor.policy_loss.seq_reduction=everything")
    with pytest.raises(Exception, match="seq_reduction"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def test_paper_baselines_differ_from_their_presets_only_in_the_clip():
    """grpo_paper = grpo without verl's dual clip; gspo_wide = gspo at clip 0.2 (the GEPO paper's)."""
    from omegaconf import OmegaConf

    def actor(preset):
        return OmegaConf.to_container(
            compose_trainer(f"algorithm_preset={preset}").actor_rollout_ref.actor, resolve=True
        )

    grpo, paper = actor("grpo"), actor("grpo_paper")
    assert grpo["clip_ratio_c"] == 3.0 and paper["clip_ratio_c"] == 1e9
    assert {k: v for k, v in paper.items() if k != "clip_ratio_c"} == {
        k: v for k, v in grpo.items() if k != "clip_ratio_c"
    }
    gspo, wide = actor("gspo"), actor("gspo_wide")
    assert (wide["clip_ratio_low"], wide["clip_ratio_high"]) == (0.2, 0.2)
    drop = ("clip_ratio", "clip_ratio_low", "clip_ratio_high")
    assert {k: v for k, v in wide.items() if k not in drop} == {k: v for k, v in gspo.items() if k not in drop}


def test_grpo_paper_loss_is_the_plain_clipped_surrogate_and_grpo_dual_clips():
    """On a batch with a very stale negative-advantage token (ratio e^3 > clip_ratio_c = 3),
    grpo_paper's loss is mean over sequences of token-means of max(-A r, -A clip(r, 0.8, 1.2)) --
    no cap -- while verl's default (grpo) caps that token's loss at 3 |A|."""
    losses = {}
    for preset in ("grpo", "grpo_paper"):
        cfg = compose_trainer(f"algorithm_preset={preset}", "actor_rollout_ref.actor.policy_loss.sampler_kl_coef=0.0")
        actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        old = torch.zeros(8, 3, dtype=torch.float64)
        new = torch.zeros(8, 3, dtype=torch.float64)
        new[0, 0] = 3.0  # ratio e^3 ~ 20.1
        adv = torch.full((8, 3), 0.5, dtype=torch.float64)
        adv[0] = -1.0
        mask = torch.ones(8, 3, dtype=torch.bool)
        losses[preset], _ = compute_actor_loss(actor, new, old, adv, mask)
    ratio = torch.ones(8, 3, dtype=torch.float64)
    ratio[0, 0] = math.exp(3.0)
    adv = torch.full((8, 3), 0.5, dtype=torch.float64)
    adv[0] = -1.0
    plain = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean(-1).mean()
    assert float(losses["grpo_paper"]) == pytest.approx(float(plain))
    capped = plain - (math.exp(3.0) - 3.0) / 3 / 8  # token (0, 0): loss e^3 -> 3, a third of row 0, 1/8 of the batch
    assert float(losses["grpo"]) == pytest.approx(float(capped))


def _resolved(cfg_node):
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg_node, resolve=True)


@pytest.mark.parametrize("preset", sorted(ROLLOUT_CORRECTION))
def test_rollout_correction_presets_are_verls_factory_presets_on_grpo_paper(preset):
    """Every field of verl's factory preset, set exactly (so verl's helper computes the IS / RS the
    preset's name promises), and otherwise grpo_paper unchanged."""
    import dataclasses

    from verl.trainer.config import RolloutCorrectionConfig

    cfg = compose_trainer(f"algorithm_preset={preset}")
    composed = _resolved(cfg.algorithm.rollout_correction)
    want = ROLLOUT_CORRECTION[preset](RolloutCorrectionConfig)
    fields = [f.name for f in dataclasses.fields(RolloutCorrectionConfig) if f.name != "_target_"]
    assert set(composed) <= set(fields), set(composed) - set(fields)
    built = RolloutCorrectionConfig(**composed)  # verl's own validation of the values
    assert {f: getattr(built, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert built.rollout_is is not None and built.bypass_mode is False  # decoupled mode, correction on

    paper = compose_trainer("algorithm_preset=grpo_paper")
    assert _resolved(cfg.actor_rollout_ref) == _resolved(paper.actor_rollout_ref)
    algo, paper_algo = _resolved(cfg.algorithm), _resolved(paper.algorithm)
    assert _resolved(paper.algorithm.rollout_correction)["rollout_is"] is None  # grpo_paper itself has none
    algo.pop("rollout_correction"), paper_algo.pop("rollout_correction")
    assert algo == paper_algo


def test_decoupled_ppo_preset_is_an_areal_style_filtered_behaviour_weight():
    """Token IS with weights above 5 zeroed (verl's IcePop with a lower bound that never binds), the
    PPO clip 0.2 and no dual clip."""
    from verl.trainer.config import RolloutCorrectionConfig

    cfg = compose_trainer("algorithm_preset=decoupled_ppo")
    built = RolloutCorrectionConfig(**_resolved(cfg.algorithm.rollout_correction))
    want = RolloutCorrectionConfig.decoupled_token_icepop(5.0, 1e-12)
    for f in (
        "rollout_is",
        "rollout_is_threshold",
        "rollout_rs",
        "rollout_rs_threshold",
        "bypass_mode",
        "rollout_is_batch_normalize",
    ):
        assert getattr(built, f) == getattr(want, f), f
    actor = cfg.actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.2, 0.2) and actor.clip_ratio_c >= 1e9


def test_new_loss_presets_carry_the_methods_parameters():
    """m2po: threshold 0.04; vespo: (k, lam) = (2, 3) for A >= 0, (3, 2) for A < 0; gepo_tc_ess is
    gepo_tc with the ESS band on (and gepo_tc has it off), token clip 0.2."""

    def policy_loss(preset):
        return omega_conf_to_dataclass(
            compose_trainer(f"algorithm_preset={preset}").actor_rollout_ref.actor
        ).policy_loss

    assert policy_loss("m2po").m2po_threshold == pytest.approx(0.04)
    v = policy_loss("vespo")
    assert (v.vespo_k_pos, v.vespo_lambda_pos, v.vespo_k_neg, v.vespo_lambda_neg) == (2.0, 3.0, 3.0, 2.0)
    assert policy_loss("gepo_tc").tc_ess_bound is False and policy_loss("gepo_tc_ess").tc_ess_bound is True
    tc, ess = (_resolved(compose_trainer(f"algorithm_preset={p}")) for p in ("gepo_tc", "gepo_tc_ess"))
    assert ess["actor_rollout_ref"]["actor"]["policy_loss"].pop("tc_ess_bound") is True
    tc["actor_rollout_ref"]["actor"]["policy_loss"].pop("tc_ess_bound", None)
    assert tc == ess
    actor = tc["actor_rollout_ref"]["actor"]
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"]) == (0.2, 0.2)
