"""Running a sweep: the pinned warm starts, one worker process per run slot (one torch thread,
``OMP_NUM_THREADS`` if set; each run composed by hydra from ``recipe/gepo/config`` and its overrides and
started through ``recipe.gepo.main_gepo.run_local``: its checks, then the replay engine), the two stages
(learning rates, then conditions x seeds) with a row appended as each run finishes, and the
time estimate."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import statistics
import time
from typing import Optional
from dataclasses import dataclass, field
from pathlib import Path

from .analyse import choose_lrs
from .plan import (
    TASKS,
    Plan,
    condition_key,
    design_id,
    multi_lr,
    normalize_condition,
    run_dir,
    run_overrides,
)
from .rows import append_row, cell_key, collect, make_row, row_key

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "recipe" / "gepo" / "config"

#: measured defaults for the budget before any run finished: seconds per learner step at 16
#: prompts x 8 on the long task and per evaluated problem, one worker, machine load ~4 (docs/study.md)
SECONDS_PER_STEP_16 = 1.16
SECONDS_PER_EVAL_PROBLEM = 0.007


def warm_start_path(task: str, cache_dir: str, steps: int) -> str:
    """The task's pinned warm start: ``steps`` supervised steps, seed 0 (built once, then cached)."""
    from verl_ext.data.toy.checkpoints import warm_start

    if steps <= 0:
        raise ValueError(f"warm start of {task!r}: needs steps > 0 (the pinned warm start), got {steps}")
    return str(warm_start(cache_dir, digits=3, steps=steps, seed=0, answer_format=TASKS[task].answer_format))


def warm_starts(plan: Plan, cache_dir: str, *, table_only: bool = False) -> tuple[dict[str, str], dict[str, str]]:
    """task -> warm start folder, task -> its weights' sha256, printed as they are ready. A plan
    without a pinned warm start (the legacy design, table-only) has none: ``({}, {})``, and its rows
    are then not filtered by warm start. A task the design pins (``plan.warm_start_sha256``) runs
    only from a warm start of that hash -- the package's shipped copy
    (``verl_ext.data.toy.checkpoints.PINNED_WARM_STARTS``) or this machine's build -- else not at all
    (``SystemExit`` naming both hashes); with ``table_only`` (tables or the plan, no run) a pinned
    task is not resolved at all: no folder, the pin."""
    from verl_ext.data.toy.checkpoints import weights_sha256

    if plan.warm_start_steps <= 0:
        print(
            f"warm start: none (design {plan.design} has no pinned warm start; rows are tabulated as they are)",
            flush=True,
        )
        return {}, {}
    pins = plan.warm_start_sha256
    models, ws = {}, {}
    for t in plan.tasks:
        if t in pins and table_only:
            print(f"warm start {t}: pinned, weights sha256 {pins[t][:16]}... (nothing built)", flush=True)
            ws[t] = pins[t]
            continue
        models[t] = warm_start_path(t, cache_dir, plan.warm_start_steps)
        ws[t] = weights_sha256(models[t])
        print(f"warm start {t}: {models[t]} (weights sha256 {ws[t][:16]}...)", flush=True)
        if t in pins and ws[t] != pins[t]:
            raise SystemExit(
                f"warm start of task {t!r}: --design {plan.design} pins the weights sha256 {pins[t]}, but "
                f"{models[t]} has {ws[t]} (not shipped with the package, so built here, and the same recipe gives "
                f"other weights on another CPU: docs/study.md 1, Machines). This design's cells cannot be run here; "
                f"--table-only tabulates its rows, --own-warm-start runs it as a new study from that warm start"
            )
    return models, ws


def run_one(job: tuple[list[str], str]) -> tuple[str, float, str]:
    """Worker: one run through the project's entry -- the config composed by hydra from
    ``recipe/gepo/config/gepo_trainer`` and the run's overrides, then
    :func:`recipe.gepo.main_gepo.run_local` (every check, then training) -- with one torch thread
    unless ``OMP_NUM_THREADS`` says otherwise. The final checkpoint is deleted (the sweep does not
    need it); ``DONE`` records the run's seconds and its warm start's weight hash. Returns (run
    dir, seconds, error or "")."""
    overrides, run_dir = job
    t0 = time.time()
    (Path(run_dir) / "FAILED").unlink(missing_ok=True)  # a retried run
    try:
        from verl_ext.torch_threads import set_torch_threads

        set_torch_threads(1)  # one thread unless the user set OMP_NUM_THREADS
        from hydra import compose, initialize_config_dir

        from recipe.gepo.main_gepo import run_local
        from verl_ext.data.toy.checkpoints import weights_sha256

        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = compose("gepo_trainer", overrides=overrides)
        run_local(cfg)
        out = Path(run_dir)
        for ckpt in out.glob("checkpoint*"):  # the final checkpoint: not needed by the sweep
            if ckpt.is_dir():
                import shutil

                shutil.rmtree(ckpt, ignore_errors=True)
            else:
                ckpt.unlink(missing_ok=True)
        # the run's own record of what it started from (rows carry it too)
        model_path = str(cfg.actor_rollout_ref.model.path or "")
        sha = weights_sha256(model_path) if model_path else ""
        (out / "DONE").write_text(json.dumps({"seconds": time.time() - t0, "ws_sha256": sha}))
        return run_dir, time.time() - t0, ""
    except Exception as exc:  # noqa: BLE001 - a failed run is reported, the sweep goes on
        import traceback

        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / "FAILED").write_text(traceback.format_exc())
        return run_dir, time.time() - t0, f"{type(exc).__name__}: {exc}"


def run_jobs(jobs: list[tuple], workers: int, out: Path, t0: float, on_done) -> None:
    """Run ``jobs`` ((overrides, run dir), dir) on ``workers`` spawned processes, printing each as
    it ends; ``on_done(run dir, seconds)`` for every run that finished without error."""
    if not jobs:
        return
    ctx = mp.get_context("spawn")
    started = time.time()
    with ctx.Pool(workers, maxtasksperchild=8) as pool:
        for i, (d, secs, err) in enumerate(pool.imap_unordered(run_one, [j[0] for j in jobs]), 1):
            rel = Path(d).relative_to(out) if Path(d).is_relative_to(out) else d
            now = time.time()
            print(progress_line(i, len(jobs), str(rel), secs, err, now - t0, now - started), flush=True)
            if not err:
                on_done(d, secs)


def progress_line(done: int, total: int, run: str, secs: float, err: str, elapsed_s: float, stage_s: float) -> str:
    """One line per finished run: its place, name and seconds, the sweep's elapsed time, and the
    time left at this stage's pace so far (``stage_s`` / ``done`` per run, workers included)."""
    left_s = (total - done) * stage_s / done
    return (
        f"[{done}/{total}] {run} {secs:.0f}s {'FAILED ' + err + ' ' if err else ''}"
        f"(elapsed {elapsed_s:.0f}s, ~{left_s / 3600:.1f} h left)"
    )


def _evaluations(plan: Plan) -> int:
    return plan.steps // plan.test_freq + 1 if plan.test_freq > 0 else 2


def estimate_seconds(
    plan: Plan, done: list[dict], reference: Optional[tuple[Plan, list[dict]]] = None
) -> tuple[float, str]:
    """Seconds per run: the median of this design's finished runs when there are some; else, with
    ``reference`` (another design of the same batch and evaluation, and its finished runs, e.g. the
    design a long design takes its rates from), its median run less its evaluations (at
    :data:`SECONDS_PER_EVAL_PROBLEM`) per step, times this design's steps; else the measured
    defaults (:data:`SECONDS_PER_STEP_16`, :data:`SECONDS_PER_EVAL_PROBLEM`)."""
    secs = [r["seconds"] for r in done if math.isfinite(r.get("seconds", math.nan))]
    if secs:
        return statistics.median(secs), (
            f"median of {len(secs)} finished runs; {min(secs):.0f}-{max(secs):.0f} s, "
            f"{sum(secs) / 3600:.1f} worker-hours in all"
        )
    evals = _evaluations(plan)
    eval_s = evals * plan.eval_size * SECONDS_PER_EVAL_PROBLEM
    if reference is not None:
        ref, runs = reference
        ref_secs = [r["seconds"] for r in runs if math.isfinite(r.get("seconds", math.nan))]
        if ref_secs and ref.prompts == plan.prompts and ref.steps > 0:
            ref_eval_s = _evaluations(ref) * ref.eval_size * SECONDS_PER_EVAL_PROBLEM
            per_step = max(statistics.median(ref_secs) - ref_eval_s, 0.0) / ref.steps
            return plan.steps * per_step + eval_s, (
                f"{per_step:.2f} s/step from the median of {len(ref_secs)} finished runs of --design {ref.design} "
                f"x {plan.steps} + {evals} evaluations x {plan.eval_size} problems x {SECONDS_PER_EVAL_PROBLEM} s"
            )
    per_step = SECONDS_PER_STEP_16 * plan.prompts / 16
    return plan.steps * per_step + eval_s, (
        f"{per_step:.2f} s/step x {plan.steps} + {evals} evaluations x {plan.eval_size} problems x "
        f"{SECONDS_PER_EVAL_PROBLEM} s (measured defaults, one worker, load ~4)"
    )


@dataclass
class Sweep:
    """A plan being run in ``out``: its finished runs, what is left to run, and the runs."""

    plan: Plan
    out: Path
    rows_path: Path
    models: dict[str, str]
    """task -> warm start folder"""
    ws: dict[str, str]
    """task -> the warm start's weights sha256 (rows with another hash are not this sweep's)"""
    workers: int
    t0: float = field(default_factory=time.time)
    reference: Optional[tuple[Plan, list[dict]]] = None
    """another design and its finished runs, for the estimate while this one has none
    (:func:`estimate_seconds`)"""

    def finished(self) -> list[dict]:
        """Every finished run of the plan (:func:`research.study.rows.collect`)."""
        return collect(self.out, self.plan, self.rows_path, self.ws)

    def stage1_cells(self) -> list[tuple]:
        """(task, algo, lr, condition, seed) of stage 1: on-policy at every rate of the grid."""
        plan = self.plan
        return [
            (task, algo, lr, 0, seed)
            for task in plan.tasks
            for algo in plan.algos
            if algo not in plan.lrs
            for lr in plan.lr_grid
            for seed in plan.lr_seeds
        ]

    def stage2_cells(self, chosen: dict) -> list[tuple]:
        """Stage 2 at the chosen rates, in priority order, so an interrupted sweep is still a usable
        one: first every algorithm at the on-policy and the stalest condition (seed by seed), then
        the conditions in between."""
        plan = self.plan
        ends = {plan.delays[0], max(plan.delays, key=condition_key)} if plan.delays else set()
        tiers = [[d for d in plan.delays if d in ends], [d for d in plan.delays if d not in ends]]
        return [
            (task, algo, chosen.get(algo, plan.lr), delay, seed)
            for tier in tiers
            for seed in plan.seeds
            for task in plan.tasks
            for delay in tier
            for algo in plan.algos
            if not multi_lr(plan) or algo in chosen
        ]

    def outline(self, done: list[dict]) -> str:
        """The plan in one line: runs to do per stage, finished rows and the estimated duration."""
        plan = self.plan
        stage1 = self.stage1_cells()
        have = _present(done)
        n1 = sum(1 for c in stage1 if (c[0], c[1], float(c[2]), "0", c[4]) not in have)
        _, chosen0 = choose_lrs(done, plan)
        n2_total = len(plan.tasks) * plan.main_runs_per_task()
        per_run_s, how = estimate_seconds(
            plan, [r for r in done if r.get("design_id") == design_id(plan)], self.reference
        )
        finished = {row_key(r) for r in done}
        n2 = sum(1 for c in self.stage2_cells(chosen0) if cell_key(*c) not in finished)
        # methods stage 1 has not chosen a rate for yet: all their cells, but the on-policy runs of
        # the lr seeds, which stage 1 makes at the rate it will choose
        unchosen = [x for x in plan.algos if multi_lr(plan) and x not in chosen0]
        reused = len(set(plan.lr_seeds) & set(plan.seeds)) if 0 in plan.delays else 0
        n2 += len(plan.tasks) * len(unchosen) * (len(plan.delays) * len(plan.seeds) - reused)
        total = n1 + n2
        return (
            f"plan ({plan.design}, design id {design_id(plan)}): stage 1 (learning rates, on-policy) {n1} runs to do "
            f"of {len(stage1)}; stage 2 (conditions x seeds) {n2} runs to do of {n2_total}; {len(done)} "
            f"finished rows. Estimate: {total} runs x {per_run_s:.0f} s ({how}) / {self.workers} workers = "
            f"{total * per_run_s / self.workers / 3600:.2f} h; outputs in {self.out}, rows in {self.rows_path}"
        )

    def seed_progress(self, done: list[dict]) -> str:
        """Stage 2's finished runs per seed (``stage 2 by seed: 0 28/28, 1 8/28, ...``), of the
        methods with a rate: a seed complete in every condition is one more pair in every paired
        comparison, so this says when an interim table gains a seed."""
        _, chosen = choose_lrs(done, self.plan)
        finished = {row_key(r) for r in done}
        cells = self.stage2_cells(chosen)
        parts = []
        for seed in self.plan.seeds:
            mine = [c for c in cells if c[4] == seed]
            parts.append(f"{seed} {sum(cell_key(*c) in finished for c in mine)}/{len(mine)}")
        return "stage 2 by seed: " + ", ".join(parts)

    def run(self, done: list[dict]) -> None:
        """Stage 1, the learning-rate choice, stage 2; runs with a row in ``done`` are skipped."""
        plan = self.plan
        for task in plan.tasks:  # before any run: a folder of another warm start under OUT stops the sweep now
            for finished in sorted((self.out / "runs" / task).glob("*/*/*/DONE")):
                self._done_record(finished.parent, task)
        jobs = self._jobs_for(self.stage1_cells(), _present(done))
        print(f"stage 1: {len(jobs)} runs ({self.workers} workers)", flush=True)
        run_jobs(jobs, self.workers, self.out, self.t0, self._record)
        done = self.finished()
        _, chosen = choose_lrs(done, plan)
        if plan.lr_grid:
            print(f"chosen learning rates: {chosen}", flush=True)
            missing = [x for x in plan.algos if x not in chosen]
            if missing:
                print(f"stage 1 unfinished for {missing}: their stage-2 runs wait for the next invocation", flush=True)
        jobs = self._jobs_for(self.stage2_cells(chosen), {row_key(r) for r in done})
        print(f"stage 2: {len(jobs)} runs ({self.workers} workers)", flush=True)
        run_jobs(jobs, self.workers, self.out, self.t0, self._record)

    def _record(self, d: str, secs: float) -> None:
        """A run finished: append its row."""
        d = Path(d)
        task, algo_dir = d.parents[2].name, d.parents[1].name
        delay, seed = normalize_condition(d.parent.name[1:]), int(d.name[1:])
        algo, _, rate = algo_dir.partition("@")
        lr = float(rate) if rate else self.plan.lr
        append_row(self.rows_path, make_row(self.plan, task, algo, lr, delay, seed, d, self.ws[task], secs))

    def _done_record(self, d: Path, task: str) -> dict:
        """A finished run folder's ``DONE``; one of another warm start than this sweep's stops the
        sweep, naming it (neither counted, nor recorded under this sweep's hash, nor run into)."""
        done = json.loads((d / "DONE").read_text())
        if done.get("ws_sha256") != self.ws[task]:
            raise SystemExit(
                f"{d} finished from the warm start {done.get('ws_sha256')!r}, not this sweep's "
                f"{self.ws[task]!r}: give the sweep another --out"
            )
        return done

    def _jobs_for(self, cells: list[tuple], have: set) -> list[tuple]:
        """The jobs of the cells not yet run; a run finished but without a row gets its row now."""
        jobs = []
        for task, algo, lr, delay, seed in cells:
            if cell_key(task, algo, lr, delay, seed) in have:
                continue
            d = run_dir(self.out, self.plan, task, algo, lr, delay, seed)
            if (d / "DONE").is_file():  # finished but not in the rows file: record it, do not re-run
                self._record(str(d), self._done_record(d, task).get("seconds", math.nan))
                continue
            overrides = run_overrides(self.plan, task, algo, delay, seed, self.models[task], d, lr)
            jobs.append(((overrides, str(d)), d))
        return jobs


def _present(done: list[dict]) -> set:
    """Keys of the finished runs that are still there: a row alone, or a run directory with DONE."""
    return {row_key(r) for r in done if r["dir"] is None or (r["dir"] / "DONE").is_file()}
