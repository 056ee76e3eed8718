"""The ``verl_engine:`` section: the few settings only the verl engine has.

Everything else the verl engine needs is read from keys that already exist: verl's own
(``trainer.nnodes``, ``actor_rollout_ref.rollout.nnodes``, TP/PP sizes, ...) and the shared
``hetero:`` section (delay model, ``max_delay``, ``stale_policy``, ``keep_weight_versions``).
Topology: learners on verl's trainer pool (``trainer.nnodes`` x ``trainer.n_gpus_per_node``),
samplers on verl's standalone rollout pool (``actor_rollout_ref.rollout.nnodes`` x
``n_gpus_per_node``, ``actor_rollout_ref.hybrid_engine=false``): a star around the learners.

The section is optional: a config without it (``gepo_trainer.yaml`` alone) gets the defaults
below. The presets in ``configs/`` write it out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

OLD_LOG_PROB_SOURCES = ("sampler", "recompute")

TRAINER_NAME = "hetero_separate_async"
"""Name under which recipe/gepo/verl_engine/trainer.py registers its trainer with verl's v1
trainer registry; ``run`` sets ``trainer.v1.trainer_mode`` to it."""

VERL_MODE_SECTION = "separate_async"
"""verl's ``trainer.v1.<section>`` whose settings the trainer inherits (it extends verl's
separate_async trainer: learners and samplers on separate GPU pools, the star topology)."""


@dataclass
class VerlEngineConfig:
    """Settings of the verl engine (``hetero.engine=verl``)."""

    old_log_prob: str = "sampler"
    """What the loss uses as q (``old_log_prob``). sampler: the vLLM sampler's own token
    log-probs (``rollout_log_probs``), as the embedded engine and the GEPO paper do -- q is the
    stale policy that generated the tokens. recompute: verl's decoupled mode, the learner
    recomputes them before the update (then GEPO's q is the learner's, not the sampler's)."""

    preset: str = ""
    """Name of the preset in ``configs/`` this config was composed from. Informational: the
    dry-run plan prints it; empty when composed from gepo_trainer.yaml and overrides only."""

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.old_log_prob not in OLD_LOG_PROB_SOURCES:
            raise ValueError(
                f"verl_engine.old_log_prob={self.old_log_prob!r}; expected one of {OLD_LOG_PROB_SOURCES}"
            )

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "VerlEngineConfig":
        """From the full composed config; a missing ``verl_engine`` section gives the defaults.
        Unknown keys are an error naming them."""
        node = cfg.get("verl_engine", None) if isinstance(cfg, DictConfig) else cfg.get("verl_engine")
        if node is None:
            return cls()
        data: dict[str, Any] = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown verl_engine keys {unknown}; known: {sorted(known)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
