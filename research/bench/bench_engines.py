"""Start-up and per-step time of the two engines on the same toy run, and of the verl engine with
1 vs 2 FSDP2 learner ranks and with Megatron (results in docs/scale-out.md).

    python -m research.bench.bench_engines [--steps 8] [--out docs/bench_engines.md] [--only NAME ...]

Every row (:data:`ROWS`) is ``main_gepo`` with the same toy model, batch (4 prompts x 4 responses, 8
response tokens), loss (gepo) and no weight delay, so the rows differ only in the engine: the
embedded engine's learner + 1 sampler actor on Ray (with the cpu_toy preset's batch keys: a verl
preset on the embedded engine is refused); verl 0.9.1's trainer with 1 hf_cpu sampler replica and
the learner on 1 or 2 FSDP2 ranks over gloo; the same with verl's Megatron engine at TP=2 or PP=2
(``+verl_preset=cpu_toy_megatron``). Start-up = the command's wall time minus the sum of its step
times (Ray, workers, model loading, TransferQueue); per-step = the median of the step times after
the first. Each row records the load average: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
from verl_ext.rundir import read_metric_rows

COMMON = [
    "--config-dir",
    "configs",
    "algorithm_preset=gepo",
    "hetero.delay.dist=none",
    "trainer.resume_mode=disable",
    f"task.cache_dir={REPO / '.cache' / 'heterorl'}",
]
EMBEDDED_AS_CPU_TOY = [
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "data.max_response_length=8",
    "trainer.logger=[console]",
    "trainer.save_freq=-1",
    "trainer.test_freq=0",
]
ROWS = {
    "embedded, async, 1 sampler": [
        "hetero.engine=embedded",
        "hetero.mode=async",
        "hetero.num_samplers=1",
        *EMBEDDED_AS_CPU_TOY,
    ],
    "verl, dp=1": ["+verl_preset=cpu_toy", "hetero.engine=verl", "trainer.n_gpus_per_node=1"],
    "verl, dp=2": ["+verl_preset=cpu_toy", "hetero.engine=verl", "trainer.n_gpus_per_node=2"],
    "verl, Megatron TP=2": ["+verl_preset=cpu_toy_megatron", "hetero.engine=verl"],
    "verl, Megatron PP=2": [
        "+verl_preset=cpu_toy_megatron",
        "hetero.engine=verl",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    ],
}
# the per-step wall time each engine logs
STEP_KEYS = ("timing_s/step", "perf/step_s")


def step_times(run_dir: Path) -> list[float]:
    times = []
    for row in read_metric_rows(run_dir, missing_ok=True, warn=False):
        for key in STEP_KEYS:
            if key in row:
                times.append(float(row[key]))
                break
    return times


def measure(name: str, steps: int, workdir: Path) -> dict:
    run_dir = workdir / name.replace(" ", "_").replace(",", "").replace("=", "")
    cmd = [
        sys.executable,
        "-m",
        "recipe.gepo.main_gepo",
        *COMMON,
        *ROWS[name],
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={run_dir}",
    ]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{' '.join(cmd)}\n{proc.stderr[-3000:]}")
    times = step_times(run_dir)
    if len(times) != steps:
        raise SystemExit(f"{name}: {len(times)} step times in {run_dir}/metrics.jsonl, expected {steps}")
    return {
        "name": name,
        "wall_s": wall,
        "startup_s": wall - sum(times),
        "first_step_s": times[0],
        "step_s": float(np.median(times[1:])) if len(times) > 1 else times[0],
        "load": f"{load_before:.2f} -> {os.getloadavg()[0]:.2f}",
    }


def table(results: list[dict], steps: int) -> str:
    lines = [
        f"{steps} steps each; {platform.node()}, {os.cpu_count()} cores, torch threads from OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}",
        "",
        "| run | wall (s) | start-up (s) | first step (s) | step, median of the rest (s) | load avg (before -> after) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['name']} | {r['wall_s']:.1f} | {r['startup_s']:.1f} | {r['first_step_s']:.2f} | {r['step_s']:.2f} "
            f"| {r['load']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="learner steps per run (>= 2)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this markdown file")
    parser.add_argument("--only", nargs="*", choices=sorted(ROWS), default=None, help="run only these rows")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps={args.steps}: need >= 2 (the first step is reported apart)")
    results = []
    with tempfile.TemporaryDirectory(prefix="bench_engines_") as tmp:
        for name in args.only or list(ROWS):
            print(f"running: {name} ...", flush=True)
            results.append(measure(name, args.steps, Path(tmp)))
            print(table(results[-1:], args.steps).splitlines()[-1], flush=True)
    text = table(results, args.steps)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
