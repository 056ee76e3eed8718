"""HeteroRL's policy-loss options: verl's ``PolicyLossConfig`` plus the fields of the project's losses.

Importing this module registers nothing and patches nothing; the losses themselves are registered
by :mod:`verl_ext.verl_losses`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl.workers.config import PolicyLossConfig


@dataclass
class HeteroPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus the hyper-parameters of HeteroRL's losses.

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=verl_ext.loss_config.HeteroPolicyLossConfig``
    (the recipe's presets do). verl's own losses ignore the extra fields, except
    ``sampler_kl_coef``, which the project's loss bridge applies to every loss.
    """

    group_size: int = 0
    """Responses per prompt (G, = ``rollout.n``). Used to form prompt groups when no per-sequence
    denominator or group index reaches the loss. 0 = unknown (GEPO then needs one of those)."""

    seq_reduction: str = "mean"
    """Sequence log-probability used in sequence-level weights (GEPO, EqP, GEPO-adaptive).
    "mean": length-normalised geometric mean, as the paper's code; "sum": full sequence."""

    adaptive_kl_threshold: float = 0.002
    """gepo_adaptive: a sequence whose token-mean KL(sampler || learner) is below this uses p_i/q_i."""

    delta_l_alpha: float = 1.0
    """delta_l: exponent of the length weights L_i^-alpha (1 = minimum variance; paper uses 0.75 for math)."""

    topr_reduction: str = "sum"
    """topr: trajectory ratio for truncating negative examples. "sum": full sequence (the paper); "mean"."""

    sampler_kl_coef: float = 0.0
    """Weight of the KL(sampler || learner) penalty (per-token k3, (p/q - 1) - log(p/q)) added to
    the loss (the paper's runs: 0.005). 0 = off."""

    def __post_init__(self):
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        for name in ("seq_reduction", "topr_reduction"):
            if getattr(self, name) not in ("mean", "sum"):
                raise ValueError(f"policy_loss.{name}={getattr(self, name)!r}; expected one of ('mean', 'sum')")
        if self.group_size < 0:
            raise ValueError(f"policy_loss.group_size must be >= 0, got {self.group_size}")
        for name in ("sampler_kl_coef", "delta_l_alpha", "adaptive_kl_threshold"):
            if getattr(self, name) < 0:
                raise ValueError(f"policy_loss.{name} must be >= 0, got {getattr(self, name)}")


_DEFAULTS = HeteroPolicyLossConfig()


def loss_option(config: Any, name: str) -> Any:
    """A HeteroPolicyLossConfig field from an actor config, or its default when the user kept
    verl's plain PolicyLossConfig (so verl's own configs work unchanged)."""
    policy_loss = None if config is None else config.get("policy_loss", None)
    value = None if policy_loss is None else policy_loss.get(name, None)
    return getattr(_DEFAULTS, name) if value is None else value


def clip_range(config: Any) -> tuple[float, float]:
    """(low, high) clip range from verl's actor config (clip_ratio_low/high default to clip_ratio)."""
    clip = config.get("clip_ratio", 0.2)
    low = config.get("clip_ratio_low", None)
    high = config.get("clip_ratio_high", None)
    return (clip if low is None else low), (clip if high is None else high)
