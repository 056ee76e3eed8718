"""Async (decoupled learner + samplers) against synchronous generate-then-train, same model and steps.

    python scripts/bench/bench_async.py [--steps 60] [--out docs/bench_async.md] [extra hydra overrides ...]

Synchronous = replay mode with no delay: one process generates a batch with the current weights,
then trains on it, so the learner is idle while generating. Async = one learner and N sampler
actors on Ray with the same loss, batch size and steps. Reports wall time of the training loop
(sum of perf/step_s), steps/s, learner idle fraction and held-out accuracy after training.
Both runs use the cached toy warm start (created on first use, not timed).
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from verl_ext.rundir import read_metric_rows  # noqa: E402 -- after the path fix

COMMON = ["algorithm_preset=gepo", "trainer.resume_mode=disable", "trainer.test_freq=0", "task.eval_size=256"]
SETTINGS = {
    "synchronous (replay, no delay)": ["hetero.mode=replay", "hetero.delay.dist=none", "hetero.max_delay=0"],
    "async, 2 samplers": ["hetero.mode=async", "hetero.num_samplers=2", "hetero.delay.dist=none", "hetero.max_delay=4"],
}


def run(overrides: list[str], run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "recipe.gepo.main_gepo", *overrides, f"trainer.default_local_dir={run_dir}",
           f"hydra.run.dir={run_dir}/hydra"]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    total = time.perf_counter() - start
    rows = read_metric_rows(run_dir)
    steps = [r for r in rows if "perf/step_s" in r]
    loop_s = float(sum(r["perf/step_s"] for r in steps))
    return {
        "process_s": total,
        "loop_s": loop_s,
        "steps_per_s": len(steps) / loop_s,
        "idle": float(np.mean([r["perf/learner_idle_frac"] for r in steps])),
        "acc": rows[-1].get("eval/acc_mean", float("nan")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, default=None)
    args, extra = parser.parse_known_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in SETTINGS.items():
            results[name] = run(COMMON + overrides + [f"trainer.total_training_steps={args.steps}", *extra],
                                Path(tmp) / name.split()[0].strip(","))  # fmt: skip
    lines = [
        f"{args.steps} learner steps, toy addition (3 digits), GEPO, 8 prompts x G=8 per step; "
        f"{platform.machine()}, torch threads per process 1-2",
        "",
        "| setting | training loop s | steps/s | learner idle fraction | held-out acc after |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['loop_s']:.1f} | {r['steps_per_s']:.2f} | {r['idle']:.2f} | {r['acc']:.3f} |")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
