"""HeteroRL's policy-loss options: verl's ``PolicyLossConfig`` plus the fields of the project's losses.

Importing this module registers nothing and patches nothing; the losses themselves are registered
by :mod:`verl_ext.algos.registry`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl.workers.config import PolicyLossConfig


@dataclass
class HeteroPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus the hyper-parameters of HeteroRL's losses.

    Select it with ``actor_rollout_ref.actor.policy_loss._target_=verl_ext.algos.config.HeteroPolicyLossConfig``
    (the recipe's presets do). verl's own losses ignore the extra fields; a loss-specific one set
    under a loss that does not read it is refused (:data:`LOSS_SPECIFIC_OPTIONS`).
    ``sampler_kl_coef`` is the exception: the project's engines add it to every loss.
    """

    group_size: int = 0
    """Responses per prompt (G, = ``rollout.n``). Used to form prompt groups when no per-sequence
    denominator or group index reaches the loss. 0 = unknown (GEPO then needs one of those)."""

    seq_reduction: str = "mean"
    """Sequence log-probability in the group-expectation losses' weights and denominators: gepo,
    eqp, gepo_adaptive, gepo_tr, gepo_tc (and the engines' GEPO denominators and E[A] diagnostic).
    "mean": length-normalised geometric mean, as the paper's code; "sum": full sequence. verl's
    gspo / geo_mean always length-normalise, topr has ``topr_reduction``: "sum" is refused there."""

    adaptive_kl_threshold: float = 0.002
    """gepo_adaptive: a sequence whose token-mean KL(sampler || learner) is below this uses p_i/q_i."""

    delta_l_alpha: float = 1.0
    """delta_l: exponent of the length weights L_i^-alpha (1 = minimum variance; paper uses 0.75 for math)."""

    topr_reduction: str = "sum"
    """topr: trajectory ratio for truncating negative examples. "sum": full sequence (the paper); "mean"."""

    m2po_threshold: float = 0.04
    """m2po: bound on the second moment mean((log p/q)^2) of the tokens kept (the paper: 0.04)."""

    vespo_k_pos: float = 2.0
    """vespo: exponent k of the kernel phi(W) = W^k exp(lam (1 - W)) for A >= 0 (authors' code: 2)."""

    vespo_lambda_pos: float = 3.0
    """vespo: rate lam of the kernel for A >= 0 (authors' code: 3; phi peaks at W = k / lam)."""

    vespo_k_neg: float = 3.0
    """vespo: exponent k for A < 0 (authors' code: 3)."""

    vespo_lambda_neg: float = 2.0
    """vespo: rate lam for A < 0 (authors' code: 2)."""

    tc_ess_bound: bool = False
    """gepo_tc: shrink the token clip band by the batch's effective sample size of p_it / q_it
    (GEPO-TC-ESS; 1 on-policy, so the band is unchanged there)."""

    compile: bool = False
    """gepo, eqp, gepo_adaptive, gepo_tr, gepo_tc: run the loss terms as one ``torch.compile``'d
    graph (:mod:`verl_ext.algos.compiled`: inductor, ``fullgraph=True``) instead of eager PyTorch:
    the same values and gradients within float32 rounding, far fewer kernel launches on a GPU.
    Each new batch shape compiles first (seconds on a GPU, up to a minute on a CPU); the batch
    size becomes symbolic after its first change, and the group count never recompiles.
    Refused where torch.compile cannot run. Off by default (the CPU runs stay as they were)."""

    sampler_kl_coef: float = 0.0
    """Weight of the KL(sampler || learner) penalty (per-token k3, (p/q - 1) - log(p/q)) added to
    the loss (the paper's runs: 0.005). 0 = off. The project's engines (loss bridge) add it to every
    loss, verl's too; under verl's stock trainer (``verl.trainer.main_ppo``) only the project's
    losses (:data:`verl_ext.algos.registry.HETERORL_LOSS_MODES`) add it, against the old_log_prob verl
    passes them -- verl's own losses cannot see it there."""

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
        for name in ("m2po_threshold", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            if not getattr(self, name) > 0:
                raise ValueError(f"policy_loss.{name} must be > 0, got {getattr(self, name)}")
        if self.compile:
            import torch._dynamo

            if not torch._dynamo.is_dynamo_supported():
                raise ValueError(
                    "policy_loss.compile=true needs torch.compile, which this Python / PyTorch does not "
                    "support (torch._dynamo.is_dynamo_supported() is False); set policy_loss.compile=false"
                )
        # a loss's own option set away from its default under another loss would do nothing
        loss_mode = getattr(self, "loss_mode", None)
        for name, modes in LOSS_SPECIFIC_OPTIONS.items():
            if getattr(self, name) != getattr(_FIELD_DEFAULTS, name) and loss_mode not in modes:
                raise ValueError(
                    f"policy_loss.{name}={getattr(self, name)!r} is read only by loss_mode {' / '.join(modes)}; "
                    f"with loss_mode={loss_mode!r} it would do nothing (remove it or switch the loss)"
                )


#: options that belong to one family of losses (the others would ignore them)
LOSS_SPECIFIC_OPTIONS: dict[str, tuple[str, ...]] = {
    # the losses that pass it to verl_ext.algos.losses (registry.py); gspo/geo_mean always
    # length-normalise, topr reads topr_reduction
    "seq_reduction": ("gepo", "eqp", "gepo_adaptive", "gepo_tr", "gepo_tc"),
    "adaptive_kl_threshold": ("gepo_adaptive",),
    "delta_l_alpha": ("delta_l",),
    "topr_reduction": ("topr",),
    "m2po_threshold": ("m2po",),
    "vespo_k_pos": ("vespo",),
    "vespo_lambda_pos": ("vespo",),
    "vespo_k_neg": ("vespo",),
    "vespo_lambda_neg": ("vespo",),
    "tc_ess_bound": ("gepo_tc",),
    # the losses with a compiled path (verl_ext.algos.compiled.COMPILABLE_LOSS_TERMS)
    "compile": ("gepo", "eqp", "gepo_adaptive", "gepo_tr", "gepo_tc"),
}


class _FieldDefaults:
    """The declared defaults, readable before any instance exists (``__post_init__`` needs them)."""

    def __getattr__(self, name: str) -> Any:
        return HeteroPolicyLossConfig.__dataclass_fields__[name].default


_FIELD_DEFAULTS = _FieldDefaults()
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
