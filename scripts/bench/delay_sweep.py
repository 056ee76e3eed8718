"""The delay sweep: every algorithm at max delay 0, 8 and 64, short and long answers, several seeds,
in replay mode, with the same warm start, steps and learning rate for all.

    .venv/bin/python scripts/bench/delay_sweep.py --out runs/sweep [--quick] [--workers 2]
        [--tasks short long] [--algos gepo gspo ...] [--delays 0 8 64] [--seeds 0 1 2]
        [--steps N] [--lr LR] [--table-only]

Each run is ``recipe.gepo.main_gepo``'s replay engine (same config, same code path) run in a
worker process with one torch thread (``OMP_NUM_THREADS`` if set); runs go to
``OUT/runs/<task>/<algo>/d<delay>/s<seed>/`` (``metrics.jsonl``, ``config.yaml``, ``DONE``); a
finished run is not run again, so an interrupted sweep continues where it stopped. Staleness:
in every run, tau_k is drawn from a log-normal in learner steps (99.5% of the mass in [1, 64],
median 8), rounded and capped at the max delay (so d=0 is on-policy and d=64 sees the whole
tail). The warm start is the cached toy checkpoint of seed 0 for every run (seeds only change the
RL sampling and the prompts).

Writes ``OUT/table_<task>.md`` and ``OUT/summary_<task>.csv`` (one row per algorithm and delay:
Best, Last, last-quarter mean, best-to-last gap, drop from delay 0 to 64, final KL and IS-weight
variance, each as mean and sample std over seeds; see :func:`summarize`) and the figures of
``recipe.gepo.plot`` per task in ``OUT/figures_<task>/``, and the E[A] diagnostics figures of
``verl_ext.analysis.run_diagnostics`` for the runs that logged them.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from verl_ext.rundir import METRICS_FILE, read_metric_rows, write_run_config  # noqa: E402 -- after the path fix

CONFIG_DIR = REPO / "recipe" / "gepo" / "config"

#: algorithm name -> hydra overrides. Controls: gepo_std (std-normalised advantages), *_nokl
#: (sampler-KL penalty off; presets have 0.005), grpo_tis (verl's decoupled truncated IS, C = 2).
ALGOS: dict[str, list[str]] = {
    "gepo": ["algorithm_preset=gepo"],
    "gspo": ["algorithm_preset=gspo"],
    "grpo": ["algorithm_preset=grpo"],
    "dr_grpo": ["algorithm_preset=dr_grpo"],
    "bnpo": ["algorithm_preset=bnpo"],
    "gepo_adaptive": ["algorithm_preset=gepo", "actor_rollout_ref.actor.policy_loss.loss_mode=gepo_adaptive"],
    "gmpo": ["algorithm_preset=gmpo"],
    "cispo": ["algorithm_preset=cispo"],
    "topr": ["algorithm_preset=topr"],
    "delta_l": ["algorithm_preset=delta_l"],
    "gepo_std": ["algorithm_preset=gepo", "algorithm.norm_adv_by_std_in_grpo=true"],
    "gepo_nokl": ["algorithm_preset=gepo", "actor_rollout_ref.actor.policy_loss.sampler_kl_coef=0.0"],
    "grpo_nokl": ["algorithm_preset=grpo", "actor_rollout_ref.actor.policy_loss.sampler_kl_coef=0.0"],
    "grpo_tis": ["algorithm_preset=grpo", "algorithm.rollout_correction.rollout_is=token",
                 "algorithm.rollout_correction.rollout_is_threshold=2.0"],
}
#: task name -> (answer format, max response tokens, warm-start window)
TASKS: dict[str, tuple[str, int, tuple[float, float]]] = {
    "short": ("short", 8, (0.3, 0.6)),
    "long": ("scratchpad", 24, (0.2, 0.7)),
}


@dataclass
class Plan:
    tasks: list[str]
    algos: list[str]
    delays: list[int]
    seeds: list[int]
    steps: int
    lr: float
    test_freq: int
    eval_size: int
    prompts: int
    diagnostics_every: int
    diagnostics_samples: int
    extra: list[str] = field(default_factory=list)


FULL = dict(tasks=["long", "short"], algos=list(ALGOS), delays=[0, 8, 64], seeds=[0, 1, 2], steps=60, lr=1e-4,
            test_freq=10, eval_size=64, prompts=8, diagnostics_every=10, diagnostics_samples=8)  # fmt: skip
QUICK = dict(tasks=["long", "short"], algos=["gepo", "gspo", "grpo"], delays=[0, 64], seeds=[0], steps=16, lr=1e-4,
             test_freq=8, eval_size=32, prompts=4, diagnostics_every=8, diagnostics_samples=8)  # fmt: skip


def warm_start_path(task: str, cache_dir: str) -> str:
    from verl_ext.data.toy import warm_start

    fmt, _, window = TASKS[task]
    return str(warm_start(cache_dir, digits=3, target_accuracy=window, max_seconds=600.0, seed=0, answer_format=fmt))


def run_overrides(plan: Plan, task: str, algo: str, delay: int, seed: int, model_path: str, run_dir: Path) -> list[str]:
    fmt, max_len, window = TASKS[task]
    return ALGOS[algo] + [
        "hetero.engine=local", "hetero.mode=replay", f"hetero.max_delay={delay}", "hetero.delay.dist=lognormal",
        "hetero.delay.low=1", "hetero.delay.high=64", f"hetero.seed={seed}",
        f"actor_rollout_ref.model.path={model_path}", f"actor_rollout_ref.actor.optim.lr={plan.lr}",
        f"data.train_batch_size={plan.prompts}", f"data.max_response_length={max_len}",
        f"trainer.total_training_steps={plan.steps}", f"trainer.test_freq={plan.test_freq}", "trainer.save_freq=-1",
        "trainer.resume_mode=disable", f"trainer.default_local_dir={run_dir}", f"task.eval_size={plan.eval_size}",
        f"task.warm_start_accuracy=[{window[0]},{window[1]}]", f"task.answer_format={fmt}",
        f"task.diagnostics_every={plan.diagnostics_every}", f"task.diagnostics_samples={plan.diagnostics_samples}",
    ] + plan.extra  # fmt: skip


def run_one(job: tuple[list[str], str]) -> tuple[str, float, str]:
    """Worker: one replay run, one torch thread unless ``OMP_NUM_THREADS`` says otherwise (what
    ``run_local`` does, minus its report and its end-of-run checkpoint). Returns (run dir,
    seconds, error or "")."""
    overrides, run_dir = job
    t0 = time.time()
    (Path(run_dir) / "FAILED").unlink(missing_ok=True)  # a retried run
    try:
        import torch

        from verl_ext.torch_threads import set_torch_threads

        set_torch_threads(1)  # one thread unless the user set OMP_NUM_THREADS
        from hydra import compose, initialize_config_dir
        from verl.utils.config import omega_conf_to_dataclass

        from recipe.gepo.hetero_config import HeteroConfig
        from recipe.gepo.local.replay import run_replay
        from recipe.gepo.local.run_utils import MetricLogger, RunSettings
        from recipe.gepo.local.tasks import Task, TaskConfig

        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = compose("gepo_trainer", overrides=overrides)
        hetero = HeteroConfig.from_omegaconf(cfg.hetero)
        settings = RunSettings.from_config(cfg)
        task = Task(TaskConfig.from_omegaconf(cfg.task), hetero.seed)
        actor_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
        algorithm_config = omega_conf_to_dataclass(cfg.algorithm)
        torch.manual_seed(hetero.seed)
        out = Path(run_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / METRICS_FILE).unlink(missing_ok=True)
        write_run_config(out, cfg)
        logger = MetricLogger(settings.run_dir, settings, cfg)
        try:
            run_replay(hetero, settings, task, settings.model_path, actor_config, algorithm_config, logger)
        finally:
            logger.close()
        for ckpt in out.glob("checkpoint*"):  # the final checkpoint: not needed by the sweep
            if ckpt.is_dir():
                import shutil

                shutil.rmtree(ckpt, ignore_errors=True)
            else:
                ckpt.unlink(missing_ok=True)
        (out / "DONE").write_text(json.dumps({"seconds": time.time() - t0}))
        return run_dir, time.time() - t0, ""
    except Exception as exc:  # noqa: BLE001 - a failed run is reported, the sweep goes on
        import traceback

        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / "FAILED").write_text(traceback.format_exc())
        return run_dir, time.time() - t0, f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------- table arithmetic


def _mean_std(values: list[float]) -> tuple[float, float]:
    v = [x for x in values if x is not None and math.isfinite(x)]
    if not v:
        return math.nan, math.nan
    m = sum(v) / len(v)
    s = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else math.nan
    return m, s


def run_numbers(metrics: list[dict], total_steps: int) -> dict[str, float]:
    """One run's numbers from its metrics rows (dicts with ``step``).

    Evaluations are ``eval/acc_mean`` at steps > 0 (the step-0 evaluation is the shared warm
    start, reported as ``start``). ``best`` = max, ``last`` = the final one, ``lq_mean`` = mean of
    the evaluations at steps > 0.75 * total_steps, ``gap`` = best - last. ``kl``, ``var``,
    ``weight_mean``, ``clipfrac`` = means of ``is/kl_sampler_learner``, ``is/weight_var``,
    ``is/weight_mean``, ``actor/pg_clipfrac`` over the training steps > 0.75 * total_steps;
    ``staleness`` and ``err`` = means of ``hetero/staleness_mean`` and
    ``diag/adv_estimation_error`` over all training steps that logged them.
    """
    evals = [(r["step"], r["eval/acc_mean"]) for r in metrics if "eval/acc_mean" in r and r["eval/acc_mean"] is not None]
    start = next((a for s, a in evals if s == 0), math.nan)
    after = [(s, a) for s, a in evals if s > 0]
    cut = 0.75 * total_steps
    out = {"start": start, "best": math.nan, "last": math.nan, "lq_mean": math.nan, "gap": math.nan}
    if after:
        accs = [a for _, a in after]
        out["best"], out["last"] = max(accs), accs[-1]
        lq = [a for s, a in after if s > cut]
        out["lq_mean"] = sum(lq) / len(lq) if lq else math.nan
        out["gap"] = out["best"] - out["last"]

    def tail_mean(key: str, all_steps: bool = False) -> float:
        vals = [r[key] for r in metrics if key in r and r[key] is not None and r["step"] > 0
                and (all_steps or r["step"] > cut) and math.isfinite(r[key])]  # fmt: skip
        return sum(vals) / len(vals) if vals else math.nan

    out["kl"] = tail_mean("is/kl_sampler_learner")
    out["var"] = tail_mean("is/weight_var")
    out["weight_mean"] = tail_mean("is/weight_mean")
    out["clipfrac"] = tail_mean("actor/pg_clipfrac")
    out["staleness"] = tail_mean("hetero/staleness_mean", all_steps=True)
    out["err"] = tail_mean("diag/adv_estimation_error", all_steps=True)
    return out


def paired_drops(per_run: list[dict]) -> dict[tuple, list[float]]:
    """(task, algo, delay > 0) -> lq_mean at delay 0 minus lq_mean at that delay, one difference
    per seed that ran at both."""
    lq = {(r["task"], r["algo"], r["delay"], r["seed"]): r["lq_mean"] for r in per_run}
    drops: dict[tuple, list[float]] = {}
    for (task, algo, delay, seed), value in lq.items():
        if delay > 0 and (task, algo, 0, seed) in lq:
            drops.setdefault((task, algo, delay), []).append(lq[(task, algo, 0, seed)] - value)
    return drops


# what run_numbers returns, in the order of the per-run CSV
RUN_KEYS = ("start", "best", "last", "lq_mean", "gap", "kl", "var", "weight_mean", "clipfrac", "staleness", "err")


def summarize(per_run: list[dict]) -> list[dict]:
    """Rows per (task, algo, delay) from per-run dicts (keys task, algo, delay, seed and the
    :func:`run_numbers` keys): ``<key>_mean`` / ``<key>_std`` (sample std over seeds, NaN for one
    seed) and ``n``. ``drop`` = lq_mean at delay 0 minus lq_mean at the row's delay, paired by seed
    (seeds present at both; ``drop_n`` of them), mean and std over seeds; NaN on delay-0 rows."""
    groups: dict[tuple, list[dict]] = {}
    for r in per_run:
        groups.setdefault((r["task"], r["algo"], r["delay"]), []).append(r)
    rows = []
    for (task, algo, delay), runs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        row = {"task": task, "algo": algo, "delay": delay, "n": len(runs), "seeds": sorted(r["seed"] for r in runs)}
        for k in RUN_KEYS:
            row[f"{k}_mean"], row[f"{k}_std"] = _mean_std([r[k] for r in runs])
        rows.append(row)
    drops = paired_drops(per_run)
    for row in rows:
        diffs = drops.get((row["task"], row["algo"], row["delay"]), [])
        row["drop_mean"], row["drop_std"] = _mean_std(diffs)
        row["drop_n"] = len(diffs)
    return rows


def _cell(m: float, s: float, digits: int = 3, sci: bool = False) -> str:
    if not math.isfinite(m):
        return "-"
    f = (lambda v: f"{v:.2e}") if sci else (lambda v: f"{v:.{digits}f}")
    return f(m) if not math.isfinite(s) else f"{f(m)} ± {f(s)}"


def markdown_table(rows: list[dict]) -> str:
    head = ("| algo | max delay | n | Best | Last | last-quarter mean | best-last gap | drop from delay 0 (lq) "
            "| KL(q‖p) | IS-weight var | E[A] error |")  # fmt: skip
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['algo']} | {r['delay']} | {r['n']} | {_cell(r['best_mean'], r['best_std'])} | "
            f"{_cell(r['last_mean'], r['last_std'])} | {_cell(r['lq_mean_mean'], r['lq_mean_std'])} | "
            f"{_cell(r['gap_mean'], r['gap_std'])} | {_cell(r['drop_mean'], r['drop_std'])} | "
            f"{_cell(r['kl_mean'], r['kl_std'], sci=True)} | {_cell(r['var_mean'], r['var_std'], sci=True)} | "
            f"{_cell(r['err_mean'], r['err_std'])} |"
        )
    return "\n".join(lines)


def stability_rows(summary: list[dict], per_run: list[dict]) -> list[dict]:
    """Per (task, algo) of :func:`summarize`'s rows: last-quarter mean at every delay (``lq_<d>``,
    mean over seeds) and the drop from delay 0 pooled over every delay > 0, paired by seed:
    ``pooled_drop`` (mean), ``pooled_se`` (standard error, std / sqrt(n)), ``pooled_n`` (pairs),
    ``worse`` (pairs with a positive drop)."""
    drops = paired_drops(per_run)
    rows: dict[tuple, dict] = {}
    for r in summary:
        row = rows.setdefault((r["task"], r["algo"]), {"task": r["task"], "algo": r["algo"], "diffs": []})
        row[f"lq_{r['delay']}"] = r["lq_mean_mean"]
        row["diffs"] += drops.get((r["task"], r["algo"], r["delay"]), [])
    for row in rows.values():
        diffs = row.pop("diffs")
        m, sd = _mean_std(diffs)
        row.update(pooled_drop=m, pooled_se=sd / math.sqrt(len(diffs)) if diffs else math.nan,
                   pooled_n=len(diffs), worse=sum(x > 0 for x in diffs))  # fmt: skip
    return list(rows.values())


def stability_table(rows: list[dict]) -> str:
    delays = sorted({int(k[3:]) for r in rows for k in r if k.startswith("lq_")})
    head = "| algo | " + " | ".join(f"lq, delay {d}" for d in delays) + " | drop over delays > 0 (± s.e.) | pairs worse |"
    lines = [head, "|" + "---|" * (len(delays) + 3)]
    for r in sorted(rows, key=lambda r: -r["pooled_drop"] if math.isfinite(r["pooled_drop"]) else 0):
        cells = " | ".join(_cell(r.get(f"lq_{d}", math.nan), math.nan) for d in delays)
        lines.append(f"| {r['algo']} | {cells} | {_cell(r['pooled_drop'], r['pooled_se'])} | {r['worse']}/{r['pooled_n']} |")
    return "\n".join(lines)


def collect(out: Path, plan: Plan) -> list[dict]:
    per_run = []
    for task in plan.tasks:
        for algo in plan.algos:
            for delay in plan.delays:
                for seed in plan.seeds:
                    d = out / "runs" / task / algo / f"d{delay}" / f"s{seed}"
                    if (d / "DONE").is_file() and (d / METRICS_FILE).is_file():
                        per_run.append({"task": task, "algo": algo, "delay": delay, "seed": seed, "dir": d,
                                        **run_numbers(read_metric_rows(d), plan.steps)})  # fmt: skip
    return per_run


def write_outputs(out: Path, plan: Plan, per_run: list[dict], figures: bool = True, log=print) -> None:
    import csv

    rows = summarize(per_run)
    for task in plan.tasks:
        mine = [r for r in rows if r["task"] == task]
        if not mine:
            continue
        md = markdown_table(mine)
        (out / f"table_{task}.md").write_text(md + "\n")
        with open(out / f"summary_{task}.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(mine[0].keys()))
            w.writeheader()
            w.writerows(mine)
        # one row per run, the seed-level numbers behind the summary
        with open(out / f"runs_{task}.csv", "w", newline="") as fh:
            fields = ["task", "algo", "delay", "seed", *RUN_KEYS]
            w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
            w.writeheader()
            w.writerows(r for r in per_run if r["task"] == task)
        stable = stability_table(stability_rows(mine, [r for r in per_run if r["task"] == task]))
        (out / f"stability_{task}.md").write_text(stable + "\n")
        log(f"\n## {task} answers ({TASKS[task][0]})\n{md}\n\nStability (sorted by drop):\n{stable}")
        if figures:
            _figures(out, task, [r for r in per_run if r["task"] == task], log)


def _figures(out: Path, task: str, per_run: list[dict], log) -> None:
    from recipe.gepo.plot import make_figures
    from verl_ext.analysis.run_diagnostics import make_diag_figures
    from verl_ext.rundir import load_run

    runs, labels = [], []
    for r in per_run:
        run = load_run(r["dir"])
        run.preset = run.loss_mode = r["algo"]  # group by the sweep's name (gepo_std and gepo share a loss)
        runs.append(run)
        labels.append(f"{r['algo']}, d={r['delay']}, s={r['seed']}")
    quiet = lambda *a, **k: None  # noqa: E731
    make_figures(runs, labels, out / f"figures_{task}", log=quiet)
    _, corr = make_diag_figures(runs, labels, out / f"figures_{task}", log=quiet)
    pooled = corr[corr["run"] == -1][["x", "y", "n", "r"]]
    log(f"\nPearson r pooled over all {task} runs' steps:\n{pooled.to_string(index=False)}")
    # per algorithm (the IS-weight variance is of each loss's own weights: token or sequence level)
    from verl_ext.analysis.run_diagnostics import diag_correlations

    rows = []
    for algo in dict.fromkeys(r["algo"] for r in per_run):
        idx = [i for i, r in enumerate(per_run) if r["algo"] == algo]
        c = diag_correlations([runs[i] for i in idx], [labels[i] for i in idx])
        for row in c[c["run"] == -1].itertuples():
            rows.append({"algo": algo, "x": row.x.split("/")[-1], "y": row.y.split("/")[-1], "n": row.n, "r": row.r})
    import pandas as pd

    table = pd.DataFrame(rows).pivot_table(index="algo", columns=["y", "x"], values="r", sort=False)
    table.to_csv(out / f"figures_{task}" / "correlations_by_algo.csv")
    log(f"\nPearson r per algorithm (pooled over its runs' steps; columns y / x):\n{table.round(2).to_string()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/sweep")
    p.add_argument("--quick", action="store_true", help="a 5-minute smoke version of the sweep")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tasks", nargs="+", choices=list(TASKS))
    p.add_argument("--algos", nargs="+", choices=list(ALGOS))
    p.add_argument("--delays", nargs="+", type=int)
    p.add_argument("--seeds", nargs="+", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--eval-size", type=int)
    p.add_argument("--diagnostics-every", type=int)
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "heterorl"))
    p.add_argument("--override", nargs="*", default=[], help="extra hydra overrides for every run")
    p.add_argument("--table-only", action="store_true", help="no runs: tables and figures from finished runs")
    p.add_argument("--no-figures", action="store_true")
    a = p.parse_args(argv)
    base = dict(QUICK if a.quick else FULL)
    for key, val in (("tasks", a.tasks), ("algos", a.algos), ("delays", a.delays), ("seeds", a.seeds),
                     ("steps", a.steps), ("lr", a.lr), ("eval_size", a.eval_size),
                     ("diagnostics_every", a.diagnostics_every)):  # fmt: skip
        if val is not None:
            base[key] = val
    plan = Plan(**base, extra=list(a.override))
    if a.workers < 1 or a.workers > 2:
        p.error("--workers must be 1 or 2 (a shared 2-core machine)")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan.__dict__, indent=1))
    t0 = time.time()
    if not a.table_only:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # the user's setting wins (verl_ext.torch_threads)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        os.environ.setdefault("TQDM_DISABLE", "1")
        models = {t: warm_start_path(t, a.cache_dir) for t in plan.tasks}
        jobs = []
        # priority order, so an interrupted sweep is still a usable one: first every algorithm at
        # the smallest and the largest delay (seed by seed, tasks and algorithms in the order
        # given), then the delays in between
        ends = {min(plan.delays), max(plan.delays)}
        tiers = [[d for d in plan.delays if d in ends], [d for d in plan.delays if d not in ends]]
        for tier in tiers:
            for seed in plan.seeds:
                for task in plan.tasks:
                    for delay in tier:
                        for algo in plan.algos:
                            d = out / "runs" / task / algo / f"d{delay}" / f"s{seed}"
                            if not (d / "DONE").is_file():
                                jobs.append((run_overrides(plan, task, algo, delay, seed, models[task], d), str(d)))
        print(f"{len(jobs)} runs to do ({a.workers} workers); outputs in {out}", flush=True)
        ctx = mp.get_context("spawn")
        with ctx.Pool(a.workers, maxtasksperchild=8) as pool:
            for i, (d, secs, err) in enumerate(pool.imap_unordered(run_one, jobs), 1):
                rel = Path(d).relative_to(out)
                print(f"[{i}/{len(jobs)}] {rel} {secs:.0f}s {'FAILED ' + err if err else ''} "
                      f"(elapsed {time.time() - t0:.0f}s)", flush=True)  # fmt: skip
    per_run = collect(out, plan)
    write_outputs(out, plan, per_run, figures=not a.no_figures)
    print(f"\n{len(per_run)} finished runs tabulated; total {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
