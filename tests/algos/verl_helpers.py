"""Small helpers to call registered losses the way verl does (real verl config classes, no mocks)."""

from __future__ import annotations

import torch
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config.actor import ActorConfig

from verl_ext.algos.config import HeteroPolicyLossConfig

CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # asymmetric, so a swapped clip range shows


def composed_actor_section(*overrides: str) -> DictConfig:
    """``actor_rollout_ref.actor`` of verl's packaged ``ppo_trainer`` config, composed by hydra
    with ``overrides`` (interpolations resolved, so it stands alone)."""
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=list(overrides))
    return OmegaConf.create(OmegaConf.to_container(cfg.actor_rollout_ref.actor, resolve=True))


def actor_from_section(section: DictConfig, **overrides) -> ActorConfig:
    """verl's ActorConfig from a composed actor section, with dotted ``key=value`` overrides."""
    node = OmegaConf.create(OmegaConf.to_container(section, resolve=True))
    for key, value in overrides.items():
        OmegaConf.update(node, key, value, force_add=True)
    config = omega_conf_to_dataclass(node)
    assert isinstance(config, ActorConfig)
    return config


def actor_config(
    loss_mode: str, loss_agg_mode: str = "token-mean", loss_scale_factor=None, rollout_n: int = 1, **policy_loss
) -> ActorConfig:
    """verl's ActorConfig with HeteroPolicyLossConfig, built like verl's own CPU loss tests do."""
    return ActorConfig(
        strategy="fsdp",
        rollout_n=rollout_n,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=0.2,
        clip_ratio_low=CLIP_LOW,
        clip_ratio_high=CLIP_HIGH,
        loss_agg_mode=loss_agg_mode,
        loss_scale_factor=loss_scale_factor,
        policy_loss=HeteroPolicyLossConfig(loss_mode=loss_mode, **policy_loss),
    )


def call_loss(loss_mode: str, batch, config: ActorConfig, log_p: torch.Tensor | None = None, **extra):
    """The registered loss called with verl's keyword signature (as ppo_loss does)."""
    fn = get_policy_loss_fn(loss_mode)
    return fn(
        old_log_prob=batch.log_q,
        log_prob=batch.log_p if log_p is None else log_p,
        advantages=batch.advantages,
        response_mask=batch.mask,
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=None,
        **extra,
    )
