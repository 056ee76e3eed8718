#!/usr/bin/env python3
"""A short async run of the embedded engine across the rate-limited link: the
engine over a real slow link, not an emulated delay.

    sudo .venv/bin/python -m research.testbeds.wan.async_run --rate-mbit 100 --steps 10 [--out /tmp/heterorl-wan-async]

Brings the two-node cluster up (``cluster.py up``), runs ``recipe.gepo.main_gepo`` with the
learner and the Ray mailbox on the head and two samplers in the sampler namespace
(``hetero.ray_address``, ``hetero.learner_ray_resources``, ``hetero.sampler_ray_resources``),
prints one JSON line (where Ray placed each actor, per-step times, idle fractions, the ledger,
the load average before and after) and always tears the cluster down. Bounded: ``--steps`` <= 200.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if not __package__:  # run as a file: its sibling modules are reachable only through the package
    raise SystemExit("run it from the repository root as: python -m research.testbeds.wan.async_run ...")
from . import cluster, link  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="/tmp/heterorl-wan-async")
    parser.add_argument("overrides", nargs="*", help="extra hydra overrides")
    args = parser.parse_args(argv)
    if not 1 <= args.steps <= 200:
        parser.error(f"--steps={args.steps} must be in [1, 200]")
    problems = link.missing_requirements(link.effective_caps())
    if problems:
        print(link.refusal_message(problems), file=sys.stderr)
        return 2
    cluster.join_env()  # the cluster's auth environment, before Ray is imported
    link_cfg, cluster_cfg = link.LinkConfig(), cluster.ClusterConfig()
    address = cluster.up(cluster_cfg, link_cfg, args.rate_mbit)
    try:
        from hydra import compose, initialize_config_dir

        overrides = [
            "algorithm_preset=gepo",
            "hetero.mode=async",
            "hetero.num_samplers=2",
            "hetero.delay.dist=none",
            "hetero.max_delay=4",
            f"trainer.total_training_steps={args.steps}",
            f"trainer.test_freq={args.steps}",
            f"trainer.save_freq={args.steps}",
            "trainer.resume_mode=disable",
            f"trainer.default_local_dir={args.out}",
            "task.eval_size=64",
            f"hetero.ray_address={address}",
            "hetero.learner_ray_resources={learner_node: 0.01}",
            "hetero.sampler_ray_resources={sampler_node: 0.01}",
            *args.overrides,
        ]
        with initialize_config_dir(config_dir=str(REPO / "recipe" / "gepo" / "config"), version_base=None):
            cfg = compose(config_name="gepo_trainer", overrides=overrides)
        from recipe.gepo.sections import HeteroConfig
        from recipe.gepo.main_gepo import run
        from verl_ext.rundir import read_metric_rows

        load_before = Path("/proc/loadavg").read_text().split()[:3]
        t0 = time.perf_counter()
        final = run(cfg)
        wall = time.perf_counter() - t0
        load_after = Path("/proc/loadavg").read_text().split()[:3]
        placed = placed_actors(HeteroConfig.from_omegaconf(cfg.hetero))
        steps = [r for r in read_metric_rows(args.out) if "perf/step_s" in r]
        print(
            json.dumps(
                {
                    "rate_mbit": args.rate_mbit,
                    "placed": placed,
                    "steps": len(steps),
                    "wall_s": round(wall, 1),
                    "load_before": load_before,
                    "load_after": load_after,
                    "step_s": [round(r["perf/step_s"], 2) for r in steps],
                    "train_s": [round(r["perf/train_s"], 2) for r in steps],
                    "idle": [round(r["perf/learner_idle_frac"], 2) for r in steps],
                    "ledger": {
                        k.removeprefix("hetero/ledger_"): v for k, v in final.items() if k.startswith("hetero/ledger_")
                    },
                }
            )
        )
    finally:
        cluster.down(cluster_cfg, link_cfg)
    return 0


def placed_actors(hetero) -> list[tuple[str, str]]:
    """(class, node IP) of every engine actor the cluster at ``hetero.ray_address`` has placed,
    the finished ones too (a read-only look, through the run's own ``ray_session``)."""
    from ray._private.state import actors

    from recipe.gepo.embedded.supervisor import ray_session

    with ray_session(hetero):
        return sorted(
            (a["ActorClassName"], a["Address"]["IPAddress"])
            for a in actors().values()
            if a["ActorClassName"] in ("SamplerWorker", "LearnerWorker", "_Mailbox")
        )


if __name__ == "__main__":
    sys.exit(main())
