"""Paper-style figures from one or several run directories.

    python -m recipe.gepo.plot RUN_DIR [RUN_DIR ...] --out DIR [--labels L1 L2 ...] [--smooth N] [--format png|pdf|svg]

Each RUN_DIR holds ``metrics.jsonl`` and ``config.yaml`` (:mod:`verl_ext.rundir`); the loss mode
and ``hetero.max_delay`` come from the config. Writes into ``--out``: ``curves.<fmt>`` (eval
accuracy and ``reward/mean`` against step, a line per run labelled ``"<loss mode>, d=<max delay>"``
or ``--labels``; with several algorithms also ``curves_<algorithm>.<fmt>``), ``acc_vs_delay.<fmt>``
(Best and Last accuracy against max delay per algorithm, seeds averaged, error bars the sample std,
single seeds as dots; runs that differ in more than the seed are drawn apart, the keys named), ``scatter_var_kl.<fmt>``, ``scatter_var_staleness.<fmt>`` and
``scatter_kl_staleness.<fmt>`` (a point per step; Pearson's r per run and pooled in the legends),
``summary.csv`` (a row per run: :func:`recipe.gepo.run_report.summarize` and the correlations). A
figure whose data no run has is skipped with a note. Exit status 2, naming the RUN_DIR, when one is
missing or has no ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from typing import Any
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from verl_ext.analysis import run_figures
from verl_ext.analysis.run_figures import (  # noqa: F401 -- POOLED, pearson: part of this module's API
    POOLED,
    STALENESS,
    STYLE,
    correlation_table,
    pearson,
    plot_scatter,
    save_figure,
)
from verl_ext.analysis.run_figures import colors as _colors
from verl_ext.analysis.run_figures import format_number as _fmt
from verl_ext.analysis.run_figures import legend as _legend
from verl_ext.rundir import CONFIG_FILE, Run, RunDirError, config_leaves, load_runs

from .run_report import eval_accuracy, series, summarize_run

KL = "is/kl_sampler_learner"
VAR = "is/weight_var"
# (x, y) pairs whose Pearson correlation is reported
PAIRS: tuple[tuple[str, str], ...] = ((KL, VAR), (STALENESS, VAR), (STALENESS, KL))
SCATTER_NAMES = ("scatter_var_kl", "scatter_var_staleness", "scatter_kl_staleness")


# --------------------------------------------------------------------------- data


def correlations(runs: Sequence[Run], labels: Sequence[str], pairs: Sequence[tuple[str, str]] = PAIRS) -> pd.DataFrame:
    """:func:`verl_ext.analysis.run_figures.correlations`, by default over :data:`PAIRS`."""
    return run_figures.correlations(runs, labels, pairs)


SEED_AND_PLACE = ("seed", "data_loader_seed", "default_local_dir", "experiment_name", "project_name", "cache_dir")
"""Config keys (at any depth) runs may differ in and still be seeds of one setting: seeds, names and places."""


def _config_leaves(run: Run) -> dict[str, Any]:
    from omegaconf import OmegaConf

    path = run.run_dir / CONFIG_FILE
    if not path.is_file():
        return {}
    tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return {k: v for k, v in config_leaves(tree, skip=SEED_AND_PLACE)}


def setting_variants(runs: Sequence[Run]) -> tuple[list[str], dict[str, list[str]]]:
    """Per run, what sets it apart from the other runs of its algorithm beyond the seed and the max
    delay (``""`` when nothing): ``"[trainer.total_training_steps=100]"``; and per algorithm the
    keys that differ. Averaging such runs as seeds would mix settings, so they are drawn apart."""
    leaves = [_config_leaves(r) for r in runs]
    variants, differing = [""] * len(runs), {}
    for algo in dict.fromkeys(r.algorithm for r in runs):
        idx = [i for i, r in enumerate(runs) if r.algorithm == algo]
        keys = sorted(
            k
            for k in set().union(*(leaves[i] for i in idx))
            if not (k == "hetero.max_delay" or k.startswith("hetero.delay."))
            and len({repr(leaves[i].get(k)) for i in idx}) > 1
        )
        if keys:
            differing[algo] = keys
            for i in idx:
                variants[i] = "[" + ", ".join(f"{k}={leaves[i].get(k)}" for k in keys) + "]"
    return variants, differing


def accuracy_vs_delay(runs: Sequence[Run]) -> pd.DataFrame:
    """Best and Last evaluation accuracy per (algorithm, max delay), averaged over runs that differ
    only in their seed (others are drawn apart: :func:`setting_variants`).

    Best = max over a run's evaluations, Last = its final evaluation (accuracy as chosen by
    :func:`recipe.gepo.run_report.eval_accuracy`). Runs without evaluations or without a max
    delay in the config are left out. Columns: ``algorithm``, ``max_delay``, ``n`` (runs),
    ``best_mean``, ``best_std``, ``last_mean``, ``last_std`` (sample std, ddof=1; NaN for a
    single run), ``best_values``, ``last_values`` (per-run lists), ``runs`` (directory names);
    sorted by algorithm then delay."""
    per_run = []
    variants, _ = setting_variants(runs)
    for run, variant in zip(runs, variants):
        ev = eval_accuracy(run.metrics)
        if ev is None or run.max_delay is None:
            continue
        s = ev[1]
        per_run.append(
            {
                "algorithm": f"{run.algorithm} {variant}".strip(),
                "max_delay": run.max_delay,
                "best": float(s.max()),
                "last": float(s.iloc[-1]),
                "run": run.run_dir.name,
            }
        )
    cols = [
        "algorithm",
        "max_delay",
        "n",
        "best_mean",
        "best_std",
        "last_mean",
        "last_std",
        "best_values",
        "last_values",
        "runs",
    ]
    if not per_run:
        return pd.DataFrame(columns=cols)
    rows = []
    for (algo, delay), g in pd.DataFrame(per_run).groupby(["algorithm", "max_delay"], sort=True):
        best, last = g["best"].to_numpy(), g["last"].to_numpy()
        rows.append(
            {
                "algorithm": algo,
                "max_delay": int(delay),
                "n": len(g),
                "best_mean": float(best.mean()),
                "best_std": float(best.std(ddof=1)) if len(g) > 1 else math.nan,
                "last_mean": float(last.mean()),
                "last_std": float(last.std(ddof=1)) if len(g) > 1 else math.nan,
                "best_values": best.tolist(),
                "last_values": last.tolist(),
                "runs": list(g["run"]),
            }
        )
    return pd.DataFrame(rows, columns=cols)


# --------------------------------------------------------------------------- figures


def _slug(text: str) -> str:
    """A file-name-safe version of an algorithm name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "run"


def _smooth(s: pd.Series, window: int) -> pd.Series:
    return s if window <= 1 else s.rolling(window, min_periods=1).mean()


def _skip_note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)


def plot_curves(runs: Sequence[Run], labels: Sequence[str], path: Path, title: str = "", smooth: int = 1) -> Path:
    """Eval accuracy (left) and ``reward/mean`` (right, rolling mean over ``smooth`` steps)
    against step, one line per run, one legend for both panels."""
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(11, 4.2))
        ax_e, ax_r = fig.subplots(1, 2)
        colors = _colors(len(runs))
        n_eval = n_reward = 0
        legend: dict[str, Line2D] = {}
        for run, label, c in zip(runs, labels, colors):
            ev = eval_accuracy(run.metrics)
            if ev is not None:
                s = ev[1]
                (h,) = ax_e.plot(
                    s.index.to_numpy(),
                    s.to_numpy(),
                    color=c,
                    marker="o" if len(s) <= 30 else None,
                    markersize=3,
                    label=label,
                )
                legend.setdefault(label, h)
                n_eval += 1
            r = series(run.metrics, "reward/mean")
            if r is not None:
                r = _smooth(r, smooth)
                (h,) = ax_r.plot(r.index.to_numpy(), r.to_numpy(), color=c, label=label, linewidth=1.2)
                legend.setdefault(label, h)
                n_reward += 1
        ax_e.set_title("eval accuracy")
        ax_r.set_title("reward/mean" + (f" (rolling mean, {smooth} steps)" if smooth > 1 else ""))
        for ax, n, what in (
            (ax_e, n_eval, "no run logged eval/... accuracy"),
            (ax_r, n_reward, "no run logged reward/mean"),
        ):
            if n:
                ax.set_xlabel("step")
            else:
                _skip_note(ax, what)
        ax_e.set_ylabel("accuracy")
        ax_r.set_ylabel("reward")
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        if legend:
            if len(legend) <= 6:
                (ax_e if n_eval else ax_r).legend(list(legend.values()), list(legend), loc="best", fontsize="small")
            else:
                fig.legend(
                    list(legend.values()),
                    list(legend),
                    loc="upper center",
                    bbox_to_anchor=(0.5, 0.0),
                    ncol=3 if len(legend) <= 30 else 4,
                    fontsize="small",
                    frameon=False,
                )
        return save_figure(fig, path)


def plot_accuracy_vs_delay(table: pd.DataFrame, path: Path) -> Path:
    """Best (left) and Last (right) accuracy against max delay, one line per algorithm: mean
    over seeds with ±1 sample-std error bars, each seed's value as a faint dot."""
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(10, 4))
        axes = fig.subplots(1, 2, sharey=True)
        algos = list(dict.fromkeys(table["algorithm"]))
        colors = _colors(len(algos))
        for ax, which, name in (
            (axes[0], "best", "Best (max over evaluations)"),
            (axes[1], "last", "Last (final evaluation)"),
        ):
            for algo, c in zip(algos, colors):
                g = table[table["algorithm"] == algo].sort_values("max_delay")
                d = g["max_delay"].to_numpy()
                std = np.nan_to_num(g[f"{which}_std"].to_numpy(dtype=np.float64), nan=0.0)
                ax.errorbar(
                    d, g[f"{which}_mean"].to_numpy(), yerr=std, color=c, marker="o", markersize=4, capsize=3, label=algo
                )
                for delay, vals in zip(d, g[f"{which}_values"]):
                    if len(vals) > 1:
                        ax.scatter([delay] * len(vals), vals, color=c, alpha=0.35, s=10, zorder=1)
            ax.set_title(name)
            ax.set_xlabel("max delay (policy versions)")
            delays = sorted(set(table["max_delay"]))
            ax.set_xticks(delays)
        axes[0].set_ylabel("eval accuracy")
        n_max = int(table["n"].max())
        if n_max > 1:
            fig.suptitle(f"mean ± sample std over seeds (up to {n_max} per point)")
        fig.tight_layout()
        _legend(axes[0], len(algos))
        return save_figure(fig, path)


# --------------------------------------------------------------------------- CLI


def make_figures(
    runs: Sequence[Run], labels: Sequence[str], out: Path, fmt: str = "png", smooth: int = 1, log=print
) -> dict[str, Path]:
    """Draw every figure and ``summary.csv`` into ``out``; return {name: path} of the files
    written (figures without data are skipped, with a note through ``log``)."""
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    written["curves"] = plot_curves(runs, labels, out / f"curves.{fmt}", smooth=smooth)
    algos = list(dict.fromkeys(r.algorithm for r in runs))
    if len(algos) > 1:
        for algo in algos:
            idx = [i for i, r in enumerate(runs) if r.algorithm == algo]
            written[f"curves_{algo}"] = plot_curves(
                [runs[i] for i in idx],
                [labels[i] for i in idx],
                out / f"curves_{_slug(algo)}.{fmt}",
                title=algo,
                smooth=smooth,
            )

    table = accuracy_vs_delay(runs)
    for algo, keys in setting_variants(runs)[1].items():
        log(
            f"note: runs of {algo} differ in more than the seed ({', '.join(keys)}): accuracy vs delay draws them apart"
        )
    left_out = [r.run_dir.name for r in runs if r.max_delay is None or eval_accuracy(r.metrics) is None]
    if left_out:
        log(f"note: accuracy vs delay leaves out runs without evaluations or hetero.max_delay: {', '.join(left_out)}")
    if len(table):
        written["acc_vs_delay"] = plot_accuracy_vs_delay(table, out / f"acc_vs_delay.{fmt}")
        log("accuracy vs max delay (mean over runs; ± sample std):")
        for row in table.itertuples():
            log(
                f"  {row.algorithm:<20} d={row.max_delay:<4} n={row.n}  best {_fmt(row.best_mean)} ± "
                f"{_fmt(row.best_std)}  last {_fmt(row.last_mean)} ± {_fmt(row.last_std)}"
            )
    else:
        log("note: skipped acc_vs_delay: no run has both evaluations and hetero.max_delay")

    corr = correlations(runs, labels)
    for name, (x, y) in zip(SCATTER_NAMES, PAIRS):
        p = plot_scatter(runs, labels, corr, x, y, out / f"{name}.{fmt}")
        if p is None:
            log(f"note: skipped {name}: no run logged both {x} and {y}")
        else:
            written[name] = p
    log(correlation_table(corr))

    rows = []
    for run, label in zip(runs, labels):
        s = summarize_run(run)
        s.pop("staleness_hist")
        s["label"] = label
        for c in corr[corr["run"] == len(rows)].itertuples():
            s[f"r({c.y}, {c.x})"] = c.r
        rows.append(s)
    csv = out / "summary.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    written["summary"] = csv
    return written


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (argparse exits 2 on bad arguments)."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {__package__}.plot",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (metrics.jsonl, config.yaml)")
    parser.add_argument("--out", required=True, type=Path, help="folder for the figures (created)")
    parser.add_argument("--labels", nargs="+", default=None, help="one legend label per RUN_DIR")
    parser.add_argument("--smooth", type=int, default=1, help="rolling-mean window for reward curves (steps)")
    parser.add_argument("--format", default="png", choices=("png", "pdf", "svg"), help="figure file format")
    args = parser.parse_args(argv)
    if args.smooth < 1:
        parser.error(f"--smooth must be >= 1, got {args.smooth}")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {str(args.out)!r} exists and is not a directory")
    try:
        runs, labels = load_runs(args.run_dirs, args.labels)
    except (RunDirError, ValueError) as e:  # a run directory, not the usage: one line, no usage text
        print(f"error: {e}", file=sys.stderr)
        return 2
    written = make_figures(runs, labels, args.out, fmt=args.format, smooth=args.smooth)
    for name, path in written.items():
        print(f"wrote {name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
