"""The sweep's figures: score against realised staleness and IS-weight variance against KL (the
powered designs), and the run-curve and diagnostic figures of the other designs."""

from __future__ import annotations

import math
from pathlib import Path

from .analyse import mean_std
from .plan import condition_key


_MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def method_styles(algos: list[str]) -> dict[str, dict]:
    """One (colour, marker) per method, distinct for up to 20 methods, the same method keeping its
    style across the figures of one study (sorted names, tab20's 20 colours; matplotlib's default
    cycle repeats after 10, and the study compares 14)."""
    import matplotlib

    colours = matplotlib.colormaps["tab20"].colors
    return {
        algo: {"color": colours[(2 * i) % 20 + (2 * i) // 20 % 2], "marker": _MARKERS[i % len(_MARKERS)]}
        for i, algo in enumerate(sorted(set(algos)))
    }


def _method_figure(folder: Path, per_run: list[dict]):
    """(fig, ax, methods, styles) of a figure with one series per method of ``per_run``: wide
    enough for a legend beside the axes, ``folder`` created for it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    algos = sorted({r["algo"] for r in per_run})
    fig, ax = plt.subplots(figsize=(6 + (2.2 if len(algos) > 1 else 0), 4))
    return fig, ax, algos, method_styles(algos)


def _save_figure(fig, ax, path: Path) -> Path:
    """The legend beside the axes, when there is something to name (inside, it covers the points of
    a many-method study), then write and close the figure."""
    import matplotlib.pyplot as plt

    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def staleness_figure(folder: Path, per_run: list[dict]) -> Path:
    """Score against realised mean staleness per method (one point per condition: mean over seeds,
    error bars the 95% t interval of the mean). The methods' points of one condition are moved
    apart by up to +-1% of the axis (``dodge``), so that 14 error bars at one staleness can be told
    apart; the x value is otherwise the realised mean."""
    from verl_ext.analysis.stats import paired_test

    fig, ax, algos, styles = _method_figure(folder, per_run)
    xs = [r.get("staleness", math.nan) for r in per_run]
    span = max((x for x in xs if math.isfinite(x)), default=0.0)
    for i, algo in enumerate(algos):
        dodge = 0.02 * span * ((i + 0.5) / len(algos) - 0.5)
        pts = []
        for cond in sorted({r["delay"] for r in per_run if r["algo"] == algo}, key=condition_key):
            runs = [r for r in per_run if r["algo"] == algo and r["delay"] == cond]
            t = paired_test([r["lq_mean"] for r in runs if math.isfinite(r["lq_mean"])])
            x = mean_std([r.get("staleness", math.nan) for r in runs])[0]
            if t.n and math.isfinite(x):
                pts.append((x + dodge, t.mean, (t.ci_high - t.mean) if math.isfinite(t.ci_high) else 0.0))
        if pts:
            pts.sort()
            ax.errorbar(
                [p[0] for p in pts],
                [p[1] for p in pts],
                yerr=[p[2] for p in pts],
                capsize=2,
                markersize=4,
                linewidth=1,
                label=algo,
                **styles[algo],
            )
    ax.set_xlabel("realised mean staleness (versions)")
    ax.set_ylabel("score (mean of the last evaluations)")
    return _save_figure(fig, ax, folder / "acc_vs_staleness.png")


def run_figures(out: Path, task: str, per_run: list[dict], log) -> None:
    """``figures_<task>/``: the runs' curves (:func:`recipe.gepo.plot.make_figures`) and
    diagnostics (:func:`verl_ext.analysis.run_diagnostics.make_diag_figures`), and the Pearson r of
    the diagnostics pooled and per algorithm (``correlations_by_algo.csv``). Only runs whose
    directory is present: a run known from its row alone has no curves."""
    per_run = [r for r in per_run if r.get("dir") is not None]
    if not per_run:
        log(f"\nno run directories of {task} (rows only): no curves or diagnostic figures")
        return
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


def kl_variance_figure(folder: Path, per_run: list[dict]) -> Path:
    """IS-weight variance against KL(sampler || learner), one point a run, per method (log axes;
    on-policy runs, whose KL is ~0, sit at the left edge)."""
    fig, ax, algos, styles = _method_figure(folder, per_run)
    for algo in algos:
        pts = [
            (max(r["kl"], 1e-6), max(r["var"], 1e-6))
            for r in per_run
            if r["algo"] == algo and math.isfinite(r.get("kl", math.nan)) and math.isfinite(r.get("var", math.nan))
        ]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=14, label=algo, **styles[algo])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("KL(sampler || learner), run mean (floored at 1e-6)")
    ax.set_ylabel("IS-weight variance, run mean (floored at 1e-6)")
    return _save_figure(fig, ax, folder / "kl_vs_weight_var.png")
