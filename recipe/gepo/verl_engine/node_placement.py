"""Which Ray nodes each role of the verl engine may use (``verl_engine.node_resources``).

verl places the learner's worker group (resource pool ``global_pool``) and each standalone sampler
replica (pools ``rollout_pool_<rank>``) wherever their GPUs fit. On a cluster whose nodes have
roles -- ``scripts/slurm/verl_star.sbatch``: the first ``trainer.nnodes`` nodes are the learner's,
the rest the samplers' -- that is not enough: with equal GPUs per node Ray may swap them. verl's
``RayResourcePool`` has one hook for this, ``accelerator_type``: a custom resource every bundle of
the pool asks 1e-4 of. :func:`pin_pools_to_node_roles` sets it by pool name, in the process that
creates the pools (the trainer's), so the learner's bundles need :data:`LEARNER_NODE_RESOURCE`
and the samplers' :data:`SAMPLER_NODE_RESOURCE`; nodes offer them with
``ray start --resources='{"heterorl_learner_node": 1000}'``.
"""

from __future__ import annotations

from typing import Optional

LEARNER_NODE_RESOURCE = "heterorl_learner_node"
SAMPLER_NODE_RESOURCE = "heterorl_sampler_node"
# verl 0.9.1's pool names: trainer_base._init_resource_pool_mgr, rollout/replica.py init_standalone
LEARNER_POOL = "global_pool"
SAMPLER_POOL_PREFIX = "rollout_pool_"


def node_resource_of(pool_name: str) -> Optional[str]:
    """The node resource a pool's bundles must ask for, or None (reward / teacher pools: anywhere)."""
    if pool_name == LEARNER_POOL:
        return LEARNER_NODE_RESOURCE
    rest = pool_name[len(SAMPLER_POOL_PREFIX) :] if pool_name.startswith(SAMPLER_POOL_PREFIX) else None
    if rest is not None and not rest.startswith(("reward_", "teacher_")):
        return SAMPLER_NODE_RESOURCE
    return None


def pin_pools_to_node_roles() -> None:
    """From now on in this process, every learner or sampler resource pool places its bundles
    only on nodes offering its role's resource (idempotent)."""
    from verl.single_controller.ray.base import RayResourcePool

    original = RayResourcePool.get_placement_groups
    if getattr(original, "_heterorl_node_roles", False):
        return

    def get_placement_groups(self, *args, **kwargs):
        if self.pgs is None and self.accelerator_type is None:
            self.accelerator_type = node_resource_of(self.name_prefix)
        return original(self, *args, **kwargs)

    get_placement_groups._heterorl_node_roles = True
    RayResourcePool.get_placement_groups = get_placement_groups
