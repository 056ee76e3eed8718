#!/usr/bin/env python3
"""Does SmolLM2-135M-Instruct learn through the verl engine? The runs and their report, one command each
(results: docs/scale-out.md).

    python -m research.study.smollm2_learning run --seeds 0 1 --steps 30      # one seed after another (resumable)
    python -m research.study.smollm2_learning report                          # table on stdout + figure
    python -m research.study.smollm2_learning evaluate                        # start vs each seed's last checkpoint

``run`` trains ``+verl_preset=cpu_smollm2_math hetero.engine=verl`` once per seed into
``runs/smollm2_gepo_s<seed>`` (``nice``, one torch thread a process, a checkpoint every 5 steps,
``trainer.resume_mode=auto``), verl's rollout dump beside it; one seed at a time (two do not fit in 24 GB).
``evaluate`` exports each seed's last checkpoint to float32 and runs ``recipe.gepo.evaluate`` on it and on
the starting model with the same settings (:data:`EVAL_SETTINGS`), each into ``outputs/eval/smollm2/<name>``
(resumable). ``report`` prints, per seed, the means of the reward and of the re-scored accuracy and boxed
rate over the first and the last ``--window`` steps, and whether every seed's rise exceeds the spread of
the seeds' first-window means; the figure (``--out``) shows each seed's per-step curves."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "runs"
FIGURE = ROOT / "docs" / "figures" / "smollm2_learning.png"
EVAL_DIR = ROOT / "outputs" / "eval" / "smollm2"
#: recipe.gepo.evaluate overrides shared by every model evaluated: the training template and
#: temperature, the full softmax (as the sampler drew), responses a little longer than in training
EVAL_SETTINGS = [
    "benchmarks=[math500,gsm8k]",
    "limit=20",
    "samples_per_problem=4",
    "temperature=0.5",
    "top_p=1.0",
    "top_k=0",
    "max_new_tokens=256",
    "template=chat_1shot",
    "batch_size=16",
    "dtype=float32",
]


def run_dir(seed: int) -> Path:
    return RUNS / f"smollm2_gepo_s{seed}"


def train_command(seed: int, steps: int) -> list[str]:
    out = run_dir(seed)
    return [
        "nice",
        "-n",
        "10",
        sys.executable,
        "-m",
        "recipe.gepo.main_gepo",
        "--config-dir",
        "configs",
        "+verl_preset=cpu_smollm2_math",
        "hetero.engine=verl",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=5",
        "trainer.resume_mode=auto",
        f"hetero.seed={seed}",
        f"data.seed={seed}",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"trainer.default_local_dir={out}",
        f"trainer.rollout_data_dir={out / 'rollouts'}",
    ]


def run(seeds: Sequence[int], steps: int) -> int:
    for seed in seeds:
        out = run_dir(seed)
        out.mkdir(parents=True, exist_ok=True)
        print(f"seed {seed}: {out} ({steps} steps)", flush=True)
        with open(out / "run.log", "a") as log:
            proc = subprocess.run(
                train_command(seed, steps),
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(os.environ, OMP_NUM_THREADS="1"),
            )
        if proc.returncode != 0:
            print(f"error: seed {seed} exited with status {proc.returncode}; see {out / 'run.log'}", file=sys.stderr)
            return proc.returncode
    return 0


def last_checkpoint(out: Path) -> Path:
    """``<run>/global_step_<N>/actor`` of the step verl's tracker names."""
    tracker = out / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        raise FileNotFoundError(f"{tracker}: no checkpoint of this run yet")
    return out / f"global_step_{int(tracker.read_text().strip())}" / "actor"


def evaluate(seeds: Sequence[int]) -> int:
    from recipe.gepo.verl_engine.fsdp_export import export
    from verl_ext.data.smollm2 import prepare_smollm2

    models = {"start": str(prepare_smollm2(ROOT / ".cache" / "heterorl"))}
    for seed in seeds:
        actor = last_checkpoint(run_dir(seed))
        step = actor.parent.name.split("_")[-1]
        target = EVAL_DIR / "models" / f"s{seed}_step{step}"
        if not (target / "model.safetensors").is_file():
            export(actor, target)
        models[f"s{seed}_step{step}"] = str(target)
    for name, path in models.items():
        print(f"evaluating {name}: {path}", flush=True)
        cmd = [
            "nice",
            "-n",
            "10",
            sys.executable,
            "-m",
            "recipe.gepo.evaluate",
            f"model_path={path}",
            f"output_dir={EVAL_DIR / name}",
            *EVAL_SETTINGS,
        ]
        proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if proc.returncode != 0:
            print(f"error: evaluating {name} exited with status {proc.returncode}", file=sys.stderr)
            return proc.returncode
    print("| model | " + " | ".join(("math500 mean@4", "gsm8k mean@4", "math500 boxed", "gsm8k boxed")) + " |")
    print("|---|---:|---:|---:|---:|")
    for name in models:
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in eval_scores(EVAL_DIR / name)) + " |")
    return 0


def eval_scores(out: Path) -> tuple[float, float, float, float]:
    """(math500 mean@k, gsm8k mean@k, share of math500 / gsm8k responses that gave a boxed answer:
    the math reward found one, ``error`` not in evaluate's NO_ANSWER_ERRORS) from records.jsonl."""
    from verl_ext.eval.run import NO_ANSWER_ERRORS

    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line.strip()]
    acc = {b: _mean([float(r["acc"]) for r in records if r["benchmark"] == b]) for b in ("math500", "gsm8k")}
    boxed = {
        b: _mean([float(r.get("error") not in NO_ANSWER_ERRORS) for r in records if r["benchmark"] == b])
        for b in ("math500", "gsm8k")
    }
    return acc["math500"], acc["gsm8k"], boxed["math500"], boxed["gsm8k"]


def per_step(out: Path) -> dict[int, dict[str, float]]:
    """step -> reward (metrics.jsonl), accuracy and boxed rate (the rollout dump of that step)."""
    rows: dict[int, dict[str, float]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "reward/mean" in row:
                rows[int(row["step"])] = {"reward": float(row["reward/mean"])}
    from verl_ext.rewards.math_reward import score_batch

    for dump in sorted((out / "rollouts").glob("*.jsonl")):
        samples = [json.loads(line) for line in dump.read_text().splitlines() if line.strip()]
        step = int(dump.stem)
        if step in rows and samples:
            # the dump keeps response and gold answer: scored again by the reward's own pieces
            scored = score_batch([s["output"] for s in samples], [s["gts"] for s in samples])
            rows[step]["acc"] = _mean([r["acc"] for r in scored])
            rows[step]["boxed"] = _mean([r["format_boxed"] for r in scored])
    return rows


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def report(seeds: Sequence[int], window: int, out_png: Optional[Path]) -> int:
    runs = {s: per_step(run_dir(s)) for s in seeds if (run_dir(s) / "metrics.jsonl").is_file()}
    if not runs:
        print(f"error: no run of seeds {list(seeds)} under {RUNS}", file=sys.stderr)
        return 2
    print(
        f"| seed | steps | reward first {window} | reward last {window} | rise | boxed first -> last | accuracy first -> last |"
    )
    print("|---:|---:|---:|---:|---:|---|---|")
    firsts, rises = [], []
    for seed, rows in runs.items():
        steps = sorted(rows)
        head, tail = steps[:window], steps[-window:]
        first, last = _mean([rows[s]["reward"] for s in head]), _mean([rows[s]["reward"] for s in tail])
        firsts.append(first)
        rises.append(last - first)
        boxed = [_mean([rows[s].get("boxed", float("nan")) for s in part]) for part in (head, tail)]
        acc = [_mean([rows[s].get("acc", float("nan")) for s in part]) for part in (head, tail)]
        print(
            f"| {seed} | {len(steps)} | {first:.3f} | {last:.3f} | {last - first:+.3f} | "
            f"{boxed[0]:.2f} -> {boxed[1]:.2f} | {acc[0]:.3f} -> {acc[1]:.3f} |"
        )
    spread = max(firsts) - min(firsts)
    verdict = "yes" if len(runs) > 1 and min(rises) > spread else "no" if len(runs) > 1 else "needs two seeds"
    print(f"\nseed-to-seed spread of the first-{window} means: {spread:.3f}; every seed's rise above it: {verdict}")
    if out_png is not None:
        _figure(runs, out_png)
        print(f"figure: {out_png}")
    return 0


def _figure(runs: dict[int, dict[int, dict[str, float]]], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for seed, rows in runs.items():
        steps = sorted(rows)
        for ax, key in zip(axes, ("reward", "boxed")):
            ys = [rows[s].get(key, float("nan")) for s in steps]
            line = ax.plot(steps, ys, alpha=0.35, lw=1)[0]
            rolled = [_mean([y for y in ys[max(0, i - 4) : i + 1] if y == y]) for i in range(len(ys))]
            ax.plot(steps, rolled, color=line.get_color(), lw=2, label=f"seed {seed} (5-step mean)")
    axes[0].set_title("reward/mean (accuracy + 0.1 x boxed)")
    axes[1].set_title("fraction of responses with a boxed answer")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, GEPO through the verl engine, easy GSM8K (cpu_smollm2_math)")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_run = sub.add_parser("run", help="train one run per seed, one after another (resumable)")
    p_run.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p_run.add_argument("--steps", type=int, default=30)
    p_eval = sub.add_parser("evaluate", help="the starting model and each seed's last checkpoint, same settings")
    p_eval.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p_rep = sub.add_parser("report", help="table on stdout, figure to --out")
    p_rep.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p_rep.add_argument("--window", type=int, default=5, help="steps averaged at the start and the end")
    p_rep.add_argument("--out", type=Path, default=FIGURE)
    args = parser.parse_args(argv)
    if args.cmd == "run":
        if args.steps < 1:
            parser.error(f"--steps {args.steps}: must be >= 1")
        return run(args.seeds, args.steps)
    if args.cmd == "evaluate":
        return evaluate(args.seeds)
    if args.window < 1:
        parser.error(f"--window {args.window}: must be >= 1")
    return report(args.seeds, args.window, args.out)


if __name__ == "__main__":
    sys.exit(main())
