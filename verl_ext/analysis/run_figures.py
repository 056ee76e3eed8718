"""Correlations and scatter plots of metrics over the steps of several runs, and the figure style
every run figure shares (``recipe.gepo.run_report`` / ``recipe.gepo.plot`` and
:mod:`verl_ext.analysis.run_diagnostics` draw with these).

Runs are :class:`verl_ext.rundir.Run` (``run.metrics``: one pandas row per step).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from verl_ext.rundir import Run

STALENESS = "hetero/staleness_mean"
CONSUMED = "hetero/consumed"
POOLED = "all runs"

# figure style of every run figure (applied with matplotlib.rc_context)
STYLE = {
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.labelsize": 9,
    "legend.fontsize": 8,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
}


# --------------------------------------------------------------------------- numbers


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
    if STALENESS in (x, y) and CONSUMED in df.columns:
        keep &= df[CONSUMED].to_numpy(dtype=np.float64) != 0
    return xs[keep], ys[keep]


def correlations(runs: Sequence[Run], labels: Sequence[str], pairs: Sequence[tuple[str, str]]) -> pd.DataFrame:
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


def format_number(v) -> str:
    """A table cell: 4 decimals for floats, ``n/a`` for None/NaN."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def correlation_table(corr: pd.DataFrame) -> str:
    """Plain-text table of :func:`correlations`: one row per run (and the pooled row), one
    column per pair (in ``corr``'s order), ``r [n]`` in each cell."""
    pairs = list(dict.fromkeys(zip(corr["x"], corr["y"])))
    heads = [f"r({y.split('/')[-1]}, {x.split('/')[-1]})" for x, y in pairs]
    names = list(dict.fromkeys(zip(corr["run"], corr["label"])))
    width = max([len(n) for _, n in names] + [8])
    col_w = [max(len(h), 16) for h in heads]
    lines = [
        "Pearson correlation over steps, r [pairs]:",
        "  " + " " * width + "  " + "  ".join(h.rjust(w) for h, w in zip(heads, col_w)),
    ]
    for run, label in names:
        cells = []
        for (x, y), w in zip(pairs, col_w):
            row = corr[(corr["run"] == run) & (corr["x"] == x) & (corr["y"] == y)].iloc[0]
            cells.append((f"{format_number(row['r'])} [{int(row['n'])}]" if row["n"] else "-").rjust(w))
        lines.append("  " + label.ljust(width) + "  " + "  ".join(cells))
    return "\n".join(lines)


# --------------------------------------------------------------------------- drawing


def save_figure(fig: Figure, path: Path, dpi: int = 150) -> Path:
    """Write ``fig`` with the Agg canvas, atomically (temp file + rename)."""
    FigureCanvasAgg(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=dpi, bbox_inches="tight")
    os.replace(tmp, path)
    return path


def colors(n: int) -> list:
    """n distinguishable colours (tab10, tab20 beyond 10)."""
    cmap = matplotlib.colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def legend(ax, n_entries: int, handles=None, texts=None, title: str | None = None) -> None:
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


def _r_text(r: float) -> str:
    return "r=n/a" if math.isnan(r) else f"r={r:.3f}"


def plot_scatter(
    runs: Sequence[Run], labels: Sequence[str], corr: pd.DataFrame, x: str, y: str, path: Path
) -> Path | None:
    """Per-step points of ``y`` against ``x``, one colour per run, Pearson r per run and pooled
    (from ``corr``, see :func:`correlations`) in the legend. Returns None (nothing written)
    when no run logged both metrics."""
    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(6, 4.5))
        ax = fig.subplots()
        sub = corr[(corr["x"] == x) & (corr["y"] == y)].set_index("run")
        drawn = 0
        for i, (run, label, c) in enumerate(zip(runs, labels, colors(len(runs)))):
            xs, ys = paired(run.metrics, x, y)
            if xs.size == 0:
                continue
            ax.scatter(
                xs,
                ys,
                s=8,
                alpha=0.6,
                color=c,
                edgecolors="none",
                label=f"{label} ({_r_text(sub.loc[i, 'r'])}, n={xs.size})",
            )
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
        legend(ax, len(texts), handles, texts, title="Pearson r")
        return save_figure(fig, path)
