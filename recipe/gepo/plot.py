"""Paper-style figures from one or several run directories.

    python -m recipe.gepo.plot RUN_DIR [RUN_DIR ...] --out DIR [--labels L1 L2 ...]
        [--smooth N] [--format png|pdf|svg]

Each RUN_DIR holds ``metrics.jsonl`` and ``config.yaml`` (see :mod:`recipe.gepo.report`); the
loss mode (``actor_rollout_ref.actor.policy_loss.loss_mode``) and the max delay
(``hetero.max_delay``) come from the config. Writes into ``--out``:

* ``curves.<fmt>`` -- eval accuracy and ``reward/mean`` against step, one line per run,
  labelled ``"<loss mode>, d=<max delay>"`` (or ``--labels``); with several algorithms also
  ``curves_<algorithm>.<fmt>``, one per algorithm.
* ``acc_vs_delay.<fmt>`` -- accuracy against max delay per algorithm: Best (max over a run's
  evaluations) and Last (its final evaluation); runs with the same (algorithm, delay) -- seeds
  -- are averaged, error bars = sample standard deviation, single seeds drawn as dots.
* ``scatter_var_kl.<fmt>`` -- ``is/weight_var`` against ``is/kl_sampler_learner``, one point
  per step; ``scatter_var_staleness.<fmt>`` / ``scatter_kl_staleness.<fmt>`` -- each of them
  against ``hetero/staleness_mean``. Legends give Pearson's r per run and pooled over all
  runs' steps (the paper: r = 0.96 between IS-weight variance and KL).
* ``summary.csv`` -- one row per run: :func:`recipe.gepo.report.summarize` numbers and the
  correlations.

A figure whose data no run has is skipped with a note; where each file went, the accuracy
table and the correlations are printed. Exit status 2 (with the offending RUN_DIR named) when
a RUN_DIR is missing or has no ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from .report import (
    STYLE,
    Run,
    RunDirError,
    eval_accuracy,
    load_run,
    metrics_path,
    save_figure,
    series,
    summarize_run,
)

KL = "is/kl_sampler_learner"
VAR = "is/weight_var"
STALENESS = "hetero/staleness_mean"
# (x, y) pairs whose Pearson correlation is reported
PAIRS: tuple[tuple[str, str], ...] = ((KL, VAR), (STALENESS, VAR), (STALENESS, KL))
SCATTER_NAMES = ("scatter_var_kl", "scatter_var_staleness", "scatter_kl_staleness")
POOLED = "all runs"


# --------------------------------------------------------------------------- data


def load_runs(run_dirs: Sequence[str], labels: Sequence[str] | None = None) -> tuple[list[Run], list[str]]:
    """Load every run directory and give each a legend label.

    Default labels are ``Run.label`` (``"<algorithm>, d=<delay>"``); labels shared by several
    runs (seeds) get the run directory's name appended. Raises :class:`RunDirError` naming the
    first bad directory, ValueError if ``labels`` does not have one entry per run."""
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"--labels has {len(labels)} entries for {len(run_dirs)} RUN_DIRs; give one per RUN_DIR")
    for d in run_dirs:
        metrics_path(d)  # validate all before the (slower) loading
    runs = [load_run(d) for d in run_dirs]
    if labels is not None:
        return runs, list(labels)
    base = [r.label for r in runs]
    return runs, [f"{b} [{r.run_dir.name}]" if base.count(b) > 1 else b for b, r in zip(base, runs)]


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation coefficient of paired samples; NaN with fewer than 2 pairs or when
    either variable is constant."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"pearson: x has shape {x.shape}, y has {y.shape}")
    if x.size < 2 or np.all(x == x[0]) or np.all(y == y[0]):
        return math.nan
    dx, dy = x - x.mean(), y - y.mean()
    den = math.sqrt(float((dx * dx).sum()) * float((dy * dy).sum()))
    if den == 0.0:
        return math.nan
    return float(np.clip((dx * dy).sum() / den, -1.0, 1.0))


def paired(df: pd.DataFrame, x: str, y: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-step values of metrics ``x`` and ``y`` at the steps where both are finite. Steps
    that consumed no group (``hetero/consumed == 0``) are left out of pairs involving
    ``hetero/staleness_mean`` (the buffer logs staleness 0 for them)."""
    if x not in df.columns or y not in df.columns:
        return np.empty(0), np.empty(0)
    xs = df[x].to_numpy(dtype=np.float64)
    ys = df[y].to_numpy(dtype=np.float64)
    keep = np.isfinite(xs) & np.isfinite(ys)
    if STALENESS in (x, y) and "hetero/consumed" in df.columns:
        keep &= df["hetero/consumed"].to_numpy(dtype=np.float64) != 0
    return xs[keep], ys[keep]


def correlations(runs: Sequence[Run], labels: Sequence[str], pairs: Sequence[tuple[str, str]] = PAIRS) -> pd.DataFrame:
    """Pearson r for each metric pair in ``pairs``, per run and pooled over all runs' steps.

    Columns: ``run`` (index into ``runs``; -1 for the pooled row), ``label`` (``"all runs"``
    for the pooled row), ``x``, ``y``, ``n`` (pairs), ``r`` (NaN when undefined)."""
    rows = []
    for x, y in pairs:
        all_x, all_y = [np.empty(0)], [np.empty(0)]
        for i, (run, label) in enumerate(zip(runs, labels)):
            xs, ys = paired(run.metrics, x, y)
            all_x.append(xs)
            all_y.append(ys)
            rows.append({"run": i, "label": label, "x": x, "y": y, "n": int(xs.size), "r": pearson(xs, ys)})
        px, py = np.concatenate(all_x), np.concatenate(all_y)
        rows.append({"run": -1, "label": POOLED, "x": x, "y": y, "n": int(px.size), "r": pearson(px, py)})
    return pd.DataFrame(rows, columns=["run", "label", "x", "y", "n", "r"])


def accuracy_vs_delay(runs: Sequence[Run]) -> pd.DataFrame:
    """Best and Last evaluation accuracy per (algorithm, max delay), averaged over runs.

    Best = max over a run's evaluations, Last = its final evaluation (accuracy as chosen by
    :func:`recipe.gepo.report.eval_accuracy`). Runs without evaluations or without a max
    delay in the config are left out. Columns: ``algorithm``, ``max_delay``, ``n`` (runs),
    ``best_mean``, ``best_std``, ``last_mean``, ``last_std`` (sample std, ddof=1; NaN for a
    single run), ``best_values``, ``last_values`` (per-run lists), ``runs`` (directory names);
    sorted by algorithm then delay."""
    per_run = []
    for run in runs:
        ev = eval_accuracy(run.metrics)
        if ev is None or run.max_delay is None:
            continue
        s = ev[1]
        per_run.append({"algorithm": run.algorithm, "max_delay": run.max_delay, "best": float(s.max()),
                        "last": float(s.iloc[-1]), "run": run.run_dir.name})
    cols = ["algorithm", "max_delay", "n", "best_mean", "best_std", "last_mean", "last_std",
            "best_values", "last_values", "runs"]
    if not per_run:
        return pd.DataFrame(columns=cols)
    rows = []
    for (algo, delay), g in pd.DataFrame(per_run).groupby(["algorithm", "max_delay"], sort=True):
        best, last = g["best"].to_numpy(), g["last"].to_numpy()
        rows.append({"algorithm": algo, "max_delay": int(delay), "n": len(g),
                     "best_mean": float(best.mean()), "best_std": float(best.std(ddof=1)) if len(g) > 1 else math.nan,
                     "last_mean": float(last.mean()), "last_std": float(last.std(ddof=1)) if len(g) > 1 else math.nan,
                     "best_values": best.tolist(), "last_values": last.tolist(), "runs": list(g["run"])})
    return pd.DataFrame(rows, columns=cols)


# --------------------------------------------------------------------------- figures


def _slug(text: str) -> str:
    """A file-name-safe version of an algorithm name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "run"


def _colors(n: int) -> list:
    """n distinguishable colours (tab10, tab20 beyond 10)."""
    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _smooth(s: pd.Series, window: int) -> pd.Series:
    return s if window <= 1 else s.rolling(window, min_periods=1).mean()


def _legend(ax, n_entries: int, handles=None, texts=None, title: str | None = None) -> None:
    """Legend inside the axes for a few entries, below it (in columns) for many, so it never
    hides the data of a many-run figure. Call after ``tight_layout`` (``save_figure``'s tight
    bounding box then grows the image to hold a legend below the axes)."""
    if not n_entries:
        return
    kw = dict(fontsize="small", framealpha=0.8, title=title)
    args = () if handles is None else (handles, texts)
    if n_entries <= 6:
        ax.legend(*args, loc="best", **kw)
    else:
        ax.legend(*args, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2 if n_entries <= 24 else 3, **kw)


def _skip_note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)


def plot_curves(runs: Sequence[Run], labels: Sequence[str], path: Path, title: str = "",
                smooth: int = 1) -> Path:
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
                (h,) = ax_e.plot(s.index.to_numpy(), s.to_numpy(), color=c, marker="o" if len(s) <= 30 else None,
                                 markersize=3, label=label)
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
        for ax, n, what in ((ax_e, n_eval, "no run logged eval/... accuracy"),
                            (ax_r, n_reward, "no run logged reward/mean")):
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
                fig.legend(list(legend.values()), list(legend), loc="upper center", bbox_to_anchor=(0.5, 0.0),
                           ncol=3 if len(legend) <= 30 else 4, fontsize="small", frameon=False)
        return save_figure(fig, path)


def plot_accuracy_vs_delay(table: pd.DataFrame, path: Path) -> Path:
    """Best (left) and Last (right) accuracy against max delay, one line per algorithm: mean
    over seeds with ±1 sample-std error bars, each seed's value as a faint dot."""
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(10, 4))
        axes = fig.subplots(1, 2, sharey=True)
        algos = list(dict.fromkeys(table["algorithm"]))
        colors = _colors(len(algos))
        for ax, which, name in ((axes[0], "best", "Best (max over evaluations)"),
                                (axes[1], "last", "Last (final evaluation)")):
            for algo, c in zip(algos, colors):
                g = table[table["algorithm"] == algo].sort_values("max_delay")
                d = g["max_delay"].to_numpy()
                std = np.nan_to_num(g[f"{which}_std"].to_numpy(dtype=np.float64), nan=0.0)
                ax.errorbar(d, g[f"{which}_mean"].to_numpy(), yerr=std, color=c, marker="o", markersize=4,
                            capsize=3, label=algo)
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


def _r_text(r: float) -> str:
    return "r=n/a" if math.isnan(r) else f"r={r:.3f}"


def plot_scatter(runs: Sequence[Run], labels: Sequence[str], corr: pd.DataFrame, x: str, y: str,
                 path: Path) -> Path | None:
    """Per-step points of ``y`` against ``x``, one colour per run, Pearson r per run and pooled
    (from ``corr``, see :func:`correlations`) in the legend. Returns None (nothing written)
    when no run logged both metrics."""
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(6, 4.5))
        ax = fig.subplots()
        colors = _colors(len(runs))
        sub = corr[(corr["x"] == x) & (corr["y"] == y)].set_index("run")
        drawn = 0
        for i, (run, label, c) in enumerate(zip(runs, labels, colors)):
            xs, ys = paired(run.metrics, x, y)
            if xs.size == 0:
                continue
            ax.scatter(xs, ys, s=8, alpha=0.6, color=c, edgecolors="none",
                       label=f"{label} ({_r_text(sub.loc[i, 'r'])}, n={xs.size})")
            drawn += 1
        if not drawn:
            return None
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        pooled = sub.loc[-1]
        ax.set_title(f"{y.split('/')[-1]} vs {x.split('/')[-1]}: pooled {_r_text(pooled['r'])}")
        fig.tight_layout()
        handles, texts = ax.get_legend_handles_labels()
        if drawn > 1:
            handles.append(Line2D([], [], linestyle="none"))
            texts.append(f"{POOLED}: {_r_text(pooled['r'])}, n={int(pooled['n'])}")
        _legend(ax, len(texts), handles, texts, title="Pearson r")
        return save_figure(fig, path)


# --------------------------------------------------------------------------- CLI


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def correlation_table(corr: pd.DataFrame) -> str:
    """Plain-text table of :func:`correlations`: one row per run (and the pooled row), one
    column per pair, ``r [n]`` in each cell."""
    heads = [f"r({y.split('/')[-1]}, {x.split('/')[-1]})" for x, y in PAIRS]
    names = list(dict.fromkeys(zip(corr["run"], corr["label"])))
    width = max([len(n) for _, n in names] + [8])
    col_w = [max(len(h), 16) for h in heads]
    lines = ["Pearson correlation over steps, r [pairs]:",
             "  " + " " * width + "  " + "  ".join(h.rjust(w) for h, w in zip(heads, col_w))]
    for run, label in names:
        cells = []
        for (x, y), w in zip(PAIRS, col_w):
            row = corr[(corr["run"] == run) & (corr["x"] == x) & (corr["y"] == y)].iloc[0]
            cells.append((f"{_fmt(row['r'])} [{int(row['n'])}]" if row["n"] else "-").rjust(w))
        lines.append("  " + label.ljust(width) + "  " + "  ".join(cells))
    return "\n".join(lines)


def make_figures(runs: Sequence[Run], labels: Sequence[str], out: Path, fmt: str = "png",
                 smooth: int = 1, log=print) -> dict[str, Path]:
    """Draw every figure and ``summary.csv`` into ``out``; return {name: path} of the files
    written (figures without data are skipped, with a note through ``log``)."""
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    written["curves"] = plot_curves(runs, labels, out / f"curves.{fmt}", smooth=smooth)
    algos = list(dict.fromkeys(r.algorithm for r in runs))
    if len(algos) > 1:
        for algo in algos:
            idx = [i for i, r in enumerate(runs) if r.algorithm == algo]
            written[f"curves_{algo}"] = plot_curves([runs[i] for i in idx], [labels[i] for i in idx],
                                                    out / f"curves_{_slug(algo)}.{fmt}", title=algo, smooth=smooth)

    table = accuracy_vs_delay(runs)
    left_out = [r.run_dir.name for r in runs
                if r.max_delay is None or eval_accuracy(r.metrics) is None]
    if left_out:
        log(f"note: accuracy vs delay leaves out runs without evaluations or hetero.max_delay: {', '.join(left_out)}")
    if len(table):
        written["acc_vs_delay"] = plot_accuracy_vs_delay(table, out / f"acc_vs_delay.{fmt}")
        log("accuracy vs max delay (mean over runs; ± sample std):")
        for row in table.itertuples():
            log(f"  {row.algorithm:<20} d={row.max_delay:<4} n={row.n}  best {_fmt(row.best_mean)} ± "
                f"{_fmt(row.best_std)}  last {_fmt(row.last_mean)} ± {_fmt(row.last_std)}")
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
    parser = argparse.ArgumentParser(prog="python -m recipe.gepo.plot", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    except (RunDirError, ValueError) as e:
        parser.error(str(e))
    written = make_figures(runs, labels, args.out, fmt=args.format, smooth=args.smooth)
    for name, path in written.items():
        print(f"wrote {name}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
