"""The rows file: one row per finished run (its numbers, realised staleness, warm-start hash and
design id), appended as runs finish; a run with a row is never run again, so committing the file
makes a study resumable on any machine that has its weights (``Plan.warm_start_sha256``). :func:`collect` gathers a plan's finished runs from it and from
run directories."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from .analyse import RUN_KEYS, run_numbers
from .plan import Plan, design_id, lrs_to_try, normalize_condition, run_dir
from verl_ext.rundir import METRICS_FILE, read_metric_rows

ROW_FIELDS = ("task", "algo", "lr", "delay", "seed", "design_id", "ws_sha256", "steps", "seconds", *RUN_KEYS)


def cell_key(task: str, algo: str, lr, delay, seed) -> tuple:
    """A (task, algo, lr, condition, seed) cell as the rows file keys it: the learning rate as a
    float and the condition as a string, so ``5e-05`` and ``"5e-05"`` are one cell."""
    return (task, algo, float(lr), str(delay), int(seed))


def row_key(r: dict) -> tuple:
    return cell_key(r["task"], r["algo"], r["lr"], r["delay"], r["seed"])


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


def make_row(
    plan: Plan, task: str, algo: str, lr: float, delay, seed: int, d: Path, ws_sha256: str, seconds: float
) -> dict:
    return {
        "task": task,
        "algo": algo,
        "lr": float(lr),
        "delay": delay,
        "seed": seed,
        "design_id": design_id(plan),
        "ws_sha256": ws_sha256,
        "steps": plan.steps,
        "seconds": seconds,
        **run_numbers(read_metric_rows(d), plan.steps, plan.last_evals),
    }


def collect(out: Path, plan: Plan, rows_path: Path | None = None, ws: dict | None = None) -> list[dict]:
    """Every finished run of the plan: the rows file's (same design id, and the warm start's hash:
    the plan's pinned one (``plan.warm_start_sha256``) or, for a task without a pin, ``ws``'s
    when it maps task -> hash) and, for runs without a row, finished run directories. Each
    per-run dict has task, algo, lr, delay, seed, dir (or None) and the :func:`run_numbers` keys."""
    did = design_id(plan)
    ws = rows_warm_start(plan, ws)
    found: dict[tuple, dict] = {}
    for r in load_rows(rows_path) if rows_path else []:
        if r["design_id"] != did or (ws and r["task"] in ws and r["ws_sha256"] != ws[r["task"]]):
            continue
        if (
            r["task"] in plan.tasks
            and r["algo"] in plan.algos
            and r["delay"] in plan.delays
            and r["seed"] in plan.seeds
        ):
            found[row_key(r)] = {**r, "dir": None}
    for task in plan.tasks:
        for algo in plan.algos:
            for lr in lrs_to_try(plan, algo):
                for delay in plan.delays:
                    for seed in plan.seeds:
                        d = run_dir(out, plan, task, algo, lr, delay, seed)
                        key = cell_key(task, algo, lr, delay, seed)
                        if key in found:  # the row's run folder, if this one is of the same weights
                            found[key]["dir"] = d if d.is_dir() and _same_weights(d, ws.get(task)) else None
                        elif (d / "DONE").is_file() and (d / METRICS_FILE).is_file() and _same_weights(d, ws.get(task)):
                            found[key] = {
                                "task": task,
                                "algo": algo,
                                "lr": float(lr),
                                "delay": delay,
                                "seed": seed,
                                "dir": d,
                                **run_numbers(read_metric_rows(d), plan.steps, plan.last_evals),
                            }
    return list(found.values())


def rows_warm_start(plan: Plan, ws: dict | None = None) -> dict:
    """task -> the weights sha256 a plan's runs must have been made from: the plan's pin
    (``plan.warm_start_sha256``) or, for a task without one, ``ws`` (this machine's build)."""
    return {**(ws or {}), **plan.warm_start_sha256}


def _same_weights(run: Path, sha: str | None) -> bool:
    """A finished run folder's ``DONE`` names the warm start it ran from: it counts only for the
    same weights (any, when ``sha`` is None)."""
    if not sha:
        return True
    try:
        return json.loads((run / "DONE").read_text()).get("ws_sha256") == sha
    except (OSError, ValueError):
        return False
