"""Async against synchronous generate-then-train on "separated hardware": same work, same model.

    python -m research.bench.bench_async [--steps 60] [--delays 0 1 5] [--learner-cpus 0] [--sampler-cpus 1]
                                        [--trust-off | --trust-checker | --trust-in-learner | --compare-trust ROUNDS [--settings ...]]
                                        [--warmup 5] [--out FILE] [extra hydra overrides ...]

The learner is pinned to ``--learner-cpus`` and the samplers to ``--sampler-cpus`` (``--no-pin``: all
share every core). Synchronous = replay mode, no delay: generate on the sampler cores, then train on
the learner cores; its wall at a transfer delay of d s per version is the measured wall + steps x d.
Async = one learner and ``--samplers`` sampler actors, a constant weight delay of d s per version.
Both consume the same groups with the same model, loss and batch size; the first ``--warmup`` steps
are reported apart. The table (async and synchronous wall, async / max(pure sampling, pure training),
the speed-up, async wall / its own train_step time, the learner's idle fraction and CPU, the load
around each run) and ``--compare-trust`` (rounds of trust off / checker process / checks in the
learner, in rotated order, and their medians): docs/benchmarks.md and docs/reliability.md."""

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
from verl_ext.rundir import read_metric_rows

COMMON = [
    "algorithm_preset=gepo",
    "trainer.resume_mode=disable",
    "trainer.test_freq=0",
    "trainer.save_freq=0",
    "task.eval_size=64",
]
SYNC = ["hetero.mode=replay", "hetero.delay.dist=none", "hetero.max_delay=0"]
TRUST_OFF = ["hetero.trust.sign_records=false", "hetero.trust.verify_fraction=0", "hetero.trust.check_rewards=false"]
# --compare-trust's settings, each named by its overrides (not by what the defaults are today)
TRUST_SETTINGS = {
    "off": TRUST_OFF,
    "checker process": ["hetero.trust.check_process=true"],
    "in the learner": ["hetero.trust.check_process=false"],
    "checker, unchecked taken": ["hetero.trust.check_process=true", "hetero.trust.hold_unchecked=false"],
}
DEFAULT_COMPARED = ("off", "checker process", "in the learner")


def async_overrides(delay_s: float, samplers: int) -> list[str]:
    # versions a sampler can be behind: d seconds of learner steps (~0.1-0.3 s each here) + a margin
    bound = 16 + int(delay_s * 12)
    delay = (
        ["hetero.delay.dist=none"] if delay_s == 0 else ["hetero.delay.dist=constant", f"hetero.delay.value={delay_s}"]
    )
    return [
        "hetero.mode=async",
        f"hetero.num_samplers={samplers}",
        *delay,
        f"hetero.max_delay={bound}",
        f"hetero.keep_weight_versions={bound + 2}",
        "hetero.max_queued_groups=16",
    ]


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def emit(lines: list[str], out: Path | None) -> None:
    """Print the table, and write it to ``out`` when given."""
    table = "\n".join(lines)
    print(table)
    if out is not None:
        out.write_text(table + "\n")


def counter_over(timed: list[dict], steps: list[dict], warmup: int, key: str, absent: float = np.nan) -> float:
    """A running total's growth over the timed steps (``absent`` where the run does not report it)."""
    start = float(steps[warmup - 1].get(key, absent)) if warmup else 0.0
    return float(timed[-1].get(key, absent)) - start


def run(overrides: list[str], run_dir: Path, warmup: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "recipe.gepo.main_gepo",
        *overrides,
        f"trainer.default_local_dir={run_dir}",
        f"hydra.run.dir={run_dir}/hydra",
    ]
    load_before = loadavg()
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    total = time.perf_counter() - start
    steps = [r for r in read_metric_rows(run_dir) if "perf/step_s" in r]
    timed = steps[warmup:]

    def total_of(key: str, rows=timed) -> float:
        return float(sum(r[key] for r in rows))

    return {
        "process_s": total,
        "steps": len(timed),
        "warmup_s": total_of("perf/wall_s", steps[:warmup]),
        "wall_s": total_of("perf/wall_s"),
        "step_s": total_of("perf/step_s"),
        "train_s": total_of("perf/train_s"),
        "train_cpu_s": total_of("perf/train_cpu_s"),
        "publish_s": total_of("perf/publish_s"),
        "wait_s": float(sum(r["perf/step_s"] * r["perf/learner_idle_frac"] for r in timed)),
        "consumed": total_of("hetero/consumed", steps),
        "staleness": float(np.mean([r["hetero/staleness_mean"] for r in timed])),
        # async runs: CPU seconds of the learner's whole process over the timed steps (all threads)
        "learner_cpu_s": counter_over(timed, steps, warmup, "perf/learner_process_cpu_s_total"),
        "poll_cpu_s": counter_over(timed, steps, warmup, "perf/learner_poll_cpu_s_total"),
        # checker-process runs: the learner waited while only verdicts kept it from its batch (0 otherwise)
        "verdict_block_s": counter_over(timed, steps, warmup, "perf/learner_verdict_block_s_total", absent=0.0),
        # ... the batches' round trips to the checker, how many, and its fetching of versions
        "round_trip_s": counter_over(timed, steps, warmup, "perf/trust_check_round_trip_s_total", absent=0.0),
        "check_batches": counter_over(timed, steps, warmup, "trust/check_batches", absent=0.0),
        "fetch_s": counter_over(timed, steps, warmup, "perf/trust_checker_fetch_s_total", absent=0.0),
        "check_cpu_s": counter_over(timed, steps, warmup, "perf/trust_check_cpu_s_total", absent=0.0),
        "load": f"{load_before} -> {loadavg()}",
    }


def compare_trust_table(args, sync: dict, delay: float, rounds: list[tuple[str, int, dict]]) -> list[str]:
    """--compare-trust's report: a row per run, then each setting's medians."""
    bound = max(sync["wait_s"], sync["train_s"])
    lines = [
        f"hetero.trust's cost to async mode: {args.steps} learner steps (the first {args.warmup} left out), toy "
        f"addition, GEPO, 8 prompts x G=8 per step, weight delay {delay:g} s; {platform.machine()}; learner on "
        f"cores [{args.learner_cpus}], samplers on [{args.sampler_cpus}]; {args.compare_trust} rounds, the "
        "settings' order rotated each round",
        "",
        f"synchronous run: pure sampling {sync['wait_s']:.2f} s, pure training {sync['train_s']:.2f} s; load {sync['load']}",
        "",
        "| setting | round | async wall s | async / max(sampling, training) | async wall / its own train_step "
        "| async wall / training CPU | train_step s | learner idle s | learner process CPU s "
        "| its poll thread's CPU s | blocked on verdicts s | staleness mean | load before -> after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r, run_ in rounds:
        lines.append(
            f"| {name} | {r} | {run_['wall_s']:.2f} | {run_['wall_s'] / bound:.2f} | {run_['wall_s'] / run_['train_s']:.3f} "
            f"| {run_['wall_s'] / run_['train_cpu_s']:.3f} | {run_['train_s']:.2f} | {run_['wait_s']:.2f} "
            f"| {run_['learner_cpu_s']:.2f} | {run_['poll_cpu_s']:.2f} | {run_['verdict_block_s']:.2f} "
            f"| {run_['staleness']:.2f} | {run_['load']} |"
        )
    lines += [
        "",
        "Medians per setting (and against protections off):",
        "",
        "| setting | async wall s | async / max(sampling, training) | vs off | async wall / its own train_step "
        "| vs off | async wall / training CPU | vs off | learner idle s | learner process CPU s "
        "| its poll thread's CPU s | blocked on verdicts s | cost to the learner |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def median(name: str, value) -> float:
        return float(np.median([value(run_) for n, _, run_ in rounds if n == name]))

    def own(x):
        return x["wall_s"] / x["train_s"]

    def per_cpu(x):
        return x["wall_s"] / x["train_cpu_s"]

    off = {key: median("off", f) for key, f in (("wall", lambda x: x["wall_s"]), ("own", own), ("cpu", per_cpu))}
    off_poll = median("off", lambda x: x["poll_cpu_s"])

    def to_learner(x):
        # what the checks cost the learner's critical path, as a share of its train_step: the
        # poll thread's CPU beyond trust off's (on the learner's core, holding its GIL: the books,
        # or every check with check_process=false) and the waits on verdicts
        return (x["poll_cpu_s"] - off_poll + x["verdict_block_s"]) / x["train_s"]

    for name in args.settings:
        wall, by_own, by_cpu = median(name, lambda x: x["wall_s"]), median(name, own), median(name, per_cpu)
        lines.append(
            f"| {name} | {wall:.2f} | {wall / bound:.2f} | {wall / off['wall']:.3f} | {by_own:.3f} "
            f"| {by_own / off['own']:.3f} | {by_cpu:.3f} | {by_cpu / off['cpu']:.3f} "
            f"| {median(name, lambda x: x['wait_s']):.2f} | {median(name, lambda x: x['learner_cpu_s']):.2f} "
            f"| {median(name, lambda x: x['poll_cpu_s']):.2f} | {median(name, lambda x: x['verdict_block_s']):.2f} "
            f"| {100 * median(name, to_learner):+.1f}% |"
        )
    lines += [
        "",
        "cost to the learner: (its poll thread's CPU - off's median + blocked on verdicts) / train_step, "
        "the median over the setting's runs",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--delays", type=float, nargs="+", default=[0.0, 1.0, 5.0])
    parser.add_argument("--samplers", type=int, default=1)
    parser.add_argument("--learner-cpus", default="0")
    parser.add_argument("--sampler-cpus", default="1")
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument(
        "--weights-bf16",
        action="store_true",
        help="async runs: hetero.weights_bf16=true (half the bytes to publish and load; the "
        "synchronous run hands weights over in memory)",
    )
    parser.add_argument(
        "--system-cpus",
        default=None,
        help="async runs: hetero.system_cpus (cores of the driver and Ray's processes, e.g. 0,1); "
        "default: the engine's (the cores not in --learner-cpus)",
    )
    parser.add_argument(
        "--trust-off",
        action="store_true",
        help="async runs: hetero.trust off (no signatures, no checks), as measured before signed records and checks",
    )
    parser.add_argument(
        "--trust-checker",
        action="store_true",
        help="async runs: hetero.trust.check_process=true, named (the default: the checks in a checker process "
        "on the system cores)",
    )
    parser.add_argument(
        "--trust-in-learner",
        action="store_true",
        help="async runs: hetero.trust.check_process=false (the checks in the learner's poll thread)",
    )
    parser.add_argument(
        "--compare-trust",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="at the first delay, ROUNDS rounds of async runs of each of --settings, in an order rotated "
        "each round, and their medians (docs/reliability.md)",
    )
    parser.add_argument(
        "--settings",
        nargs="+",
        choices=list(TRUST_SETTINGS),
        default=list(DEFAULT_COMPARED),
        help="--compare-trust's settings (off must be one: the others are read against it); 'checker, unchecked "
        "taken' is the checker process with hetero.trust.hold_unchecked=false",
    )
    parser.add_argument("--out", type=Path, default=None)
    args, extra = parser.parse_known_args()
    if sum([args.trust_off, args.trust_checker, args.trust_in_learner]) > 1:
        parser.error("--trust-off, --trust-checker and --trust-in-learner name one setting each: give one")
    if "off" not in args.settings:
        parser.error("--settings: include off (every other setting is read against it)")
    if args.compare_trust and (args.trust_off or args.trust_checker or args.trust_in_learner):
        parser.error(
            "--compare-trust runs every trust setting: drop --trust-off / --trust-checker / --trust-in-learner"
        )
    pin = (
        []
        if args.no_pin
        else [f"hetero.learner_cpus=[{args.learner_cpus}]", f"hetero.sampler_cpus=[{args.sampler_cpus}]"]
    )
    base = COMMON + pin + [f"trainer.total_training_steps={args.steps}"]
    with tempfile.TemporaryDirectory() as tmp:
        sync = run(base + SYNC + extra, Path(tmp) / "sync", args.warmup)
        system = [] if args.system_cpus is None else [f"hetero.system_cpus=[{args.system_cpus}]"]
        system += ["hetero.weights_bf16=true"] if args.weights_bf16 else []
        if args.compare_trust:
            delay = args.delays[0]
            names = list(args.settings)
            rounds = []
            for r in range(args.compare_trust):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    overrides = base + async_overrides(delay, args.samplers) + system + TRUST_SETTINGS[name] + extra
                    rounds.append(
                        (name, r + 1, run(overrides, Path(tmp) / f"trust{r}-{names.index(name)}", args.warmup))
                    )
                    print(f"round {r + 1}, {name}: async wall {rounds[-1][2]['wall_s']:.2f} s", file=sys.stderr)
            emit(compare_trust_table(args, sync, delay, rounds), args.out)
            return
        system += TRUST_OFF if args.trust_off else []
        system += ["hetero.trust.check_process=true"] if args.trust_checker else []
        system += ["hetero.trust.check_process=false"] if args.trust_in_learner else []
        runs = {
            d: run(base + async_overrides(d, args.samplers) + system + extra, Path(tmp) / f"async{d:g}", args.warmup)
            for d in args.delays
        }
    pure_sampling, pure_training = sync["wait_s"], sync["train_s"]
    bound = max(pure_sampling, pure_training)
    n = sync["steps"]
    lines = [
        f"{args.steps} learner steps (the first {args.warmup} reported apart), toy addition (3 digits), GEPO, "
        f"8 prompts x G=8 per step; {platform.machine()}; "
        + (
            "no pinning"
            if args.no_pin
            else f"learner on cores [{args.learner_cpus}], samplers on [{args.sampler_cpus}]"
        )
        + ("" if args.no_pin else f", driver and Ray's processes on [{args.system_cpus or 'the rest'}]")
        + f"; async: {args.samplers} sampler(s)"
        + (", bf16 weights" if args.weights_bf16 else "")
        + (
            ", hetero.trust off"
            if args.trust_off
            else ", hetero.trust on, checks in the learner's poll thread"
            if args.trust_in_learner
            else ", hetero.trust on, checks in a checker process"
        ),
        "",
        f"synchronous run: generation (pure sampling) {pure_sampling:.2f} s, learner.train_step (pure training) "
        f"{pure_training:.2f} s, loop wall {sync['wall_s']:.2f} s for {n} steps, {sync['consumed']:.0f} groups consumed; "
        f"load {sync['load']}",
        "",
        "| weight delay s/version | async wall s | sync wall s | async / max(sampling, training) | speed-up over sync "
        "| async wall / its own train_step time | learner idle | staleness | publish s | first steps s (async) "
        "| load before -> after |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for d, r in runs.items():
        sync_wall = sync["wall_s"] + n * d  # a synchronous step also waits for the transfer
        lines.append(
            f"| {d:g} | {r['wall_s']:.2f} | {sync_wall:.2f} (measured {sync['wall_s']:.2f} + {n} x {d:g}) "
            f"| {r['wall_s'] / bound:.2f} | {sync_wall / r['wall_s']:.2f} | {r['wall_s'] / r['train_s']:.2f} "
            f"| {r['wait_s'] / r['step_s']:.3f} | {r['staleness']:.1f} | {r['publish_s']:.2f} | {r['warmup_s']:.1f} "
            f"| {r['load']} |"
        )
        if r["consumed"] != sync["consumed"]:
            lines.append(
                f"| (consumed {r['consumed']:.0f} groups, synchronous {sync['consumed']:.0f}: not the same work) |"
            )
    lines += [
        "",
        "Where the async learner's wall time went (s, steps after the warm-up):",
        "",
        "| weight delay s/version | wall | train_step | publish | idle (waiting for groups) | between steps (driver) "
        "| learner process CPU s (all threads) | of which its poll thread's | of the idle: blocked on verdicts "
        "| checks' CPU s | batches to the checker | their round trips s | of which fetching versions s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d, r in runs.items():
        lines.append(
            f"| {d:g} | {r['wall_s']:.2f} | {r['train_s']:.2f} | {r['publish_s']:.2f} | {r['wait_s']:.2f} "
            f"| {r['wall_s'] - r['step_s']:.2f} | {r['learner_cpu_s']:.2f} | {r['poll_cpu_s']:.2f} "
            f"| {r['verdict_block_s']:.2f} | {r['check_cpu_s']:.2f} | {r['check_batches']:.0f} "
            f"| {r['round_trip_s']:.2f} | {r['fetch_s']:.2f} |"
        )
    emit(lines, args.out)


if __name__ == "__main__":
    main()
