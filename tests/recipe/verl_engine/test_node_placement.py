"""verl_engine.node_resources: verl's learner and sampler resource pools ask for their role's node
resource (recipe/gepo/verl_engine/node_placement.py), checked on real Ray placement groups."""

from __future__ import annotations

import pytest

from recipe.gepo.verl_engine.node_placement import (
    LEARNER_NODE_RESOURCE,
    SAMPLER_NODE_RESOURCE,
    node_resource_of,
    pin_pools_to_node_roles,
)


@pytest.mark.parametrize(
    "pool, resource",
    [
        ("global_pool", LEARNER_NODE_RESOURCE),  # verl's actor / ref / critic pool
        ("rollout_pool_0", SAMPLER_NODE_RESOURCE),  # standalone sampler replicas
        ("rollout_pool_12", SAMPLER_NODE_RESOURCE),
        ("rollout_pool_reward_0", None),  # a reward model's replicas: anywhere
        ("rollout_pool_teacher_0", None),
        ("reward_pool", None),
    ],
)
def test_each_pool_asks_for_its_roles_node_resource(pool, resource):
    assert node_resource_of(pool) == resource


def test_pinned_pools_ask_ray_for_their_roles_node_resource():
    """verl's own RayResourcePool, placed by real Ray on a node offering both resources: every
    bundle of the learner pool asks for the learner's node resource, every bundle of a sampler
    pool for the samplers' (a node without it never gets them: Ray's custom resources; the SLURM
    test places them on two nodes, tests/slurm/test_verl_star_on_cluster.py)."""
    import ray
    from ray.util import remove_placement_group
    from ray.util.placement_group import placement_group_table
    from verl.single_controller.ray.base import RayResourcePool

    pin_pools_to_node_roles()
    pin_pools_to_node_roles()  # idempotent
    ray.init(
        num_cpus=4,
        num_gpus=3,
        resources={LEARNER_NODE_RESOURCE: 10, SAMPLER_NODE_RESOURCE: 10},
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        for name, ranks, resource in (
            ("global_pool", 2, LEARNER_NODE_RESOURCE),
            ("rollout_pool_0", 1, SAMPLER_NODE_RESOURCE),
        ):
            pool = RayResourcePool(process_on_nodes=[ranks], use_gpu=True, name_prefix=name, max_colocate_count=1)
            pgs = pool.get_placement_groups(device_name="cpu")
            bundles = placement_group_table(pgs[0])["bundles"]
            assert len(bundles) == ranks
            assert all(b.get(resource) == pytest.approx(1e-4) and len(b) == 3 for b in bundles.values()), bundles
            for pg in pgs:
                remove_placement_group(pg)
    finally:
        ray.shutdown()
