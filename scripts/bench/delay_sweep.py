"""The delay sweep: algorithms x staleness conditions x seeds in replay mode, with the same warm
start, steps and evaluation for all; designs from the 252-run legacy sweep to the powered study.

    .venv/bin/python scripts/bench/delay_sweep.py --out OUT [--design legacy|quick|powered|dry]
        [--workers 2] [--tasks long] [--algos gepo gspo ...] [--delays 0 fix16 uni64 ...]
        [--seeds 0 1 2] [--steps N] [--lr LR] [--lrs gepo=1e-4 ...] [--rows PATH]
        [--plan-only] [--table-only]

Each run is ``recipe.gepo.main_gepo``'s replay engine (same config, same code path) in a worker
process with one torch thread (``OMP_NUM_THREADS`` if set). A run's directory is
``OUT/runs/<task>/<algo>[@<lr>]/d<condition>/s<seed>/`` (``metrics.jsonl``, ``config.yaml``,
``DONE`` with the run's seconds and its warm start's weight hash); the ``@<lr>`` part appears when
a design tries several learning rates.

**Staleness conditions** (``--delays``; the realised mean and max of each run are in its row):

* ``0`` -- on-policy.
* ``fix<k>`` -- every batch exactly k versions old (``hetero.delay.dist=constant``, value k,
  ``max_delay`` k), except the first k steps, when only that many versions exist.
* ``uni<K>`` -- staleness uniform on {0, ..., K} (``hetero.delay.dist=uniform``, low 0, high K,
  ``integer=true``; ``max_delay`` K). Rows made before the named model read a trace file of the
  values 0..K resampled i.i.d.: the same draws (tests/hetero/test_hetero_delay_on_cpu.py).
* ``logn<K>`` or a bare integer K (the legacy sweep's "max delay K") -- the paper's log-normal
  in learner steps (99.5% of the mass in [1, 64], median 8), rounded, capped at K.

**Rows and resuming.** Every finished run appends one row to the rows file (``--rows``, default
``OUT/rows.csv``): its numbers (:func:`run_numbers`), realised staleness, the warm start's weight
hash and the design id (a hash of the settings a run depends on). A run whose row is present with
the same design id and warm-start hash is never run again, even if its directory is gone, so
committing the rows file makes the study resumable on another machine.

**Learning rates** (designs with ``lr_grid``): stage 1 runs every algorithm on-policy at each rate
of the grid for the ``lr_seeds``; the rule of :func:`choose_lrs` picks one rate per algorithm,
held fixed in stage 2 (every condition x seed). ``--lrs algo=lr`` pins rates and skips stage 1.

**Outputs** per task: ``table_<task>.md`` / ``summary_<task>.csv`` (per algorithm and condition),
``stability_<task>.md``, ``runs_<task>.csv`` (one row per run), and for the powered designs
``study_<task>.md``: the methods x conditions matrices (score, drop, paired differences), warm
start, learning-rate choice, drops with 95% t intervals, paired differences of drops GEPO minus
each baseline (interval, p-value, minimum detectable effect), the design's MDE, the correlation of
IS-weight variance with KL per method;
``figures_<task>/acc_vs_staleness.png`` and ``kl_vs_weight_var.png``.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import multiprocessing as mp
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from verl_ext.rundir import METRICS_FILE, read_metric_rows, write_run_config  # noqa: E402 -- after the path fix

CONFIG_DIR = REPO / "recipe" / "gepo" / "config"

#: algorithm name -> hydra overrides. Controls: gepo_std (std-normalised advantages), *_nokl
#: (sampler-KL penalty off; presets have 0.005), grpo_tis (verl's decoupled truncated IS, C = 2).
#: The paper's baselines: grpo_paper (no dual clip), gspo_wide (GSPO at clip 0.2); gspo keeps the
#: GSPO paper's 3e-4 / 4e-4 and grpo verl's dual clip (c = 3).
ALGOS: dict[str, list[str]] = {
    "gepo": ["algorithm_preset=gepo"],
    "gspo": ["algorithm_preset=gspo"],
    "gspo_wide": ["algorithm_preset=gspo_wide"],
    "grpo": ["algorithm_preset=grpo"],
    "grpo_paper": ["algorithm_preset=grpo_paper"],
    "dr_grpo": ["algorithm_preset=dr_grpo"],
    "bnpo": ["algorithm_preset=bnpo"],
    "gepo_adaptive": ["algorithm_preset=gepo", "actor_rollout_ref.actor.policy_loss.loss_mode=gepo_adaptive"],
    "gepo_tr": ["algorithm_preset=gepo", "actor_rollout_ref.actor.policy_loss.loss_mode=gepo_tr"],
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
LEGACY_ALGOS = [a for a in ALGOS if a not in ("gspo_wide", "grpo_paper", "gepo_tr")]


@dataclass(frozen=True)
class TaskSpec:
    """One toy task of the sweep."""

    answer_format: str
    """``task.answer_format``."""
    max_len: int
    """``data.max_response_length`` (a correct answer plus room)."""
    window: tuple[float, float]
    """Accuracy window of the legacy (unpinned) warm start."""


TASKS: dict[str, TaskSpec] = {
    "short": TaskSpec("short", 8, (0.3, 0.6)),
    "long": TaskSpec("scratchpad", 24, (0.2, 0.7)),
}


@dataclass
class Plan:
    """A sweep design; every field is a default of ``--design`` that a flag can replace."""

    tasks: list[str]
    algos: list[str]
    delays: list
    """staleness conditions: 0, ints (legacy log-normal caps), ``fix<k>``, ``uni<K>``, ``logn<K>``"""
    seeds: list[int]
    steps: int
    lr: float
    test_freq: int
    eval_size: int
    prompts: int
    diagnostics_every: int
    diagnostics_samples: int
    extra: list[str] = field(default_factory=list)
    warm_start_steps: int = 0
    """> 0: the pinned warm start of that many supervised steps (seed 0); 0: the legacy
    accuracy-window warm start (machine-dependent)."""
    last_evals: int = 0
    """a run's score (``lq_mean``): the mean of its last k evaluations; 0: of the evaluations at
    steps > 0.75 x steps (the legacy "last-quarter mean")."""
    lrs: dict = field(default_factory=dict)
    """algo -> pinned learning rate (overrides ``lr`` and the grid)."""
    lr_grid: list = field(default_factory=list)
    """stage 1: on-policy runs at each of these rates, the rule of :func:`choose_lrs` picks one."""
    lr_seeds: list = field(default_factory=list)
    """seeds of stage 1."""
    reference: str = "gepo"
    """the method every other one is compared with in the paired tables."""
    variants: list = field(default_factory=lambda: ["gepo_tr"])
    """methods that also get a paired table against every other one (the project's variants:
    issue 13 asks whether one beats every baseline), when the rows hold them."""
    design: str = "legacy"


LEGACY = dict(tasks=["long", "short"], algos=LEGACY_ALGOS, delays=[0, 8, 64], seeds=[0, 1, 2], steps=60, lr=1e-4,
              test_freq=10, eval_size=64, prompts=8, diagnostics_every=10, diagnostics_samples=8)  # fmt: skip
QUICK = dict(tasks=["long", "short"], algos=["gepo", "gspo", "grpo"], delays=[0, 64], seeds=[0], steps=16, lr=1e-4,
             test_freq=8, eval_size=32, prompts=4, diagnostics_every=8, diagnostics_samples=8)  # fmt: skip
#: the powered study (docs/study.md): 16 prompts x G=8, 200 steps, 512 held-out problems every 20
#: steps, score = mean of the last 5 evaluations, 5 seeds, each method's rate chosen on-policy.
#: Cut to fit the budget (docs/study.md): verl's dual-clip grpo and gepo_adaptive (--algos adds them).
POWERED = dict(tasks=["long"], algos=["gepo", "grpo_paper", "gspo_wide", "gepo_tr", "gspo"],
               delays=[0, "fix4", "fix16", "fix64", "uni64", "logn64"], seeds=[0, 1, 2, 3, 4], steps=200, lr=1e-4,
               test_freq=20, eval_size=512, prompts=16, diagnostics_every=0, diagnostics_samples=8,
               warm_start_steps=210, last_evals=5, lr_grid=[5e-5, 1e-4, 2e-4], lr_seeds=[0, 1, 2],
               design="powered")  # fmt: skip
#: the powered pipeline end to end in minutes: tiny settings, same stages and outputs
DRY = dict(POWERED, algos=["gepo", "grpo_paper", "gspo_wide"], delays=[0, "fix4", "uni8"], seeds=[0, 1, 2], steps=8,
           test_freq=2, eval_size=32, prompts=4, last_evals=2, lr_grid=[1e-4, 2e-4], lr_seeds=[0], design="dry")
DESIGNS = {"legacy": LEGACY, "quick": QUICK, "powered": POWERED, "dry": DRY}
FULL = LEGACY  # the name older notes use

#: measured defaults for the budget before any run finished: seconds per learner step at 16
#: prompts x 8 on the long task and per evaluated problem, one worker, machine load ~4 (docs/study.md)
SECONDS_PER_STEP_16 = 1.16
SECONDS_PER_EVAL_PROBLEM = 0.007

_COND = re.compile(r"^(fix|uni|logn)(\d+)$")


def parse_condition(label) -> tuple[str, int]:
    """``0`` -> ("on", 0); an int K -> ("logn", K); ``fix16`` -> ("fix", 16); ``uni64``; ``logn64``."""
    if isinstance(label, int) or (isinstance(label, str) and label.isdigit()):
        k = int(label)
        if k < 0:
            raise ValueError(f"staleness condition {label!r}: must be >= 0")
        return ("on", 0) if k == 0 else ("logn", k)
    m = _COND.match(str(label))
    if not m:
        raise ValueError(f"staleness condition {label!r}: expected 0, an int, fix<k>, uni<K> or logn<K>")
    kind, k = m.group(1), int(m.group(2))
    if k < 1:
        raise ValueError(f"staleness condition {label!r}: k must be >= 1 (use 0 for on-policy)")
    return kind, k


def normalize_condition(label):
    """Ints stay ints (0 and the legacy caps), the rest stays a validated str."""
    parse_condition(label)
    return int(label) if isinstance(label, int) or str(label).isdigit() else str(label)


def condition_key(label) -> tuple[int, int, str]:
    kind, k = parse_condition(label)
    return ({"on": 0, "fix": 1, "uni": 2, "logn": 3}[kind], k, str(label))


def condition_overrides(label, out: Path) -> list[str]:
    kind, k = parse_condition(label)
    if kind in ("on", "logn"):
        return ["hetero.delay.dist=lognormal", "hetero.delay.low=1", "hetero.delay.high=64", f"hetero.max_delay={k}"]
    if kind == "fix":
        return ["hetero.delay.dist=constant", f"hetero.delay.value={k}", f"hetero.max_delay={k}"]
    return ["hetero.delay.dist=uniform", "hetero.delay.low=0", f"hetero.delay.high={k}", "hetero.delay.integer=true",
            f"hetero.max_delay={k}"]


def warm_start_path(task: str, cache_dir: str, steps: int = 0) -> str:
    """The task's warm start: pinned (``steps`` > 0, seed 0) or the legacy accuracy window."""
    from verl_ext.data.toy import warm_start

    spec = TASKS[task]
    if steps > 0:
        return str(warm_start(cache_dir, digits=3, steps=steps, seed=0, answer_format=spec.answer_format))
    return str(warm_start(cache_dir, digits=3, target_accuracy=spec.window, max_seconds=600.0, seed=0,
                          answer_format=spec.answer_format))  # fmt: skip


def multi_lr(plan: Plan) -> bool:
    """Run directories carry the rate when a design tries or pins per-algorithm rates."""
    return bool(plan.lr_grid or plan.lrs)


def run_dir(out: Path, plan: Plan, task: str, algo: str, lr: float, delay, seed: int) -> Path:
    name = f"{algo}@{lr:g}" if multi_lr(plan) else algo
    return out / "runs" / task / name / f"d{delay}" / f"s{seed}"


def design_id(plan: Plan) -> str:
    """Hash of the settings a run's outcome depends on besides (task, algo, lr, condition, seed)."""
    keys = dict(steps=plan.steps, test_freq=plan.test_freq, eval_size=plan.eval_size, prompts=plan.prompts,
                diagnostics_every=plan.diagnostics_every, diagnostics_samples=plan.diagnostics_samples,
                extra=list(plan.extra), warm_start_steps=plan.warm_start_steps)  # fmt: skip
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:12]


def run_overrides(plan: Plan, task: str, algo: str, delay, seed: int, model_path: str, run_dir: Path,
                  lr: float | None = None, out: Path | None = None) -> list[str]:  # fmt: skip
    spec = TASKS[task]
    lr = plan.lr if lr is None else lr
    out = Path(run_dir).parents[4] if out is None else out
    window = spec.window
    return ALGOS[algo] + condition_overrides(delay, out) + [
        "hetero.engine=local", "hetero.mode=replay", f"hetero.seed={seed}",
        f"actor_rollout_ref.model.path={model_path}", f"actor_rollout_ref.actor.optim.lr={lr}",
        f"data.train_batch_size={plan.prompts}", f"data.max_response_length={spec.max_len}",
        f"trainer.total_training_steps={plan.steps}", f"trainer.test_freq={plan.test_freq}", "trainer.save_freq=-1",
        "trainer.resume_mode=disable", f"trainer.default_local_dir={run_dir}", f"task.eval_size={plan.eval_size}",
        f"task.warm_start_accuracy=[{window[0]},{window[1]}]", f"task.answer_format={spec.answer_format}",
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
        from verl_ext.data.toy import weights_sha256

        # the run's own record of what it started from (rows carry it too)
        sha = weights_sha256(settings.model_path) if settings.model_path else ""
        (out / "DONE").write_text(json.dumps({"seconds": time.time() - t0, "ws_sha256": sha}))
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


#: mechanism metrics averaged over the tail steps: run key -> metrics.jsonl key (NaN when a loss
#: does not log it)
MECHANISMS = {
    "kl": "is/kl_sampler_learner",
    "var": "is/weight_var",
    "weight_mean": "is/weight_mean",
    "clipfrac": "actor/pg_clipfrac",
    "clipfrac_pos": "is/clipfrac_pos_adv",
    "clipfrac_neg": "is/clipfrac_neg_adv",
    "weight_right": "is/grad_weight_pos_adv",
    "weight_wrong": "is/grad_weight_neg_adv",
}


def run_numbers(metrics: list[dict], total_steps: int, last_evals: int = 0) -> dict[str, float]:
    """One run's numbers from its metrics rows (dicts with ``step``).

    Evaluations are ``eval/acc_mean`` at steps > 0 (the step-0 evaluation is the shared warm
    start, reported as ``start``). ``best`` = max, ``last`` = the final one, ``gap`` = best - last,
    ``lq_mean`` (the run's score) = mean of the last ``last_evals`` evaluations, or with
    ``last_evals=0`` of the evaluations at steps > 0.75 * total_steps. The :data:`MECHANISMS`
    (``kl``, ``var``, ``weight_mean``, ``clipfrac``, the clip fractions by advantage sign
    ``clipfrac_pos`` / ``clipfrac_neg`` and the relative gradient weights of right / wrong answers
    ``weight_right`` / ``weight_wrong``, see ``verl_ext.loss_bridge.gradient_mechanism_metrics``)
    are means over the training steps > 0.75 * total_steps; ``zero_grad_stale`` = mean share of
    sequences whose whole gradient the loss removed over the steps trained on stale data
    (staleness > 0); ``staleness`` and ``err`` = means of ``hetero/staleness_mean`` and
    ``diag/adv_estimation_error`` over all training steps that logged them, ``staleness_max`` the
    largest ``hetero/staleness_max``.
    """
    evals = [(r["step"], r["eval/acc_mean"]) for r in metrics if "eval/acc_mean" in r and r["eval/acc_mean"] is not None]
    start = next((a for s, a in evals if s == 0), math.nan)
    after = [(s, a) for s, a in evals if s > 0]
    cut = 0.75 * total_steps
    out = {"start": start, "best": math.nan, "last": math.nan, "lq_mean": math.nan, "gap": math.nan}
    if after:
        accs = [a for _, a in after]
        out["best"], out["last"] = max(accs), accs[-1]
        lq = accs[-last_evals:] if last_evals > 0 else [a for s, a in after if s > cut]
        out["lq_mean"] = sum(lq) / len(lq) if lq else math.nan
        out["gap"] = out["best"] - out["last"]

    def tail(key: str, all_steps: bool = False) -> list[float]:
        return [r[key] for r in metrics if key in r and r[key] is not None and r["step"] > 0
                and (all_steps or r["step"] > cut) and math.isfinite(r[key])]  # fmt: skip

    def tail_mean(key: str, all_steps: bool = False) -> float:
        vals = tail(key, all_steps)
        return sum(vals) / len(vals) if vals else math.nan

    for name, key in MECHANISMS.items():
        out[name] = tail_mean(key)
    # replay trains each step on one version: a step's sequences are all as stale as the step
    stale_steps = {r["step"] for r in metrics if r.get("hetero/staleness_mean", 0) and r["step"] > 0}
    zero = [r["is/zero_grad_seq_frac"] for r in metrics if r["step"] in stale_steps and "is/zero_grad_seq_frac" in r]
    out["zero_grad_stale"] = sum(zero) / len(zero) if zero else math.nan
    out["staleness"] = tail_mean("hetero/staleness_mean", all_steps=True)
    out["staleness_max"] = max(tail("hetero/staleness_max", all_steps=True), default=math.nan)
    out["err"] = tail_mean("diag/adv_estimation_error", all_steps=True)
    return out


def paired_drops(per_run: list[dict]) -> dict[tuple, list[float]]:
    """(task, algo, condition != 0) -> lq_mean on-policy minus lq_mean at that condition, one
    difference per seed that ran at both (same task, algo and learning rate)."""
    lq = {(r["task"], r["algo"], r["delay"], r["seed"]): r["lq_mean"] for r in per_run}
    drops: dict[tuple, list[float]] = {}
    for (task, algo, delay, seed), value in sorted(lq.items(), key=lambda kv: kv[0][3]):
        if delay != 0 and (task, algo, 0, seed) in lq:
            drops.setdefault((task, algo, delay), []).append(lq[(task, algo, 0, seed)] - value)
    return drops


# what run_numbers returns, in the order of the per-run CSV
RUN_KEYS = ("start", "best", "last", "lq_mean", "gap", "kl", "var", "weight_mean", "clipfrac", "staleness",
            "staleness_max", "err", "clipfrac_pos", "clipfrac_neg", "zero_grad_stale", "weight_right",
            "weight_wrong")  # fmt: skip


def _group_key(r: dict) -> tuple:
    return (r["task"], r["algo"], condition_key(r["delay"]))


def summarize(per_run: list[dict]) -> list[dict]:
    """Rows per (task, algo, condition) from per-run dicts (keys task, algo, delay, seed and the
    :func:`run_numbers` keys): ``<key>_mean`` / ``<key>_std`` (sample std over seeds, NaN for one
    seed) and ``n``. ``drop`` = lq_mean on-policy minus lq_mean at the row's condition, paired by
    seed (seeds present at both; ``drop_n`` of them), mean and std over seeds; NaN on-policy."""
    groups: dict[tuple, list[dict]] = {}
    for r in per_run:
        groups.setdefault(_group_key(r), []).append(r)
    rows = []
    for _, runs in sorted(groups.items()):
        first = runs[0]
        row = {"task": first["task"], "algo": first["algo"], "delay": first["delay"], "n": len(runs),
               "seeds": sorted(r["seed"] for r in runs)}  # fmt: skip
        if "lr" in first:
            row["lr"] = first["lr"]
        for k in RUN_KEYS:
            row[f"{k}_mean"], row[f"{k}_std"] = _mean_std([r.get(k, math.nan) for r in runs])
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
    """Per (task, algo) of :func:`summarize`'s rows: score at every condition (``lq_<label>``,
    mean over seeds) and the drop from on-policy pooled over every other condition, paired by seed:
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
    delays = sorted({normalize_condition(k[3:]) for r in rows for k in r if k.startswith("lq_")}, key=condition_key)
    head = "| algo | " + " | ".join(f"lq, delay {d}" for d in delays) + " | drop over delays > 0 (± s.e.) | pairs worse |"
    lines = [head, "|" + "---|" * (len(delays) + 3)]
    for r in sorted(rows, key=lambda r: -r["pooled_drop"] if math.isfinite(r["pooled_drop"]) else 0):
        cells = " | ".join(_cell(r.get(f"lq_{d}", math.nan), math.nan) for d in delays)
        lines.append(f"| {r['algo']} | {cells} | {_cell(r['pooled_drop'], r['pooled_se'])} | {r['worse']}/{r['pooled_n']} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- rows (resume) and runs

ROW_FIELDS = ("task", "algo", "lr", "delay", "seed", "design_id", "ws_sha256", "steps", "seconds", *RUN_KEYS)


def row_key(r: dict) -> tuple:
    return (r["task"], r["algo"], float(r["lr"]), str(r["delay"]), int(r["seed"]))


def _parse_row(raw: dict) -> dict:
    row = dict(raw)
    row["lr"], row["seed"], row["delay"] = float(row["lr"]), int(row["seed"]), normalize_condition(row["delay"])
    row["steps"] = int(row["steps"])
    for k in ("seconds", *RUN_KEYS):
        v = row.get(k, "")
        row[k] = float(v) if v not in ("", None) else math.nan
    return row


def load_rows(path: Path) -> list[dict]:
    """The rows file's runs (empty when it does not exist)."""
    if not Path(path).is_file():
        return []
    with open(path, newline="") as fh:
        return [_parse_row(r) for r in csv.DictReader(fh)]


def append_row(path: Path, row: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.is_file() or path.stat().st_size == 0
    with open(path, "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(ROW_FIELDS), extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in row.items()})


def make_row(plan: Plan, task: str, algo: str, lr: float, delay, seed: int, d: Path, ws_sha256: str,
             seconds: float) -> dict:  # fmt: skip
    return {"task": task, "algo": algo, "lr": float(lr), "delay": delay, "seed": seed, "design_id": design_id(plan),
            "ws_sha256": ws_sha256, "steps": plan.steps, "seconds": seconds,
            **run_numbers(read_metric_rows(d), plan.steps, plan.last_evals)}  # fmt: skip


def lrs_to_try(plan: Plan, algo: str, chosen: dict | None = None) -> list[float]:
    if algo in plan.lrs:
        return [float(plan.lrs[algo])]
    rates = [float(x) for x in plan.lr_grid] or [float(plan.lr)]
    if chosen and algo in chosen[1]:
        rates.append(chosen[1][algo])
    return sorted(set(rates))


def collect(out: Path, plan: Plan, rows_path: Path | None = None, ws: dict | None = None) -> list[dict]:
    """Every finished run of the plan: the rows file's (same design id, and the warm start's hash
    when ``ws`` maps task -> hash) and, for runs without a row, finished run directories. Each
    per-run dict has task, algo, lr, delay, seed, dir (or None) and the :func:`run_numbers` keys."""
    did = design_id(plan)
    found: dict[tuple, dict] = {}
    for r in load_rows(rows_path) if rows_path else []:
        if r["design_id"] != did or (ws and r["task"] in ws and r["ws_sha256"] != ws[r["task"]]):
            continue
        if r["task"] in plan.tasks and r["algo"] in plan.algos and r["delay"] in plan.delays and r["seed"] in plan.seeds:
            found[row_key(r)] = {**r, "dir": None}
    for task in plan.tasks:
        for algo in plan.algos:
            for lr in lrs_to_try(plan, algo):
                for delay in plan.delays:
                    for seed in plan.seeds:
                        d = run_dir(out, plan, task, algo, lr, delay, seed)
                        key = (task, algo, float(lr), str(delay), seed)
                        if key in found:
                            found[key]["dir"] = d if d.is_dir() else None
                        elif (d / "DONE").is_file() and (d / METRICS_FILE).is_file():
                            found[key] = {"task": task, "algo": algo, "lr": float(lr), "delay": delay, "seed": seed,
                                          "dir": d, **run_numbers(read_metric_rows(d), plan.steps, plan.last_evals)}
    return list(found.values())


# --------------------------------------------------------------------------- learning rate and power


def choose_lrs(per_run: list[dict], plan: Plan, tol: float = 0.01) -> tuple[dict, dict]:
    """The learning-rate rule. Per (task, algo): among the grid's rates whose on-policy runs
    finished for every ``lr_seeds`` seed, the rate with the highest mean score (``lq_mean``); a
    smaller rate whose mean is within ``tol`` (absolute accuracy) of that best is preferred (the
    smallest such). Pinned rates (``plan.lrs``) are taken as they are.

    Returns (table rows, {algo: rate}) -- the rate of the first task when several are planned
    (the powered design has one)."""
    table, chosen = [], {}
    for task in plan.tasks:
        for algo in plan.algos:
            if algo in plan.lrs:
                chosen.setdefault(algo, float(plan.lrs[algo]))
                table.append({"task": task, "algo": algo, "lr": float(plan.lrs[algo]), "mean": math.nan, "sd": math.nan,
                              "n": 0, "chosen": True, "pinned": True})  # fmt: skip
                continue
            means = {}
            for lr in plan.lr_grid:
                scores = [r["lq_mean"] for r in per_run if r["task"] == task and r["algo"] == algo and r["delay"] == 0
                          and math.isclose(r["lr"], lr) and r["seed"] in plan.lr_seeds]  # fmt: skip
                m, sd = _mean_std(scores)
                means[float(lr)] = m
                table.append({"task": task, "algo": algo, "lr": float(lr), "mean": m, "sd": sd, "n": len(scores),
                              "chosen": False, "pinned": False})  # fmt: skip
                if len(scores) < len(plan.lr_seeds):
                    means[float(lr)] = math.nan  # incomplete: not eligible yet
            ok = {lr: m for lr, m in means.items() if math.isfinite(m)}
            if len(ok) < len(plan.lr_grid) or not ok:
                continue  # stage 1 unfinished for this algorithm
            best = max(ok.values())
            pick = min(lr for lr, m in ok.items() if m >= best - tol)
            chosen.setdefault(algo, pick)
            for row in table:
                if row["task"] == task and row["algo"] == algo and row["lr"] == pick:
                    row["chosen"] = True
    return table, chosen


def main_runs(per_run: list[dict], plan: Plan, chosen: dict) -> list[dict]:
    """The runs at each algorithm's chosen (or only) rate: what the stability and paired tables use."""
    if not multi_lr(plan):
        return list(per_run)
    return [r for r in per_run if r["algo"] in chosen and math.isclose(r["lr"], chosen[r["algo"]])]


def _lq_by(per_run: list[dict]) -> dict[tuple, float]:
    return {(r["task"], r["algo"], r["delay"], r["seed"]): r["lq_mean"] for r in per_run}


def realised_staleness(runs: list[dict]) -> tuple[float, float]:
    """Mean over runs of each run's mean staleness, and the largest staleness any run saw (NaN
    when none recorded one)."""
    finite_max = [r["staleness_max"] for r in runs if math.isfinite(r.get("staleness_max", math.nan))]
    return _mean_std([r.get("staleness", math.nan) for r in runs])[0], max(finite_max, default=math.nan)


def comparison_rows(per_run: list[dict], reference: str, alpha: float = 0.05) -> list[dict]:
    """Paired over seeds, per (task, condition != 0, baseline != reference): the difference of
    drops (reference's drop minus the baseline's; > 0: the reference loses more to staleness) and
    the difference of stale scores (reference minus baseline; > 0: the reference is better there),
    each with its :func:`verl_ext.analysis.stats.paired_test` and the MDE at the observed std of
    the differences; plus on-policy (condition 0) score differences."""
    from verl_ext.analysis.stats import mde, paired_test

    lq = _lq_by(per_run)
    stale = {}
    for r in per_run:
        stale.setdefault((r["task"], r["delay"]), []).append(r)
    rows = []
    tasks = sorted({r["task"] for r in per_run})
    algos = sorted({r["algo"] for r in per_run} - {reference})
    for task in tasks:
        conds = sorted({r["delay"] for r in per_run if r["task"] == task}, key=condition_key)
        for cond in conds:
            runs_here = stale.get((task, cond), [])
            st_mean, st_max = realised_staleness(runs_here)
            for b in algos:
                seeds = sorted({r["seed"] for r in per_run if r["task"] == task})
                drop_d, score_d, ref_drop, b_drop = [], [], [], []
                for s in seeds:
                    keys = [(task, a, c, s) for a in (reference, b) for c in (0, cond)]
                    if cond != 0 and all(k in lq for k in keys):
                        dr = lq[(task, reference, 0, s)] - lq[(task, reference, cond, s)]
                        db = lq[(task, b, 0, s)] - lq[(task, b, cond, s)]
                        ref_drop.append(dr)
                        b_drop.append(db)
                        drop_d.append(dr - db)
                    if (task, reference, cond, s) in lq and (task, b, cond, s) in lq:
                        score_d.append(lq[(task, reference, cond, s)] - lq[(task, b, cond, s)])
                if not score_d:
                    continue
                dt, st = paired_test(drop_d, alpha), paired_test(score_d, alpha)

                def _mde(t):
                    return mde(t.sd, t.n, alpha) if t.n >= 2 and math.isfinite(t.sd) and t.sd > 0 else math.nan

                rows.append({"task": task, "condition": cond, "staleness_mean": st_mean, "staleness_max": st_max,
                             "reference": reference, "baseline": b, "n_drop": dt.n,
                             "ref_drop": _mean_std(ref_drop)[0], "base_drop": _mean_std(b_drop)[0],
                             "drop_diff": dt.mean, "drop_lo": dt.ci_low, "drop_hi": dt.ci_high, "drop_p": dt.p,
                             "drop_mde": _mde(dt), "n_score": st.n, "score_diff": st.mean, "score_lo": st.ci_low,
                             "score_hi": st.ci_high, "score_p": st.p, "score_mde": _mde(st)})  # fmt: skip
    return rows


def drop_rows(per_run: list[dict], alpha: float = 0.05) -> list[dict]:
    """Per (task, algo, condition): score (mean over seeds), realised staleness, the paired drop
    from on-policy with its t interval and p-value, and the mechanism metrics' means."""
    from verl_ext.analysis.stats import paired_test

    drops = paired_drops(per_run)
    out = []
    for row in summarize(per_run):
        t = paired_test(drops.get((row["task"], row["algo"], row["delay"]), []), alpha)
        out.append({**row, "drop_test": t})
    return out


def design_mde(per_run: list[dict], n_seeds: int, alpha: float = 0.05, power: float = 0.8) -> dict:
    """The design's minimum detectable difference of drops: sigma = pooled within-cell std of a
    run's score over seeds (cells with >= 2 seeds), a difference of drops involves four runs, so
    its std is 2 sigma when they are independent (pairing by seed can only help when seeds share
    variance); MDE = :func:`verl_ext.analysis.stats.mde` (2 sigma, n_seeds)."""
    from verl_ext.analysis.stats import mde

    cells: dict[tuple, list[float]] = {}
    for r in per_run:
        if math.isfinite(r["lq_mean"]):
            cells.setdefault(_group_key(r), []).append(r["lq_mean"])
    num = den = 0.0
    for v in cells.values():
        if len(v) >= 2:
            m = sum(v) / len(v)
            num += sum((x - m) ** 2 for x in v)
            den += len(v) - 1
    sigma = math.sqrt(num / den) if den else math.nan
    value = mde(2 * sigma, n_seeds, alpha, power) if math.isfinite(sigma) and sigma > 0 and n_seeds >= 2 else math.nan
    return {"sigma": sigma, "df": den, "n_seeds": n_seeds, "mde_drop_diff": value, "alpha": alpha, "power": power}


def glance_markdown(per_run: list[dict], drops: list[dict], comparisons: dict[str, list[dict]]) -> str:
    """The study's numbers as methods x conditions matrices (what docs/results.md quotes): the
    realised staleness of each condition, each method's score (mean ± sd over seeds, n) and its
    drop from on-policy (mean [95% t interval], paired by seed), and for each reference method the
    paired difference of drops against every other method (> 0: the reference loses more).
    ``drops`` = :func:`drop_rows` (per_run), ``comparisons`` = reference -> :func:`comparison_rows`
    (per_run, reference): the same rows the long tables print, computed once by the caller."""
    conds = sorted({r["delay"] for r in per_run}, key=condition_key)
    algos = sorted({r["algo"] for r in per_run})
    head = "| | " + " | ".join(f"`{c}`" for c in conds) + " |"
    rule = "|---|" + "---|" * len(conds)
    stale = []
    for c in conds:
        mean, mx = realised_staleness([r for r in per_run if r["delay"] == c])
        stale.append(f"{_cell(mean, math.nan, 1)} / {_cell(mx, math.nan, 0)}")
    rows = {(r["algo"], r["delay"]): r for r in drops}
    score = [head, rule, "| realised staleness mean / max | " + " | ".join(stale) + " |"]
    drop = [head, rule]
    for a in algos:
        cells_s, cells_d = [], []
        for c in conds:
            r = rows.get((a, c))
            cells_s.append(f"{_cell(r['lq_mean_mean'], r['lq_mean_std'])} ({r['n']})" if r else "")
            t = r["drop_test"] if r else None
            cells_d.append(_ci(t.mean, t.ci_low, t.ci_high) if t and t.n else ("-" if c == 0 else ""))
        score.append(f"| {a} | " + " | ".join(cells_s) + " |")
        drop.append(f"| {a} | " + " | ".join(cells_d) + " |")
    out = ["Score (mean of the last evaluations; mean ± sd over seeds, number of seeds):", "", *score, "",
           "Drop from on-policy (on-policy score minus the condition's, paired by seed; mean [95% t interval]):", "",
           *drop]  # fmt: skip
    cells = [r for r in rows.values() if r["delay"] != 0 and r["drop_test"].n
             and math.isfinite(r["drop_test"].mean) and math.isfinite(r["kl_mean"])]  # fmt: skip
    if len(cells) >= 3:
        from scipy import stats

        rho = stats.spearmanr([r["kl_mean"] for r in cells], [r["drop_test"].mean for r in cells])
        out += ["", f"Across the {len(cells)} stale (method, condition) cells, the drop's Spearman correlation with "
                f"the cell's mean KL(sampler ‖ learner): rho = {rho.statistic:.2f} (p {_p(float(rho.pvalue))})."]  # fmt: skip
    for ref, ref_rows in comparisons.items():
        comp = {(c["baseline"], c["condition"]): c for c in ref_rows}
        stale_conds = [c for c in conds if c != 0]
        lines = ["| baseline | " + " | ".join(f"`{c}`" for c in stale_conds) + " |", "|---|" + "---|" * len(stale_conds)]
        for b in [a for a in algos if a != ref]:
            cells = []
            for c in stale_conds:
                x = comp.get((b, c))
                p = f", p {_p(x['drop_p'])}" if x and math.isfinite(x["drop_p"]) else ""
                cells.append(f"{_ci(x['drop_diff'], x['drop_lo'], x['drop_hi'])}{p}" if x and x["n_drop"] else "")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        out += ["", f"{ref}'s drop minus each baseline's (paired by seed; > 0: {ref} loses more to staleness):", "",
                *lines]  # fmt: skip
    return "\n".join(out)


def kl_variance_rows(per_run: list[dict]) -> list[dict]:
    """The paper's "the importance weights' variance tracks KL" (its Figure 5e: r = 0.96), per
    method: over its runs (every condition and seed, one point a run: the run's mean
    KL(sampler || learner) and mean variance of the loss's own weights -- token p/q for GRPO,
    sequence ratio for GSPO, p_i / E_q[q] for GEPO), Pearson r and Spearman rho with their
    two-sided p-values, and the mean variance on-policy and at the method's highest-KL condition."""
    from scipy import stats

    out = []
    for algo in sorted({r["algo"] for r in per_run}):
        runs = [r for r in per_run if r["algo"] == algo and math.isfinite(r.get("kl", math.nan))
                and math.isfinite(r.get("var", math.nan))]  # fmt: skip
        x, y = [r["kl"] for r in runs], [r["var"] for r in runs]
        row = {"algo": algo, "n": len(runs), "pearson_r": math.nan, "pearson_p": math.nan, "spearman_r": math.nan,
               "spearman_p": math.nan}  # fmt: skip
        if len(runs) >= 3 and len(set(x)) > 1 and len(set(y)) > 1:
            pr, sr = stats.pearsonr(x, y), stats.spearmanr(x, y)
            row.update(pearson_r=float(pr.statistic), pearson_p=float(pr.pvalue), spearman_r=float(sr.statistic),
                       spearman_p=float(sr.pvalue))  # fmt: skip
        by_cond: dict = {}
        for r in runs:
            by_cond.setdefault(r["delay"], []).append(r)
        on = by_cond.get(0, [])
        row["var_on_policy"] = _mean_std([r["var"] for r in on])[0] if on else math.nan
        stale = {c: v for c, v in by_cond.items() if c != 0}
        if stale:
            top = max(stale, key=lambda c: _mean_std([r["kl"] for r in stale[c]])[0])
            row.update(top_condition=top, kl_top=_mean_std([r["kl"] for r in stale[top]])[0],
                       var_top=_mean_std([r["var"] for r in stale[top]])[0])  # fmt: skip
        else:
            row.update(top_condition="-", kl_top=math.nan, var_top=math.nan)
        out.append(row)
    return out


def kl_variance_figure(folder: Path, per_run: list[dict]) -> Path:
    """IS-weight variance against KL(sampler || learner), one point a run, per method (log axes;
    on-policy runs, whose KL is ~0, sit at the left edge)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for algo in sorted({r["algo"] for r in per_run}):
        pts = [(max(r["kl"], 1e-6), max(r["var"], 1e-6)) for r in per_run if r["algo"] == algo
               and math.isfinite(r.get("kl", math.nan)) and math.isfinite(r.get("var", math.nan))]  # fmt: skip
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, label=algo)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("KL(sampler || learner), run mean (floored at 1e-6)")
    ax.set_ylabel("IS-weight variance, run mean (floored at 1e-6)")
    return _save_figure(fig, ax, folder / "kl_vs_weight_var.png")


def _ci(m: float, lo: float, hi: float) -> str:
    if not math.isfinite(m):
        return "-"
    return f"{m:+.3f}" if not math.isfinite(lo) else f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def _p(p: float) -> str:
    return "-" if not math.isfinite(p) else (f"{p:.3f}" if p >= 0.001 else f"{p:.1e}")


def study_markdown(task: str, plan: Plan, per_run: list[dict], lr_table: list[dict], chosen: dict,
                   ws: dict | None = None) -> str:  # fmt: skip
    """The section of docs/study.md for one task, from its runs."""
    from verl_ext.analysis.stats import binomial_eval_sd, mde

    mine = [r for r in main_runs(per_run, plan, chosen) if r["task"] == task]
    lines = [f"### Task `{task}` ({TASKS[task].answer_format} answers), design `{plan.design}` (id {design_id(plan)})", ""]
    if ws and task in ws:
        lines += [f"Warm start: pinned, {plan.warm_start_steps} supervised steps, seed 0; weights sha256 `{ws[task]}`.", ""]
    lines += [f"{plan.steps} learner steps, {plan.prompts} prompts x G=8, evaluation every {plan.test_freq} steps on "
              f"{plan.eval_size} held-out problems (one sample each, temperature 1); a run's score = mean of its last "
              f"{plan.last_evals or 'quarter of'} evaluations. Intervals: 95% t over seeds, paired by seed.", ""]  # fmt: skip
    present = {r["algo"] for r in mine}
    refs = [plan.reference] + [v for v in plan.variants if v in present and v != plan.reference]
    drops = drop_rows(mine)
    comparisons = {ref: [c for c in comparison_rows(mine, ref) if c["task"] == task] for ref in refs}
    lines += ["**At a glance**", "", *_block(task, "glance", glance_markdown(mine, drops, comparisons)), ""]
    grid = [r for r in lr_table if r["task"] == task]
    if grid:
        lines += ["**Learning rates** (stage 1, on-policy; rule: highest mean score, a smaller rate within 0.01 of it "
                  "preferred):", "", "| algo | lr | n | score (mean ± sd) | chosen |", "|---|---|---|---|---|"]
        for r in grid:
            lines.append(f"| {r['algo']} | {r['lr']:g} | {r['n']} | {_cell(r['mean'], r['sd'])} | "
                         f"{'**yes**' if r['chosen'] else ''}{' (pinned)' if r['pinned'] else ''} |")  # fmt: skip
        lines.append("")
    lines += ["**Drops from on-policy** (score on-policy minus score at the condition, paired by seed):", ""]
    table = ["| algo | lr | condition | realised staleness mean / max | n | score | drop [95% CI] | p | KL(q‖p) "
             "| IS-weight var | clip frac | clip frac A>0 / A<0 | mean weight | weight right / wrong "
             "| zero-grad share (stale) |", "|" + "---|" * 15]  # fmt: skip
    for r in sorted(drops, key=lambda r: (r["algo"], condition_key(r["delay"]))):
        t = r["drop_test"]
        table.append(
            f"| {r['algo']} | {r.get('lr', plan.lr):g} | {r['delay']} | {_cell(r['staleness_mean'], math.nan, 1)} / "
            f"{_cell(r['staleness_max_mean'], math.nan, 0)} | {r['n']} | {_cell(r['lq_mean_mean'], r['lq_mean_std'])} | "
            f"{_ci(t.mean, t.ci_low, t.ci_high)} | {_p(t.p)} | {_cell(r['kl_mean'], math.nan, sci=True)} | "
            f"{_cell(r['var_mean'], math.nan, sci=True)} | {_cell(r['clipfrac_mean'], math.nan)} | {_cell(r['clipfrac_pos_mean'], math.nan)} / "
            f"{_cell(r['clipfrac_neg_mean'], math.nan)} | {_cell(r['weight_mean_mean'], math.nan)} | "
            f"{_cell(r['weight_right_mean'], math.nan)} / {_cell(r['weight_wrong_mean'], math.nan)} | "
            f"{_cell(r['zero_grad_stale_mean'], math.nan)} |"
        )
    lines += _block(task, "drops", "\n".join(table))
    for reference, comp in comparisons.items():
        lines += ["", f"**Paired differences, {reference} minus each baseline** (drop diff > 0: {reference} "
                  "loses more to staleness; score diff > 0: it scores higher at that condition). MDE: the true "
                  "difference a 5% two-sided paired t test on these n seeds detects with 80% power at the observed sd.",
                  "", "| condition | staleness mean / max | baseline | n | drop diff [95% CI] | p | MDE | score diff [95% CI] "
                  "| p | MDE |", "|" + "---|" * 10]  # fmt: skip
        for c in comp:
            lines.append(
                f"| {c['condition']} | {_cell(c['staleness_mean'], math.nan, 1)} / {_cell(c['staleness_max'], math.nan, 0)} | "
                f"{c['baseline']} | {c['n_score']} | {_ci(c['drop_diff'], c['drop_lo'], c['drop_hi'])} | {_p(c['drop_p'])} | "
                f"{_cell(c['drop_mde'], math.nan)} | {_ci(c['score_diff'], c['score_lo'], c['score_hi'])} | "
                f"{_p(c['score_p'])} | {_cell(c['score_mde'], math.nan)} |"
            )
    lines += ["", "**Importance-weight variance against KL** (the paper's \"variance tracks KL\"; one point a run, "
              "every condition and seed; the variance is of each loss's own weights, so compare methods by r, not by "
              "level):", ""]  # fmt: skip
    table = ["| algo | runs | Pearson r (p) | Spearman rho (p) | var on-policy | stalest condition by KL | KL there "
             "| var there |", "|" + "---|" * 8]  # fmt: skip
    for r in kl_variance_rows(mine):
        table.append(f"| {r['algo']} | {r['n']} | {_cell(r['pearson_r'], math.nan, 2)} ({_p(r['pearson_p'])}) | "
                     f"{_cell(r['spearman_r'], math.nan, 2)} ({_p(r['spearman_p'])}) | "
                     f"{_cell(r['var_on_policy'], math.nan, sci=True)} | {r['top_condition']} | "
                     f"{_cell(r['kl_top'], math.nan, sci=True)} | {_cell(r['var_top'], math.nan, sci=True)} |")  # fmt: skip
    lines += _block(task, "klvar", "\n".join(table))
    dm = design_mde(mine, len(plan.seeds))
    acc = _mean_std([r["lq_mean"] for r in mine])[0]
    floor = binomial_eval_sd(min(max(acc, 0.0), 1.0), plan.eval_size, 1, max(plan.last_evals, 1)) if math.isfinite(acc) else math.nan
    floor_mde = mde(2 * floor, len(plan.seeds)) if math.isfinite(floor) and floor > 0 and len(plan.seeds) >= 2 else math.nan
    power = (f"**Power of the design.** Pooled seed-to-seed std of a run's score sigma = {_cell(dm['sigma'], math.nan)} "
             f"({dm['df']:.0f} df); a difference of drops combines four runs (std 2 sigma if independent), so with "
             f"{len(plan.seeds)} seeds the minimum detectable difference of drops (5% two-sided, 80% power) is "
             f"**{_cell(dm['mde_drop_diff'], math.nan)}**. The evaluation alone (binomial, {plan.eval_size} problems x "
             f"{max(plan.last_evals, 1)} evaluations at accuracy {_cell(acc, math.nan)}) gives sigma >= "
             f"{_cell(floor, math.nan)}, MDE >= {_cell(floor_mde, math.nan)}.")  # fmt: skip
    lines += ["", *_block(task, "power", power), ""]
    return "\n".join(lines)


_BLOCK = re.compile(r"<!-- study:(\w+):(\w+) -->\n(?:.*?\n)??<!-- /study -->", re.S)  # may be empty


def _block(task: str, name: str, text: str) -> list[str]:
    """A generated section, between markers that :func:`update_doc` finds (HTML comments: invisible
    when the markdown is rendered)."""
    return [f"<!-- study:{task}:{name} -->", text, "<!-- /study -->"]


def update_doc(doc: Path, generated: str) -> list[str]:
    """Replace every ``<!-- study:<task>:<name> -->`` block of ``doc`` with the same block of
    ``generated`` (a ``study_<task>.md``), so the numbers a page quotes are the study's own output;
    returns the names replaced. A block the study did not produce raises, naming it, and leaves the
    page untouched."""
    fresh = {(m.group(1), m.group(2)): m.group(0) for m in _BLOCK.finditer(generated)}
    text = doc.read_text()
    wanted = [(m.group(1), m.group(2)) for m in _BLOCK.finditer(text)]
    missing = [f"{t}:{n}" for t, n in wanted if (t, n) not in fresh]
    if missing:
        raise ValueError(f"{doc}: blocks {missing} are not in the study's output (have {sorted(fresh)})")
    doc.write_text(_BLOCK.sub(lambda m: fresh[(m.group(1), m.group(2))], text))
    return [f"{t}:{n}" for t, n in wanted]


def write_outputs(out: Path, plan: Plan, per_run: list[dict], figures: bool = True, log=print,
                  lr_table: list[dict] | None = None, chosen: dict | None = None, ws: dict | None = None) -> None:  # fmt: skip
    chosen = chosen if chosen is not None else {}
    main = main_runs(per_run, plan, chosen)
    rows = summarize(main)
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
        # one row per run, the seed-level numbers behind the summary (every rate tried)
        with open(out / f"runs_{task}.csv", "w", newline="") as fh:
            fields = ["task", "algo", *(["lr"] if multi_lr(plan) else []), "delay", "seed", *RUN_KEYS]
            w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
            w.writeheader()
            w.writerows(r for r in per_run if r["task"] == task)
        task_runs = [r for r in main if r["task"] == task]
        stable = stability_table(stability_rows(mine, task_runs))
        (out / f"stability_{task}.md").write_text(stable + "\n")
        log(f"\n## {task} answers ({TASKS[task].answer_format})\n{md}\n\nStability (sorted by drop):\n{stable}")
        if plan.design in ("powered", "dry"):
            section = study_markdown(task, plan, per_run, lr_table or [], chosen, ws)
            (out / f"study_{task}.md").write_text(section)
            log("\n" + section)
            if figures:
                staleness_figure(out / f"figures_{task}", task_runs)
                kl_variance_figure(out / f"figures_{task}", task_runs)
        elif figures:
            _figures(out, task, task_runs, log)


def _save_figure(fig, ax, path: Path) -> Path:
    """A legend when there is something to name, then write and close the figure."""
    import matplotlib.pyplot as plt

    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def staleness_figure(folder: Path, per_run: list[dict]) -> Path:
    """Score against realised mean staleness per method (one point per condition: mean over seeds,
    error bars the 95% t interval of the mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from verl_ext.analysis.stats import paired_test

    folder.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for algo in sorted({r["algo"] for r in per_run}):
        pts = []
        for cond in sorted({r["delay"] for r in per_run if r["algo"] == algo}, key=condition_key):
            runs = [r for r in per_run if r["algo"] == algo and r["delay"] == cond]
            t = paired_test([r["lq_mean"] for r in runs if math.isfinite(r["lq_mean"])])
            x = _mean_std([r.get("staleness", math.nan) for r in runs])[0]
            if t.n and math.isfinite(x):
                pts.append((x, t.mean, (t.ci_high - t.mean) if math.isfinite(t.ci_high) else 0.0))
        if pts:
            pts.sort()
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] for p in pts], marker="o", capsize=3,
                        label=algo)  # fmt: skip
    ax.set_xlabel("realised mean staleness (versions)")
    ax.set_ylabel("score (mean of the last evaluations)")
    return _save_figure(fig, ax, folder / "acc_vs_staleness.png")


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


def estimate_seconds(plan: Plan, done: list[dict]) -> tuple[float, str]:
    """Seconds per run: the median of this design's finished runs when there are some, else the
    measured defaults (:data:`SECONDS_PER_STEP_16`, :data:`SECONDS_PER_EVAL_PROBLEM`)."""
    secs = [r["seconds"] for r in done if math.isfinite(r.get("seconds", math.nan))]
    if secs:
        return statistics.median(secs), f"median of {len(secs)} finished runs"
    evals = plan.steps // plan.test_freq + 1 if plan.test_freq > 0 else 2
    per_step = SECONDS_PER_STEP_16 * plan.prompts / 16
    return plan.steps * per_step + evals * plan.eval_size * SECONDS_PER_EVAL_PROBLEM, (
        f"{per_step:.2f} s/step x {plan.steps} + {evals} evaluations x {plan.eval_size} problems x "
        f"{SECONDS_PER_EVAL_PROBLEM} s (measured defaults, one worker, load ~4)")


def _run_jobs(jobs: list[tuple], workers: int, out: Path, t0: float, on_done) -> None:
    if not jobs:
        return
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, maxtasksperchild=8) as pool:
        for i, (d, secs, err) in enumerate(pool.imap_unordered(run_one, [j[0] for j in jobs]), 1):
            rel = Path(d).relative_to(out) if Path(d).is_relative_to(out) else d
            print(f"[{i}/{len(jobs)}] {rel} {secs:.0f}s {'FAILED ' + err if err else ''} "
                  f"(elapsed {time.time() - t0:.0f}s)", flush=True)  # fmt: skip
            if not err:
                on_done(d, secs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/sweep")
    p.add_argument("--design", choices=list(DESIGNS), default="legacy",
                   help="legacy: the 252-run sweep; quick: a 5-minute smoke test; powered: the study (docs/study.md); "
                        "dry: the powered pipeline on tiny settings")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="= --design quick")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tasks", nargs="+", choices=list(TASKS))
    p.add_argument("--algos", nargs="+", choices=list(ALGOS))
    p.add_argument("--delays", nargs="+", type=normalize_condition, help="staleness conditions: 0 fix<k> uni<K> logn<K> or K")
    p.add_argument("--seeds", nargs="+", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--lrs", nargs="+", default=[], metavar="ALGO=LR", help="pin a rate per algorithm (skips stage 1 for it)")
    p.add_argument("--lr-grid", nargs="+", type=float)
    p.add_argument("--eval-size", type=int)
    p.add_argument("--diagnostics-every", type=int)
    p.add_argument("--rows", default=None, help="rows file (default OUT/rows.csv); commit it to make the study resumable")
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "heterorl"))
    p.add_argument("--override", nargs="*", default=[], help="extra hydra overrides for every run")
    p.add_argument("--plan-only", action="store_true", help="print the plan and its estimated duration, run nothing")
    p.add_argument("--table-only", action="store_true", help="no runs: tables and figures from finished runs")
    p.add_argument("--update-doc", type=Path, metavar="MD",
                   help="after tabulating, replace the page's <!-- study:<task>:<name> --> blocks (e.g. docs/results.md) "
                        "with the study's own")  # fmt: skip
    p.add_argument("--no-figures", action="store_true")
    a = p.parse_args(argv)
    if a.update_doc and not a.update_doc.is_file():
        p.error(f"--update-doc {a.update_doc}: no such file")
    base = dict(DESIGNS["quick" if a.quick else a.design])
    for key, val in (("tasks", a.tasks), ("algos", a.algos), ("delays", a.delays), ("seeds", a.seeds),
                     ("steps", a.steps), ("lr", a.lr), ("eval_size", a.eval_size), ("lr_grid", a.lr_grid),
                     ("diagnostics_every", a.diagnostics_every)):  # fmt: skip
        if val is not None:
            base[key] = val
    lrs = {}
    for item in a.lrs:
        algo, sep, rate = item.partition("=")
        if not sep or algo not in ALGOS:
            p.error(f"--lrs {item!r}: expected ALGO=LR with ALGO one of {', '.join(ALGOS)}")
        lrs[algo] = float(rate)
    plan = Plan(**base, extra=list(a.override), lrs=lrs)
    plan.delays = [normalize_condition(d) for d in plan.delays]
    if 0 not in plan.delays:
        p.error("--delays must include 0 (on-policy): every drop is measured from it")
    if plan.last_evals and plan.test_freq > 0 and plan.steps // plan.test_freq < plan.last_evals:
        p.error(f"a score averages the last {plan.last_evals} evaluations but {plan.steps} steps / test_freq "
                f"{plan.test_freq} gives only {plan.steps // plan.test_freq}")  # fmt: skip
    if a.workers < 1 or a.workers > 2:
        p.error("--workers must be 1 or 2 (a shared 2-core machine)")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows_path = Path(a.rows).resolve() if a.rows else out / "rows.csv"
    (out / "plan.json").write_text(json.dumps({**asdict(plan), "design_id": design_id(plan)}, indent=1))
    t0 = time.time()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the user's setting wins (verl_ext.torch_threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TQDM_DISABLE", "1")
    from verl_ext.data.toy import weights_sha256

    models = {t: warm_start_path(t, a.cache_dir, plan.warm_start_steps) for t in plan.tasks}
    ws = {t: weights_sha256(m) for t, m in models.items()}
    for t in plan.tasks:
        print(f"warm start {t}: {models[t]} (weights sha256 {ws[t][:16]}...)", flush=True)

    def finished() -> list[dict]:
        return collect(out, plan, rows_path, ws)

    def record(d: str, secs: float) -> None:
        d = Path(d)
        algo_dir, delay, seed = d.parents[1].name, normalize_condition(d.parent.name[1:]), int(d.name[1:])
        algo, _, rate = algo_dir.partition("@")
        lr = float(rate) if rate else plan.lr
        append_row(rows_path, make_row(plan, d.parents[2].name, algo, lr, delay, seed, d, ws[d.parents[2].name], secs))

    def jobs_for(cells: list[tuple], have: set) -> list[tuple]:
        jobs = []
        for task, algo, lr, delay, seed in cells:
            if (task, algo, float(lr), str(delay), seed) in have:
                continue
            d = run_dir(out, plan, task, algo, lr, delay, seed)
            if (d / "DONE").is_file():  # finished but not in the rows file: record it, do not re-run
                record(str(d), json.loads((d / "DONE").read_text()).get("seconds", math.nan))
                continue
            jobs.append(((run_overrides(plan, task, algo, delay, seed, models[task], d, lr, out), str(d)), d))
        return jobs

    def stage2_cells(chosen: dict) -> list[tuple]:
        # priority order, so an interrupted sweep is still a usable one: first every algorithm at
        # the on-policy and the stalest condition (seed by seed), then the conditions in between
        ends = {plan.delays[0], max(plan.delays, key=condition_key)} if plan.delays else set()
        tiers = [[d for d in plan.delays if d in ends], [d for d in plan.delays if d not in ends]]
        return [(task, algo, chosen.get(algo, plan.lr), delay, seed) for tier in tiers for seed in plan.seeds
                for task in plan.tasks for delay in tier for algo in plan.algos
                if not multi_lr(plan) or algo in chosen]  # fmt: skip

    stage1 = [(task, algo, lr, 0, seed) for task in plan.tasks for algo in plan.algos if algo not in plan.lrs
              for lr in plan.lr_grid for seed in plan.lr_seeds]  # fmt: skip
    done = finished()
    have = {row_key(r) for r in done if r["dir"] is None or (r["dir"] / "DONE").is_file()}
    n1 = sum(1 for c in stage1 if (c[0], c[1], float(c[2]), "0", c[4]) not in have)
    _, chosen0 = choose_lrs(done, plan)
    n2_total = len(plan.tasks) * len(plan.algos) * len(plan.delays) * len(plan.seeds)
    per_run_s, how = estimate_seconds(plan, [r for r in done if r.get("design_id") == design_id(plan)])
    # stage-2 runs that stage 1 already made: on-policy runs at the chosen rate for lr_seeds
    reused = len(plan.tasks) * len([x for x in plan.algos if x not in plan.lrs]) * len(set(plan.lr_seeds) & set(plan.seeds)) \
        if plan.lr_grid else 0  # fmt: skip
    n2 = max(0, n2_total - reused - sum(1 for r in done if r["delay"] in plan.delays and r["seed"] in plan.seeds
                                        and (not multi_lr(plan) or math.isclose(r["lr"], chosen0.get(r["algo"], -1)))))  # fmt: skip
    total = n1 + n2
    print(f"plan ({plan.design}, design id {design_id(plan)}): stage 1 (learning rates, on-policy) {n1} runs to do of "
          f"{len(stage1)}; stage 2 (conditions x seeds) about {n2} runs to do of {n2_total}; {len(done)} finished rows. "
          f"Estimate: {total} runs x {per_run_s:.0f} s ({how}) / {a.workers} workers = "
          f"{total * per_run_s / a.workers / 3600:.2f} h; outputs in {out}, rows in {rows_path}", flush=True)  # fmt: skip
    if a.plan_only:
        return 0
    if not a.table_only:
        jobs = jobs_for(stage1, have)
        print(f"stage 1: {len(jobs)} runs ({a.workers} workers)", flush=True)
        _run_jobs(jobs, a.workers, out, t0, record)
        done = finished()
        _, chosen = choose_lrs(done, plan)
        if plan.lr_grid:
            print(f"chosen learning rates: {chosen}", flush=True)
            missing = [x for x in plan.algos if x not in chosen]
            if missing:
                print(f"stage 1 unfinished for {missing}: their stage-2 runs wait for the next invocation", flush=True)
        have = {row_key(r) for r in done}
        jobs = jobs_for(stage2_cells(chosen), have)
        print(f"stage 2: {len(jobs)} runs ({a.workers} workers)", flush=True)
        _run_jobs(jobs, a.workers, out, t0, record)
    per_run = finished()
    lr_table, chosen = choose_lrs(per_run, plan)
    write_outputs(out, plan, per_run, figures=not a.no_figures, lr_table=lr_table, chosen=chosen, ws=ws)
    if a.update_doc:
        generated = "\n".join(p.read_text() for p in sorted(out.glob("study_*.md")))
        print(f"updated {a.update_doc}: {', '.join(update_doc(a.update_doc, generated))}", flush=True)
    print(f"\n{len(per_run)} finished runs tabulated; total {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
