"""verl loads the project's plugin in every process that imports verl: check it in a real Ray
worker process (a failing plugin is only logged at DEBUG, so assert the names arrived)."""

import os

import pytest
import ray

# a literal on purpose: the worker must see the plugin register this known set (importing
# verl_ext.algos.registry here for the names would register them in the driver, not test the worker)
EXPECTED_LOSSES = ("gepo", "eqp", "gepo_adaptive", "gepo_tr", "gepo_tc", "topr", "delta_l", "m2po", "vespo")


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


@ray.remote(num_cpus=1)
def registries_in_worker():
    import verl  # noqa: F401  (loads entry points of group verl.plugins)
    from verl.trainer.ppo import core_algos

    from verl_ext.algos.worker_loss import hetero_ppo_loss

    losses = sorted(k for k in EXPECTED_LOSSES if k in core_algos.POLICY_LOSS_REGISTRY)
    gepo = core_algos.get_policy_loss_fn("gepo")
    return {
        "pid": os.getpid(),
        "losses": losses,
        "gepo_group_aware": bool(getattr(gepo, "accepts_group_info", False)),
        "bnpo": "bnpo" in core_algos.ADV_ESTIMATOR_REGISTRY,
        "bridge": hetero_ppo_loss.__module__,
    }


@pytest.mark.slow  # ~16 s; tests/test_verl_plugin.py's Ray probe checks the same registries in a worker by default
def test_plugin_registered_inside_a_ray_worker(ray_cluster):
    got = ray.get(registries_in_worker.remote(), timeout=240)
    assert got["pid"] != os.getpid()
    assert got["losses"] == sorted(EXPECTED_LOSSES)
    assert got["gepo_group_aware"] and got["bnpo"]
    assert got["bridge"] == "verl_ext.algos.worker_loss"
