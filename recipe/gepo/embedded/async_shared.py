"""What every process of async mode builds the same way: the transport spec, the weight store,
the thread rule of an actor and the system cores. Used by :mod:`.sampler` (sampler process),
:mod:`.learner_actor` (learner actor), :mod:`.checker` and :mod:`.supervisor` (the driver); the messages themselves are defined in
:mod:`verl_ext.hetero.protocol`."""

from __future__ import annotations

from ..sections import HeteroConfig
from .run_log import RunSettings
from verl_ext.hetero.affinity import machine_cpus, pin_process
from verl_ext.hetero.protocol import TransportSpec
from verl_ext.hetero.weights import WeightStore
from verl_ext.torch_threads import set_torch_threads


def transport_spec(hetero: HeteroConfig, settings: RunSettings) -> TransportSpec:
    """How every process reaches the shared transport."""
    if hetero.transport == "fs":
        return TransportSpec("fsspec", url=hetero.exchange_url(settings.run_dir))
    # the mailbox holds every message: on the learner's node (custom resources), as the learner
    return TransportSpec(
        "ray",
        name=f"heterorl-mailbox-{settings.experiment_name}-{hetero.seed}",
        resources=tuple(sorted(hetero.learner_ray_resources.items())),
    )


def weight_store(hetero: HeteroConfig, transport, pipelined: bool = False) -> WeightStore:
    """The weight store of the learner (publishes, ``pipelined``: without waiting for the mailbox
    to confirm each version) and of every sampler (fetches, through its delay channel):
    ``hetero.keep_weight_versions``, ``weights_bf16``, ``weight_sync``, ``max_delta_chain``."""
    return WeightStore(transport, **hetero.weight_store_options(), pipelined=pipelined)


def pin_worker(cpus: list[int], key: str) -> None:
    """Thread rule of every actor: pinned to ``cpus`` with that many torch threads
    (``hetero.learner_cpus`` / ``hetero.sampler_cpus``), else one torch thread (OMP_NUM_THREADS
    wins when set): more threads than the process's share of cores only makes them wait."""
    if cpus:
        pin_process(cpus, key)
    else:
        set_torch_threads(1)


def system_cores(hetero: HeteroConfig) -> list[int]:
    """``hetero.system_cpus``, or by default the machine's cores not in ``learner_cpus`` (none of
    them pinned when ``learner_cpus`` is empty)."""
    if hetero.system_cpus or not hetero.learner_cpus:
        return list(hetero.system_cpus)
    rest = [c for c in machine_cpus() if c not in hetero.learner_cpus]
    return rest or list(hetero.learner_cpus)  # a one-core machine: nowhere else to go
