"""The study's command line: the delay sweep, algorithms x staleness conditions x seeds in replay
mode, with the same warm start, steps and evaluation for all (docs/study.md).

    .venv/bin/python -m research.study.delay_sweep --out OUT [--design powered (default)|powered_long|dry|quick|legacy]
        [--workers 2] [--tasks long] [--algos gepo gspo ...] [--delays 0 fix16 uni64 ...]
        [--seeds 0 1 2] [--steps N] [--lr LR] [--lrs gepo=1e-4 ...] [--rows PATH]
        [--plan-only] [--table-only [--join DESIGN ...] [--warm-start-sha256 HEX] [--replicate DESIGN=HEX ...]]
        [--own-warm-start]

The sweep itself is this package: the designs are :data:`~research.study.plan.DESIGNS`, the staleness
conditions :func:`~research.study.plan.normalize_condition`, a run's directory :func:`~research.study.plan.run_dir`,
each finished run one row of the rows file (``--rows``, default ``OUT/rows.csv``: a run whose row is there
never runs again), the outputs :func:`~research.study.render.write_outputs`. Designs with committed rows run
from the weights they pin (``--own-warm-start``: this machine's build, as a study of its own). What each
flag does and refuses: ``--help``; the designs, the learning-rate rule and the results: docs/study.md."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if not __package__:  # run as a file: its sibling modules are reachable only through the package
    raise SystemExit("run it from the repository root as: python -m research.study.delay_sweep ...")
from .analyse import choose_lrs, main_runs  # noqa: E402
from .plan import ALGOS, DESIGNS, TASKS, Plan, design_id, normalize_condition  # noqa: E402
from .render import joined_markdown, replicate_markdown, update_doc, write_outputs  # noqa: E402
from .rows import collect, rows_warm_start  # noqa: E402
from .run import Sweep, warm_starts  # noqa: E402


def lr_design_runs(plan: Plan, rows_path: Path, out: Path, ws: dict, own: bool) -> tuple[Plan, list[dict]]:
    """``plan.lr_design`` and its finished runs: its rows in the same rows file, of the weights it
    pins (or, with ``own``, of this machine's build ``ws``)."""
    source = _related(plan, plan.lr_design, own)
    return source, collect(out, source, rows_path, ws)


#: a weights hash as the rows file and --warm-start-sha256 / --replicate take it
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _related(plan: Plan, name: str, own: bool, **kw) -> Plan:
    """Design ``name`` with ``plan``'s methods and tasks: its rows are those of the weights it pins,
    or with ``own`` (``--own-warm-start``) those of this machine's build."""
    other = Plan(**dict(DESIGNS[name], algos=list(plan.algos), tasks=list(plan.tasks)), **kw)
    if own:
        other.warm_start_sha256 = {}
    return other


def _replicate(
    out: Path, plan: Plan, per_run: list[dict], chosen: dict, sha: str, rows_path: Path, ws: dict
) -> list[Path]:
    """``OUT/replicate_<task>.md``: ``plan``'s drops from its pinned weights (``per_run``) beside
    those of its rows and run folders from the weights ``sha``, each at the rates ``plan`` chose."""
    other = replace(plan, warm_start_sha256={t: sha for t in plan.tasks})
    theirs = collect(out, other, rows_path, ws)
    _, their_chosen = choose_lrs(theirs, other)
    ours, theirs = main_runs(per_run, plan, chosen), main_runs(theirs, other, their_chosen)
    print(f"--replicate {plan.design}: {len(theirs)} runs from the weights {sha[:16]}...", flush=True)
    paths = []
    for task in plan.tasks:
        text = replicate_markdown(task, plan, ours, theirs, rows_warm_start(plan, ws)[task], sha)
        paths.append(out / f"replicate_{task}.md")
        paths[-1].write_text(text + "\n")
        print("\n" + text, flush=True)
    return paths


def rates_from_design(plan: Plan, reference: tuple[Plan, list[dict]]) -> list[str]:
    """Pin ``plan.lrs`` to the rates ``plan.lr_design``'s stage 1 chose (``reference``:
    :func:`lr_design_runs`), keeping rates given with --lrs; returns the algorithms left without one."""
    source, runs = reference
    _, chosen = choose_lrs(runs, source)
    plan.lrs = {**{algo: rate for algo, rate in chosen.items() if algo in plan.algos}, **plan.lrs}
    return [algo for algo in plan.algos if algo not in plan.lrs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/sweep")
    p.add_argument(
        "--design",
        choices=list(DESIGNS),
        help="powered (the default): the study (docs/study.md); powered_long: its 600-step fix256 condition; "
        "dry: the powered pipeline on tiny settings; quick: a 5-minute smoke test; legacy: the 252-run sweep "
        "of docs/results_data/legacy_results.md (table-only: its rows can be tabulated, not run)",
    )
    p.add_argument("--quick", action="store_true", help="= --design quick (not with another --design)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tasks", nargs="+", choices=list(TASKS))
    p.add_argument("--algos", nargs="+", choices=list(ALGOS))
    p.add_argument(
        "--delays", nargs="+", type=normalize_condition, help="staleness conditions: 0 fix<k> uni<K> logn<K> or K"
    )
    p.add_argument("--seeds", nargs="+", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--lr", type=float, help="the one rate of a design without a learning-rate grid (legacy, quick)")
    p.add_argument(
        "--lrs", nargs="+", default=[], metavar="ALGO=LR", help="pin a rate per algorithm (skips stage 1 for it)"
    )
    p.add_argument(
        "--lr-grid", nargs="+", type=float, help="stage 1's rates, for a design with a stage 1 (powered, dry)"
    )
    p.add_argument("--eval-size", type=int)
    p.add_argument("--diagnostics-every", type=int)
    p.add_argument(
        "--rows", default=None, help="rows file (default OUT/rows.csv); commit it to make the study resumable"
    )
    p.add_argument("--cache-dir", default=str(REPO / ".cache" / "heterorl"))
    p.add_argument("--override", nargs="*", default=[], help="extra hydra overrides for every run")
    p.add_argument("--plan-only", action="store_true", help="print the plan and its estimated duration, run nothing")
    p.add_argument("--table-only", action="store_true", help="no runs: tables and figures from finished runs")
    p.add_argument(
        "--update-doc",
        type=Path,
        metavar="MD",
        help="after tabulating, replace the page's <!-- study:<task>:<name> --> blocks (e.g. docs/results.md) "
        "with the study's own",
    )
    p.add_argument(
        "--join",
        nargs="+",
        default=[],
        choices=[d for d in DESIGNS if d != "legacy"],
        metavar="DESIGN",
        help="with --table-only: also tabulate these designs' rows (same rows file and methods; their outputs "
        "in OUT/<design>/) and the questions over every stale condition of all of them "
        "(study_<task>_joined.md)",
    )
    p.add_argument(
        "--own-warm-start",
        action="store_true",
        help="run and tabulate from this machine's build of the warm start, not the weights the design "
        "pins (a new study: its rows carry this build's hash and never mix with the pinned rows)",
    )
    p.add_argument(
        "--warm-start-sha256",
        metavar="HEX",
        help="with --table-only: tabulate the design's rows of these weights (sha256, 64 hex digits) instead "
        "of the ones it pins, e.g. powered_long's first start (docs/study_data/README.md); --join designs keep "
        "their own",
    )
    p.add_argument(
        "--replicate",
        nargs="+",
        default=[],
        metavar="DESIGN=HEX",
        help="with --table-only: DESIGN's (--design or a --join design) drops from the weights HEX (sha256) "
        "beside those from its pin, and Spearman's rho of the methods' drops between the two "
        "(replicate_<task>.md), e.g. powered_long=<its first start>",
    )
    p.add_argument("--no-figures", action="store_true")
    a = p.parse_args(argv)
    # --design's default is None, not powered, so that --quick can tell an explicit --design apart
    if a.quick and a.design not in (None, "quick"):
        p.error(f"--quick is --design quick: not with --design {a.design} (give one of them)")
    a.design = "quick" if a.quick else a.design or "powered"
    if a.update_doc and a.plan_only:
        p.error(f"--update-doc {a.update_doc}: not with --plan-only (it tabulates nothing to write into the page)")
    replicate = {}
    for item in a.replicate:
        name, _, sha = item.partition("=")
        if name not in [a.design, *a.join] or not _SHA256.fullmatch(sha):
            p.error(
                f"--replicate {item!r}: expected DESIGN=HEX, DESIGN --design or a --join design "
                f"({', '.join([a.design, *a.join])}), HEX a sha256 (64 lowercase hex digits)"
            )
        replicate[name] = sha
    if replicate and not a.table_only:
        p.error("--replicate: only with --table-only (it tabulates rows, runs nothing)")
    if a.warm_start_sha256 is not None:
        if not _SHA256.fullmatch(a.warm_start_sha256):
            p.error(f"--warm-start-sha256 {a.warm_start_sha256!r}: expected a sha256, 64 lowercase hex digits")
        if not (a.table_only or a.plan_only) or a.own_warm_start:
            p.error(
                "--warm-start-sha256: only with --table-only or --plan-only, and not with --own-warm-start (a run "
                "starts from the weights the design pins or from this machine's build)"
            )
        if a.design in ("legacy", "quick"):
            p.error(f"--warm-start-sha256: --design {a.design} has no pinned warm start")
    if a.update_doc and not a.update_doc.is_file():
        p.error(f"--update-doc {a.update_doc}: no such file")
    if a.join and not a.table_only:
        p.error(f"--join {' '.join(a.join)}: only with --table-only (each design runs in its own invocation)")
    if a.design in a.join or len(set(a.join)) < len(a.join):
        p.error(f"--join {' '.join(a.join)}: each design once, and not --design {a.design} itself")
    base = dict(DESIGNS[a.design])
    # rates the design would never read: the grid replaces --lr, the reference design's choice
    # replaces both, and a grid without stage-1 seeds chooses no rate (so nothing would run)
    if base.get("lr_design"):
        for flag, val in (("--lr", a.lr), ("--lr-grid", a.lr_grid)):
            if val is not None:
                p.error(
                    f"{flag}: --design {a.design} takes every method's rate from --design {base['lr_design']}'s "
                    "stage 1 (pin rates with --lrs ALGO=LR)"
                )
    if a.lr_grid is not None and not base.get("lr_seeds"):
        p.error(
            f"--lr-grid: --design {a.design} has no stage 1 (no learning-rate seeds) to try a grid in "
            "(give its one rate with --lr, or use --design powered or dry)"
        )
    if a.lr is not None and (a.lr_grid or base.get("lr_grid")):
        p.error(
            f"--lr {a.lr:g}: --design {a.design} chooses each method's rate from its learning-rate grid "
            f"{a.lr_grid or base['lr_grid']} (set the grid with --lr-grid, or pin rates with --lrs ALGO=LR)"
        )
    for key, val in (
        ("tasks", a.tasks),
        ("algos", a.algos),
        ("delays", a.delays),
        ("seeds", a.seeds),
        ("steps", a.steps),
        ("lr", a.lr),
        ("eval_size", a.eval_size),
        ("lr_grid", a.lr_grid),
        ("diagnostics_every", a.diagnostics_every),
    ):
        if val is not None:
            base[key] = val
    lrs = {}
    for item in a.lrs:
        algo, sep, rate = item.partition("=")
        if not sep or algo not in ALGOS:
            p.error(f"--lrs {item!r}: expected ALGO=LR with ALGO one of {', '.join(ALGOS)}")
        lrs[algo] = float(rate)
    if a.lr is not None and lrs and set(base["algos"]) <= set(lrs):
        p.error(f"--lr {a.lr:g}: every method's rate is pinned with --lrs, so no run would use it")
    if a.own_warm_start:
        base["warm_start_sha256"] = {}
    if a.warm_start_sha256:
        base["warm_start_sha256"] = {t: a.warm_start_sha256 for t in base["tasks"]}
    plan = Plan(**base, extra=list(a.override), lrs=lrs)
    plan.delays = [normalize_condition(d) for d in plan.delays]
    if 0 not in plan.delays:
        p.error("--delays must include 0 (on-policy): every drop is measured from it")
    if plan.last_evals and plan.test_freq > 0 and plan.steps // plan.test_freq < plan.last_evals:
        p.error(
            f"a score averages the last {plan.last_evals} evaluations but {plan.steps} steps / test_freq "
            f"{plan.test_freq} gives only {plan.steps // plan.test_freq}"
        )
    if a.workers < 1 or a.workers > 2:
        p.error("--workers must be 1 or 2 (a shared 2-core machine)")
    if plan.warm_start_steps <= 0 and not a.table_only:
        p.exit(
            2,
            f"{p.prog}: error: --design {plan.design} is table-only (add --table-only to tabulate its rows): its "
            "accuracy-window warm start was machine-dependent and is gone; run --design powered, dry or quick\n",
        )
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows_path = Path(a.rows).resolve() if a.rows else out / "rows.csv"
    (out / "plan.json").write_text(json.dumps({**asdict(plan), "design_id": design_id(plan)}, indent=1))
    t0 = time.time()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the user's setting wins (verl_ext.torch_threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TQDM_DISABLE", "1")
    models, ws = warm_starts(plan, a.cache_dir, table_only=a.table_only or a.plan_only)
    # a design that takes its rates from another also takes its first estimate from that one's runs
    reference = lr_design_runs(plan, rows_path, out, ws, a.own_warm_start) if plan.lr_design else None
    if reference is not None:
        missing = rates_from_design(plan, reference)
        if missing and not a.table_only:
            p.exit(
                2,
                f"{p.prog}: error: --design {plan.design} takes its rates from --design {plan.lr_design}'s stage 1, "
                f"which has no chosen rate yet for {', '.join(missing)} in {rows_path} (counting its rows of the "
                f"weights {rows_warm_start(reference[0], ws)}): run that design first "
                "(or pin them with --lrs ALGO=LR)\n",
            )
        (out / "plan.json").write_text(json.dumps({**asdict(plan), "design_id": design_id(plan)}, indent=1))
    sweep = Sweep(plan, out, rows_path, models, ws, a.workers, t0, reference=reference)
    done = sweep.finished()
    print(sweep.outline(done), flush=True)
    print(sweep.seed_progress(done), flush=True)
    if a.plan_only:
        return 0
    if not a.table_only:
        sweep.run(done)
    per_run = sweep.finished()
    lr_table, chosen = choose_lrs(per_run, plan)
    write_outputs(
        out, plan, per_run, figures=not a.no_figures, lr_table=lr_table, chosen=chosen, ws=rows_warm_start(plan, ws)
    )
    written = [out / f"study_{task}.md" for task in plan.tasks]
    if plan.design in replicate:
        written += _replicate(out, plan, per_run, chosen, replicate[plan.design], rows_path, ws)
    if a.join:
        designs = [(plan, per_run, chosen)]
        for name in a.join:
            other = _related(plan, name, a.own_warm_start, extra=list(a.override))
            if other.lr_design:
                rates_from_design(other, lr_design_runs(other, rows_path, out, ws, a.own_warm_start))
            runs = collect(out / name, other, rows_path, ws)
            other_table, other_chosen = choose_lrs(runs, other)
            (out / name).mkdir(exist_ok=True)
            write_outputs(
                out / name,
                other,
                runs,
                figures=not a.no_figures,
                lr_table=other_table,
                chosen=other_chosen,
                ws=rows_warm_start(other, ws),
            )
            print(f"joined --design {name} (id {design_id(other)}): {len(runs)} finished runs", flush=True)
            designs.append((other, runs, other_chosen))
            written += [out / name / f"study_{task}.md" for task in plan.tasks]
            if name in replicate:
                written += _replicate(out / name, other, runs, other_chosen, replicate[name], rows_path, ws)
        for task in plan.tasks:
            (out / f"study_{task}_joined.md").write_text(joined_markdown(task, designs))
            written.append(out / f"study_{task}_joined.md")
            print("\n" + joined_markdown(task, designs), flush=True)
    if a.update_doc:
        generated = "\n".join(p.read_text() for p in written if p.is_file())
        print(f"updated {a.update_doc}: {', '.join(update_doc(a.update_doc, generated))}", flush=True)
    print(f"\n{len(per_run)} finished runs tabulated; total {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
