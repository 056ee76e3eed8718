"""No function that receives tensors makes one on the default device -- checked on CPU.

On a GPU the default device stays the CPU: a tensor that a function builds without ``device=``
(``torch.arange(n)``, ``torch.zeros(k)``) lands there and meets the caller's CUDA tensors, and
torch raises "Expected all tensors to be on the same device". Here the inputs are CPU tensors and
the default device is ``meta`` (:func:`default_device_elsewhere`): a tensor built without
``device=`` lands on meta, and mixing it with the CPU inputs raises just where CUDA would (a
meta tensor also refuses ``.item()``, and a result left on meta fails :func:`assert_on_cpu`).

Each case builds its inputs, configs and models outside the context (on the CPU, explicitly) and
returns the call to check; the call runs inside it, backward passes included. Covered: every
policy loss the project registers, through verl's ``ppo_loss`` and through the loss bridge; every
algorithm preset through the loss bridge with every term on; the advantage estimator the project
registers and the embedded engine's advantages; the weight and divergence diagnostics; sampling
on the toy model; the learner's re-scoring of a group (verification) and its log-probs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict
from transformers import LlamaForCausalLM
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_adv_estimator_fn
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.utils.losses import ppo_loss

from recipe.gepo.embedded import learner as embedded_learner
from verl_ext.trust import verifier as verify
from recipe.gepo.embedded.policy import sample_groups
from verl_ext.algos.advantages import sequence_advantages
from verl_ext.sampling import sequence_token_log_probs
from verl_ext import sampling
from verl_ext.algos import advantages as adv_lib
from verl_ext.algos import diagnostics, losses
from verl_ext.algos import importance as iw
from verl_ext.analysis import run_diagnostics
from verl_ext.data.toy.model import build_tokenizer, toy_model_config
from verl_ext.hetero.records import RolloutGroup
from verl_ext.algos.objective import (
    builtin_weight_stats,
    compute_actor_loss,
    gradient_mechanism_metrics,
    rollout_correction_settings,
)
from verl_ext.algos.registry import HETERORL_LOSS_MODES, sampler_kl_penalty

from .test_ppo_loss import GROUP as PPO_GROUP
from .test_ppo_loss import make_data
from .verl_helpers import actor_config, actor_from_section, composed_actor_section

CONFIG_DIR = Path(__file__).resolve().parents[2] / "recipe" / "gepo" / "config"
PRESETS = sorted(p.stem for p in (CONFIG_DIR / "algorithm_preset").glob("*.yaml"))
VERL_BUILTINS = ("vanilla", "gspo", "geo_mean", "cispo")  # what the presets use of verl's own losses

G, N_GROUPS, T = 3, 3, 6
B = G * N_GROUPS


# ------------------------------------------------------------------------------------- the check


@contextlib.contextmanager
def default_device_elsewhere(device: str = "meta"):
    """``torch.set_default_device(device)`` for the block, restored after it."""
    previous = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(previous)


def assert_on_cpu(result: Any, where: str = "result") -> None:
    """Every tensor in ``result`` (nested in tuples, lists, dicts, dataclasses) is on the CPU."""
    if isinstance(result, torch.Tensor):
        assert result.device.type == "cpu", f"{where} is on {result.device}, made on the default device"
    elif isinstance(result, dict):
        for key, value in result.items():
            assert_on_cpu(value, f"{where}[{key!r}]")
    elif isinstance(result, (list, tuple)):
        for i, value in enumerate(result):
            assert_on_cpu(value, f"{where}[{i}]")
    elif dataclasses.is_dataclass(result) and not isinstance(result, type):
        for f in dataclasses.fields(result):
            assert_on_cpu(getattr(result, f.name), f"{where}.{f.name}")


def run_elsewhere(call: Callable[[], Any]) -> Any:
    with default_device_elsewhere():
        result = call()
    assert_on_cpu(result)
    return result


def _made_without_device(x: torch.Tensor) -> torch.Tensor:
    return x * torch.arange(x.shape[-1])


def _made_with_device(x: torch.Tensor) -> torch.Tensor:
    return x * torch.arange(x.shape[-1], device=x.device)


def test_the_check_catches_a_tensor_made_without_device():
    x = torch.ones(2, 3)
    with pytest.raises((RuntimeError, NotImplementedError)):
        run_elsewhere(lambda: _made_without_device(x))
    torch.testing.assert_close(run_elsewhere(lambda: _made_with_device(x)), torch.tensor([[0.0, 1, 2]] * 2))
    # a tensor made on the default device and handed back unmixed is caught too
    with pytest.raises(AssertionError, match="meta"):
        run_elsewhere(lambda: {"count": torch.zeros(x.shape[0])})
    assert torch.get_default_device().type == "cpu"  # restored


def test_the_check_catches_what_cuda_caught_in_m2po_before_the_fix():
    """The CUDA crash of a GPU run, reproduced on CPU: m2po's suffix means were divided by an
    ``arange`` made on the default device."""
    log_ratio = torch.tensor([[0.5, -0.1, 0.3, 0.0]])

    def old_suffix_mean(values: torch.Tensor) -> torch.Tensor:
        n = values.numel()
        suffix_sum = torch.flip(torch.cumsum(torch.flip(values, [0]), 0), [0])
        return suffix_sum / torch.arange(n, 0, -1, dtype=torch.float64)

    with pytest.raises(RuntimeError):
        run_elsewhere(lambda: old_suffix_mean(log_ratio.double().square().reshape(-1)))
    keep = run_elsewhere(lambda: losses.m2po_keep_mask(log_ratio, torch.ones_like(log_ratio), 0.04))
    assert keep.tolist() == [[False, True, True, True]]  # 0.25 dropped: mean(0.01, 0.09, 0) < 0.04


# ------------------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class Inputs:
    log_p: torch.Tensor  # [B, T] float32
    log_q: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] bool
    group_index: torch.Tensor  # [B] int64, whole groups of G in a row
    rewards: torch.Tensor  # [B] in {0, 1}

    def leaf(self) -> torch.Tensor:
        return self.log_p.clone().requires_grad_(True)


def make_inputs() -> Inputs:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([6, 4, 1, 5, 6, 3, 2, 6, 4])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    log_q = -(0.05 + 2.0 * torch.rand(B, T, generator=gen)) * mask
    log_p = (log_q + 0.3 * torch.randn(B, T, generator=gen)) * mask
    rewards = torch.tensor([1.0, 0, 1, 0, 0, 1, 1, 1, 0])
    group_index = torch.arange(B) // G
    means = rewards.view(N_GROUPS, G).mean(-1).repeat_interleave(G)
    advantages = (rewards - means)[:, None] * mask
    return Inputs(log_p, log_q, advantages, mask, group_index, rewards)


def _backward(loss: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    loss.backward()
    assert leaf.grad is not None and torch.isfinite(leaf.grad).all()
    return leaf.grad


# ------------------------------------------------------------------------------------- cases
# each case: inputs -> the call to check (configs, models and leaves made beforehand, on the CPU)

CASES: dict[str, Callable[[Inputs], Callable[[], Any]]] = {}


def case(name: str):
    def register(fn):
        assert name not in CASES, name
        CASES[name] = fn
        return fn

    return register


# -- every registered project loss, called by verl's own ppo_loss (groups: contiguous group_size runs)

_PPO_SECTION: list = []


def _ppo_config(loss_mode: str):
    if not _PPO_SECTION:
        _PPO_SECTION.append(
            composed_actor_section(
                "actor_rollout_ref.actor.policy_loss._target_=verl_ext.algos.config.HeteroPolicyLossConfig",
                f"+actor_rollout_ref.actor.policy_loss.group_size={PPO_GROUP}",
                "+actor_rollout_ref.actor.policy_loss.sampler_kl_coef=0.01",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            )
        )
    return actor_from_section(_PPO_SECTION[0], **{"policy_loss.loss_mode": loss_mode})


def _ppo_loss_case(loss_mode: str):
    def build(_: Inputs):
        config = _ppo_config(loss_mode)
        data, model_output, leaf, _, _ = make_data(seed=3, dtype=torch.float32)

        def call():
            loss, metrics = ppo_loss(config, model_output, data)
            return loss.detach(), _backward(loss, leaf)

        return call

    return build


for _mode in HETERORL_LOSS_MODES:
    case(f"ppo_loss-{_mode}")(_ppo_loss_case(_mode))


# -- every registered loss (the project's and verl's the presets use) through the loss bridge, with group labels


def _bridge_case(loss_mode: str):
    def build(x: Inputs):
        config = actor_config(
            loss_mode, loss_agg_mode="seq-mean-token-mean", rollout_n=G, group_size=G, sampler_kl_coef=0.01
        )
        leaf = x.leaf()

        def call():
            loss, metrics = compute_actor_loss(config, leaf, x.log_q, x.advantages, x.mask, group_index=x.group_index)
            return loss.detach(), _backward(loss, leaf), metrics

        return call

    return build


for _mode in sorted(set(HETERORL_LOSS_MODES) | set(VERL_BUILTINS)):
    case(f"bridge-{_mode}")(_bridge_case(_mode))


# -- every algorithm preset through the loss bridge, every term on: group denominators computed as the
#    learner computes them, entropy bonus, KL to a reference, the preset's rollout correction

_PRESET_CACHE: dict = {}


def _preset_node(preset: str):
    """A preset file as hydra merges it (``@package _global_``; its defaults, then itself)."""
    raw = OmegaConf.load(CONFIG_DIR / "algorithm_preset" / f"{preset}.yaml")
    parents = raw.pop("defaults", [])
    return OmegaConf.merge(*[_preset_node(parent) for parent in parents], raw)


def _preset(preset: str):
    """(verl ActorConfig, algorithm section) of ``algorithm_preset=<preset>`` with every term of the
    objective on. gepo_trainer.yaml merges its preset last: the trainer without one is composed by
    hydra once, and each preset merged onto it (hydra's composition of every preset is
    tests/recipe/test_presets.py's)."""
    if "" not in _PRESET_CACHE:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            _PRESET_CACHE[""] = compose(config_name="gepo_trainer", overrides=["~algorithm_preset"])
    if preset not in _PRESET_CACHE:
        cfg = _PRESET_CACHE[""].copy()
        with open_dict(cfg):
            cfg = OmegaConf.merge(cfg, _preset_node(preset))
            actor_section = cfg.actor_rollout_ref.actor
            OmegaConf.update(actor_section, "entropy_coeff", 0.001, force_add=True)
            OmegaConf.update(actor_section, "use_kl_loss", True, force_add=True)
            OmegaConf.update(actor_section, "kl_loss_coef", 0.01, force_add=True)
            OmegaConf.update(actor_section, "policy_loss.group_size", G, force_add=True)
        assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode in POLICY_LOSS_REGISTRY
        _PRESET_CACHE[preset] = (omega_conf_to_dataclass(cfg.actor_rollout_ref.actor), cfg.algorithm)
    return _PRESET_CACHE[preset]


def _preset_case(preset: str):
    def build(x: Inputs):
        actor, algorithm = _preset(preset)
        correction = rollout_correction_settings(algorithm)  # runs verl's parser once: outside the check
        leaf = x.leaf()
        gen = torch.Generator().manual_seed(1)
        entropy = (torch.rand(B, T, generator=gen) + 0.5).requires_grad_(True)
        ref_log_prob = x.log_q + 0.1 * torch.randn(B, T, generator=gen)

        def call():
            reduction = actor.policy_loss.seq_reduction
            seq_log_q = iw.sequence_log_prob(x.log_q, x.mask, reduction)
            log_den = iw.group_expectation_log_denominator(seq_log_q, x.group_index)
            loss, metrics = compute_actor_loss(
                actor,
                leaf,
                x.log_q,
                x.advantages,
                x.mask,
                group_log_denominator=log_den,
                group_index=x.group_index,
                entropy=entropy,
                ref_log_prob=ref_log_prob,
                rollout_correction=correction,
            )
            return loss.detach(), _backward(loss, leaf), metrics

        return call

    return build


for _preset_name in PRESETS:
    case(f"preset-{_preset_name}")(_preset_case(_preset_name))


# -- the pure loss terms and their helpers, called directly


@case("terms-m2po_keep_mask")
def _(x):
    return lambda: losses.m2po_keep_mask(x.log_p - x.log_q, x.mask, 0.04)


@case("terms-delta_l_aggregate")
def _(x):
    leaf = x.leaf()

    def call():
        terms = losses.token_clipped_loss_terms(leaf, x.log_q, x.advantages, x.mask, clip_low=0.2, clip_high=0.28)
        loss = losses.delta_l_aggregate(terms.loss_mat, x.mask, 0.75, global_batch_size=2 * B, dp_size=2)
        return loss.detach(), _backward(loss, leaf)

    return call


@case("terms-gepo_tc_ess")
def _(x):
    leaf = x.leaf()

    def call():
        terms = losses.gepo_token_clip_loss_terms(
            leaf, x.log_q, x.advantages, x.mask, clip_low=0.2, clip_high=0.2, group_index=x.group_index, ess_bound=True
        )
        return terms, _backward((terms.loss_mat * x.mask).sum(), leaf)

    return call


@case("importance-group_expectation_log_denominator")
def _(x):
    labels = x.group_index * 7 + 100  # arbitrary labels: dense_group_index maps them
    return lambda: iw.group_expectation_log_denominator(iw.sequence_log_prob(x.log_q, x.mask), labels)


@case("importance-contiguous_group_index")
def _(x):
    return lambda: x.group_index == iw.contiguous_group_index(B, G, device=x.group_index.device)


# -- advantages: the estimator the project registers, and the embedded engine's per-sequence advantages


@case("advantages-bnpo_registered")
def _(x):
    uids = np.array([f"p{i // G}" for i in range(B)], dtype=object)
    token_rewards = torch.zeros(B, T)
    token_rewards[torch.arange(B), x.mask.sum(-1) - 1] = x.rewards
    return lambda: get_adv_estimator_fn("bnpo")(token_rewards, x.mask.float(), index=uids)


@case("advantages-bnpo_advantages")
def _(x):
    return lambda: adv_lib.bnpo_advantages(x.rewards, x.group_index * 5 + 1)


for _estimator in ("grpo", "bnpo"):

    @case(f"advantages-sequence_advantages_{_estimator}")
    def _(x, estimator=_estimator):
        uids = [f"u{i // G}" for i in range(B)]
        config = {"adv_estimator": estimator, "norm_adv_by_std_in_grpo": True}
        return lambda: sequence_advantages(x.rewards, x.mask.long(), uids, config)


# -- diagnostics


@case("diagnostics-importance_weight_stats")
def _(x):
    return lambda: (
        diagnostics.importance_weight_stats(torch.exp(x.log_p - x.log_q), x.mask),
        diagnostics.importance_weight_stats(torch.exp(x.log_p.sum(-1)), x.mask),
    )


@case("diagnostics-sampler_learner_kl")
def _(x):
    return lambda: (
        diagnostics.sampler_learner_kl(x.log_p, x.log_q, x.mask),
        diagnostics.sequence_sampler_learner_kl(x.log_p, x.log_q, x.mask),
    )


@case("diagnostics-normalised_ess")
def _(x):
    return lambda: iw.normalised_ess(torch.exp(x.log_p - x.log_q)[x.mask])


@case("diagnostics-group_divergence")
def _(x):
    return lambda: embedded_learner.group_divergence(x.log_p, x.log_q, x.mask, N_GROUPS, x.group_index)


@case("diagnostics-advantage_estimation_errors")
def _(x):
    fresh = torch.tensor([[1.0, 0, 1, 1], [0, 0, 1, 0], [1, 1, 1, 0]])

    def call():
        seq_p, seq_q = iw.sequence_log_prob(x.log_p, x.mask), iw.sequence_log_prob(x.log_q, x.mask)
        full_p, full_q = iw.sequence_log_prob(x.log_p, x.mask, "sum"), iw.sequence_log_prob(x.log_q, x.mask, "sum")
        estimates = run_diagnostics.weighted_advantage_estimates(seq_p, seq_q, full_p, full_q, x.rewards, x.group_index)
        return estimates, run_diagnostics.estimation_errors(estimates, fresh, "group_expectation")

    return call


@case("diagnostics-gradient_mechanism_metrics")
def _(x):
    leaf = x.leaf()

    def call():
        pg_loss = (-x.advantages * torch.exp(leaf - x.log_q) * x.mask).sum() / x.mask.sum()
        return gradient_mechanism_metrics(pg_loss, leaf, x.advantages, x.mask, "token-mean")

    return call


@case("diagnostics-builtin_weight_stats_and_penalty")
def _(x):
    return lambda: (
        builtin_weight_stats("gspo", x.log_p, x.log_q, x.mask),
        builtin_weight_stats("vanilla", x.log_p, x.log_q, x.mask),
        sampler_kl_penalty(x.log_p, x.log_q, x.mask, {"dp_size": 1, "global_batch_size": B}),
    )


# -- sampling, the learner's re-scoring of a group and its log-probs on the toy model


@pytest.fixture(scope="module")
def toy():
    """A random toy Llama and its tokenizer."""
    tok = build_tokenizer()
    tok.padding_side = "left"
    torch.manual_seed(0)
    return LlamaForCausalLM(toy_model_config(tok)).eval(), tok


MODEL_CASES: dict[str, Callable[[Any], Callable[[], Any]]] = {}


def model_case(name: str):
    def register(fn):
        MODEL_CASES[name] = fn
        return fn

    return register


PROMPTS = ["1+2=", "7+5=", "33+4="]


@model_case("sampling-generate")
def _(toy):
    model, tok = toy
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    return lambda: sampling.generate(
        model,
        enc["input_ids"],
        enc["attention_mask"],
        max_new_tokens=4,
        eos_token_ids=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        seed=3,
    )


@model_case("sampling-token_log_probs_and_eos_mask")
def _(toy):
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 11, generator=gen)
    tokens = torch.randint(0, 11, (2, 5), generator=gen)
    return lambda: (sampling.token_log_probs(logits, tokens, 0.7), sampling.eos_mask(tokens, [3, 4]))


@model_case("sampling-sample_continuations")
def _(toy):
    model, tok = toy
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    return lambda: sampling.sample_continuations(
        model, prompts, 4, [tok.eos_token_id], tok.pad_token_id, generator_seed=3
    )


def _group(model, tok, version: int = 0) -> RolloutGroup:
    batch = sample_groups(model, tok, ["3+4="], G, 1.0, 4, seed=5)
    keep = batch.prompt_mask[0].bool()
    return RolloutGroup(
        group_uid="g0",
        prompt_ids=batch.prompt_ids[0][keep].numpy(),
        response_ids=batch.response_ids.numpy(),
        response_mask=batch.response_mask.numpy().astype(np.int8),
        sampler_logprobs=batch.sampler_logprobs.numpy().astype(np.float32),
        rewards=np.zeros(G, np.float32),
        advantages=np.zeros(G, np.float32),
        policy_version=version,
        sampler_id="s0",
    )


@model_case("verify-group_log_probs")
def _(toy):
    model, tok = toy
    group = _group(model, tok)
    return lambda: verify.group_log_probs(model, group, 1.0)


@model_case("learner-log_probs_and_entropy")
def _(toy):
    model, tok = toy
    batch = embedded_learner.collate_groups([_group(model, tok)], tok.pad_token_id)

    def call():
        log_prob, entropy = embedded_learner.log_probs_and_entropy(model, batch, 1.0, with_entropy=True)
        ref = sequence_token_log_probs(
            model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"], 1.0
        )
        return log_prob.detach(), entropy.detach(), ref.detach()

    return call


# ------------------------------------------------------------------------------------- the tests


def test_every_project_loss_and_preset_is_covered():
    project = {name for name in POLICY_LOSS_REGISTRY if name in HETERORL_LOSS_MODES}
    assert project == set(HETERORL_LOSS_MODES)
    assert {f"ppo_loss-{m}" for m in project} <= set(CASES)
    assert {f"bridge-{m}" for m in project} <= set(CASES)
    assert PRESETS and {f"preset-{p}" for p in PRESETS} <= set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_no_tensor_is_made_on_the_default_device(name):
    call = CASES[name](make_inputs())
    run_elsewhere(call)


@pytest.mark.parametrize("name", sorted(MODEL_CASES))
def test_no_tensor_is_made_on_the_default_device_with_a_model(name, toy):
    call = MODEL_CASES[name](toy)
    run_elsewhere(call)
