"""What the verl engine's pool ingress costs its learner: one learner fed by one sampler pool, with the
ingress's re-score of q on and off, in alternating rounds.

    python -m research.bench.bench_pools [--steps 8] [--rounds 2] [--settings "verify 0.1" "verify 0"]
                                         [--out FILE] [extra hydra overrides ...]

Each run: a fresh run directory and exchange, the learner (``recipe.gepo.main_gepo``, ``+verl_preset=cpu_toy``,
pools only: ``hetero.transport=fs``) and one pool (``recipe.gepo.pool --index 32``) in their own Ray clusters,
signed groups, ``--steps`` GEPO steps. Reported per run, from the learner's metrics.jsonl over the steps after
the first (the first includes start-up): the median of verl's ``timing_s/step`` and of its ``timing_s/gen`` (the wait for
the slots to fill), the groups the ingress
re-scored (``trust/checked``) and the CPU seconds its checks took (``perf/trust_check_cpu_s_total``) as a share
of the learner's summed step time (the ingress runs in the learner's node: its CPU is what it can take from
training). The load around each run is printed; results: docs/scale-out.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SETTINGS = {
    "verify 0.1": ["hetero.trust.verify_fraction=0.1"],
    "verify 0": ["hetero.trust.verify_fraction=0"],
    "verify 1": ["hetero.trust.verify_fraction=1"],
    "verify 0.1, no hold": ["hetero.trust.verify_fraction=0.1", "hetero.trust.hold_unchecked=false"],
}
"""What each setting adds to the shared overrides."""


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def one_run(steps: int, extra: list[str], folder: Path) -> dict:
    """Learner and pool as two processes (two Ray clusters); returns the run's figures."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    key, enrolment, exchange, run_dir = folder / "pool.key", folder / "enrol.json", folder / "x", folder / "run"

    def run(args):
        return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, check=True)

    public = run(["-m", "verl_ext.trust.signing", "keygen", str(key), "pool-32"]).stdout.strip()
    run(["-m", "verl_ext.trust.signing", "enrol", str(enrolment), "pool-32", public])
    shared = [
        "+verl_preset=cpu_toy", "hetero.engine=verl", "hetero.transport=fs", f"hetero.transport_url={exchange}",
        "hetero.delay.dist=none", "hetero.max_delay=2", f"trainer.default_local_dir={run_dir}",
        "hetero.max_queued_groups=8", *extra,
    ]  # fmt: skip
    learner_cmd = [
        sys.executable, "-m", "recipe.gepo.main_gepo", "--config-dir", "configs", *shared,
        f"hetero.trust.enrolment_file={enrolment}",
        f"trainer.total_training_steps={steps}", "trainer.save_freq=0", "trainer.test_freq=0",
    ]  # fmt: skip
    pool_cmd = [sys.executable, "-m", "recipe.gepo.pool", "--index", "32", "--key", str(key), *shared]
    logs = {name: open(folder / f"{name}.log", "w") for name in ("learner", "pool")}
    load_before, t0 = loadavg(), time.monotonic()
    learner = subprocess.Popen(learner_cmd, cwd=REPO, env=env, stdout=logs["learner"], stderr=subprocess.STDOUT)
    time.sleep(5)  # the learner clears the exchange's old groups when it starts
    pool = subprocess.Popen(pool_cmd, cwd=REPO, env=env, stdout=logs["pool"], stderr=subprocess.STDOUT)
    try:
        if learner.wait(timeout=1800) != 0:
            raise RuntimeError(f"the learner failed: {(folder / 'learner.log').read_text()[-3000:]}")
        pool.wait(timeout=300)
    finally:
        for proc in (learner, pool):
            if proc.poll() is None:
                proc.kill()
        for f in logs.values():
            f.close()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_rows = [r for r in rows if "timing_s/step" in r and r.get("step", 0) >= 2]
    step_s = [float(r["timing_s/step"]) for r in steps_rows]
    gen_s = [float(r["timing_s/gen"]) for r in steps_rows if "timing_s/gen" in r]
    last = rows[-1]
    phases = sorted({k for r in steps_rows for k in r if k.startswith("timing_s/")})
    timing = {k: statistics.median(float(r[k]) for r in steps_rows if k in r) for k in phases}
    check_cpu = float(last.get("perf/trust_check_cpu_s_total", 0.0))
    return {
        "wall_s": time.monotonic() - t0,
        "load": f"{load_before} -> {loadavg()}",
        "steps": len(steps_rows),
        "step_s_median": statistics.median(step_s) if step_s else float("nan"),
        "gen_s_median": statistics.median(gen_s) if gen_s else float("nan"),
        "checked": int(last.get("trust/checked", 0)),
        "failed": int(last.get("trust/failed", 0)),
        "check_cpu_s": check_cpu,
        "check_share": check_cpu / sum(step_s) if step_s else float("nan"),
        "timing": timing,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settings", nargs="+", default=["verify 0.1", "verify 0"], choices=sorted(SETTINGS))
    parser.add_argument("--out", default="")
    args, extra = parser.parse_known_args(argv)
    lines = [
        f"(load at the start: {loadavg()}) one pool, toy (+verl_preset=cpu_toy), {args.steps} steps a run, "
        f"the steps after the first; extra overrides: {shlex.join(extra) or 'none'}",
        "",
        "| round | setting | median step s | of it waiting for groups (gen) | groups re-scored (failed) "
        "| ingress check CPU s | share of step time | run wall s | load |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    by_setting: dict[str, list[float]] = {}
    details: list[str] = []  # each run's median seconds per phase of verl's step (timing_s/*)
    for rnd in range(args.rounds):
        order = args.settings if rnd % 2 == 0 else list(reversed(args.settings))
        for name in order:
            with tempfile.TemporaryDirectory(prefix="bench-pools-") as tmp:
                figures = one_run(args.steps, SETTINGS[name] + extra, Path(tmp))
            by_setting.setdefault(name, []).append(figures["step_s_median"])
            lines.append(
                f"| {rnd + 1} | {name} | {figures['step_s_median']:.2f} | {figures['gen_s_median']:.2f} "
                f"| {figures['checked']} ({figures['failed']}) "
                f"| {figures['check_cpu_s']:.2f} | {100 * figures['check_share']:.1f}% | {figures['wall_s']:.0f} "
                f"| {figures['load']} |"
            )
            print(lines[-1], flush=True)
            details.append(f"{rnd + 1} {name}: " + ", ".join(f"{k[9:]} {v:.2f}" for k, v in figures["timing"].items()))
    lines += [
        "",
        "median step s by setting: " + ", ".join(f"{k} {statistics.median(v):.2f}" for k, v in by_setting.items()),
        "",
        "median s per phase of the step (verl's timing_s/*):",
        *details,
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
