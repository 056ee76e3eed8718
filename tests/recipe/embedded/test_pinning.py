"""Separated hardware on one box: ``hetero.learner_cpus`` / ``hetero.sampler_cpus``
pin the learner and sampler processes, and the Ray placement keys are typed and checked.

Real toy model, real Ray actors, real replay runs; pinning needs two cores (skipped otherwise).
"""

from __future__ import annotations

import os

import pytest
import ray
import torch

from recipe.gepo.sections import HeteroConfig
from recipe.gepo.embedded.sampler import SamplerWorker
from recipe.gepo.embedded.loop import LearnerRuntime, run_loop
from recipe.gepo.embedded.engine_config import EngineConfig
from recipe.gepo.embedded.replay import GenerateOn
from recipe.gepo.embedded.replay import ReplaySource
from recipe.gepo.embedded.run_log import MetricLogger
from recipe.gepo.main_gepo import run
from verl_ext.hetero.affinity import Pinned
from verl_ext.hetero.protocol import TransportSpec

from .helpers import read_metrics, train_lines

TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two usable cores")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"learner_cpus": [4096]}, r"hetero.learner_cpus=\[4096\]: cores \[4096\] do not exist"),
        ({"sampler_cpus": [-1]}, r"hetero.sampler_cpus=\[-1\]: core ids must be non-negative"),
        ({"sampler_cpus": [0, 0]}, r"hetero.sampler_cpus=\[0, 0\]: core ids repeat"),
        ({"sampler_ray_resources": {"sampler_node": 0.01}}, "set hetero.ray_address"),
        ({"ray_address": "10.0.0.1:6379", "learner_ray_resources": {"CPU": 1}}, "hetero.learner_ray_resources: 'CPU'"),
        (
            {"ray_address": "10.0.0.1:6379", "sampler_ray_resources": {"sampler_node": 0}},
            r"hetero.sampler_ray_resources.sampler_node=0 must be a number > 0",
        ),
    ],
)
def test_bad_pinning_and_placement_name_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HeteroConfig(**kwargs)


def test_placement_keys_parse_from_the_yaml(tiny_cfg, tmp_path):
    cfg = tiny_cfg(
        tmp_path,
        "hetero.ray_address=10.0.0.1:6379",
        "hetero.learner_ray_resources={learner_node: 0.01}",
        "hetero.sampler_ray_resources={sampler_node: 0.5}",
        "hetero.learner_cpus=[0]",
    )
    hetero = HeteroConfig.from_omegaconf(cfg.hetero)
    assert hetero.learner_ray_resources == {"learner_node": 0.01}
    assert hetero.sampler_ray_resources == {"sampler_node": 0.5}
    assert hetero.learner_cpus == [0] and hetero.sampler_cpus == []


@TWO_CORES
def test_pinned_moves_the_process_and_restores_it():
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    with Pinned([1], "hetero.sampler_cpus", threads=True):
        assert os.sched_getaffinity(0) == {1}
        assert torch.get_num_threads() == 1
    assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads


@TWO_CORES
@pytest.mark.slow  # Ray and a sampler actor, ~13 s (test_pinned_moves_the_process_and_restores_it: in-process)
def test_sampler_actor_runs_on_its_cores(tiny_cfg, tmp_path):
    cfg = tiny_cfg(tmp_path / "run", "hetero.mode=async", "hetero.sampler_cpus=[1]")
    spec = TransportSpec("fsspec", url=str(tmp_path / "exchange"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(num_cpus=0)(SamplerWorker).remote(
            0, EngineConfig.from_omegaconf(cfg), cfg.actor_rollout_ref.model.path, spec, 1.0, "s0-pin"
        )
        cores, threads, every_thread = ray.get(
            actor.__ray_call__.remote(
                lambda self: (
                    os.sched_getaffinity(0),
                    torch.get_num_threads(),
                    {t: os.sched_getaffinity(int(t)) == {1} for t in os.listdir("/proc/self/task")},
                )
            )
        )
    finally:
        ray.shutdown()
    assert cores == {1} and threads == 1
    assert all(every_thread.values()), every_thread  # Ray's and torch's threads too


class _RecordingReplay(ReplaySource):
    """The real replay source, noting the cores each batch is generated on."""

    seen: list[set[int]] = []

    def next_batch(self, step, n, learner_version):
        type(self).seen.append(os.sched_getaffinity(0))
        return super().next_batch(step, n, learner_version)


@TWO_CORES
@pytest.mark.slow  # two replay runs, ~10 s
def test_replay_generates_on_the_sampler_cores_and_gives_the_same_run(tiny_cfg, tmp_path):
    runs = {}
    for name, pins in (("free", []), ("pinned", ["hetero.learner_cpus=[0]", "hetero.sampler_cpus=[1]"])):
        cfg = tiny_cfg(
            tmp_path / name, "hetero.mode=replay", "trainer.total_training_steps=3", "trainer.test_freq=0", *pins
        )
        run(cfg)
        runs[name] = [
            {k: v for k, v in line.items() if not k.startswith(("perf/", "hetero/wait_s"))}
            for line in read_metrics(tmp_path / name)
        ]
    assert runs["pinned"] == runs["free"]  # pinning moves work between cores, never changes it

    # in-process: batches come from core 1, the learner trains on core 0, the caller's cores return
    cfg = tiny_cfg(
        tmp_path / "probe",
        "hetero.mode=replay",
        "trainer.total_training_steps=2",
        "trainer.test_freq=0",
        "hetero.learner_cpus=[0]",
        "hetero.sampler_cpus=[1]",
    )
    engine, before = EngineConfig.from_omegaconf(cfg), os.sched_getaffinity(0)
    _RecordingReplay.seen = []
    with Pinned(engine.hetero.learner_cpus, "hetero.learner_cpus", threads=True):
        runtime = LearnerRuntime(
            engine,
            cfg.actor_rollout_ref.model.path,
            lambda rt: GenerateOn(_RecordingReplay(rt), engine.hetero.sampler_cpus),
        )
        logger = MetricLogger(engine.settings.run_dir, engine.settings)
        assert os.sched_getaffinity(0) == {0}
        run_loop(runtime, engine, logger, desc="probe")
        assert os.sched_getaffinity(0) == {0}  # back on the learner core after every batch
        runtime.shutdown()
    assert _RecordingReplay.seen == [{1}, {1}]
    assert os.sched_getaffinity(0) == before
    assert len(train_lines(read_metrics(tmp_path / "probe"))) == 2


@TWO_CORES
def test_ray_processes_stay_off_the_learner_cores():
    """Async mode's default ``hetero.system_cpus``: the cores not in ``learner_cpus``. The driver
    moves there before ``ray.init``, so the GCS, the raylet and the Ray transport's mailbox it
    starts inherit them (they took 15-40% of a pinned learner core before)."""
    from recipe.gepo.embedded.async_shared import system_cores
    from verl_ext.hetero.transport import RayTransport

    assert system_cores(HeteroConfig(learner_cpus=[0])) == [c for c in range(os.cpu_count()) if c != 0]
    assert system_cores(HeteroConfig(learner_cpus=[0], system_cpus=[0])) == [0]  # explicit wins
    assert system_cores(HeteroConfig()) == []  # nothing pinned, nothing moved
    before = os.sched_getaffinity(0)
    with Pinned(system_cores(HeteroConfig(learner_cpus=[0], sampler_cpus=[1])), "hetero.system_cpus"):
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
        try:
            node = ray._private.worker._global_node
            pids = [p.process.pid for procs in node.all_processes.values() for p in procs if p.process is not None]
            ray_cores = {pid: os.sched_getaffinity(pid) for pid in pids}
            mailbox = RayTransport(name="pinning-test-mailbox", namespace="pinning-test")
            mailbox_cores = ray.get(mailbox._mailbox.__ray_call__.remote(lambda self: os.sched_getaffinity(0)))
            ray.kill(mailbox._mailbox)
        finally:
            ray.shutdown()
    assert os.sched_getaffinity(0) == before
    assert len(ray_cores) >= 2 and all(0 not in cores for cores in ray_cores.values()), ray_cores
    assert 0 not in mailbox_cores
