"""Per-run report: read a run directory's ``metrics.jsonl``, summarise it, draw ``curves.png``
and write ``report.md``.

    python -m recipe.gepo.run_report RUN_DIR [RUN_DIR ...]

It relies on nothing but ``metrics.jsonl`` and ``config.yaml`` (:mod:`verl_ext.rundir`), so it works
on a run in progress, on a killed run (torn last line) and on runs that logged only some metrics (a
panel or number whose metric is absent says so). Public API: :func:`summarize`, :func:`write_report`,
:func:`eval_accuracy`, :func:`staleness_histogram`, :func:`closing_summary`; reading the run directory (:func:`load_metrics`,
:func:`load_run`, :class:`RunDirError`) is :mod:`verl_ext.rundir`'s, re-exported here.
:mod:`recipe.gepo.plot` draws multi-run figures on top of these.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

# reading a run directory is verl_ext.rundir's; the names stay importable from here
from verl_ext.analysis.run_figures import STYLE, save_figure
from verl_ext.rundir import (  # noqa: F401 -- CONFIG_FILE, METRICS_FILE, read_run_config re-exported
    CONFIG_FILE,
    METRICS_FILE,
    Run,
    RunDirError,
    load_metrics,
    load_run,
    metrics_path,
    read_run_config,
    to_step,
    write_text_atomically,
)

REPORT_FILE = "report.md"
CONFIG_NOTES_FILE = "config_notes.txt"
"""Options of the run that had no effect and were reported, not refused (one a line; written at
start by the engines, listed in report.md's notes)."""
CURVES_FILE = "curves.png"

EVAL_MEAN = "eval/acc_mean"
_EVAL_BENCH = re.compile(r"^eval/(?P<bench>.+)/acc$")
HIST_PREFIX = "hetero/staleness_hist/"


# --------------------------------------------------------------------------- series helpers


def series(df: pd.DataFrame, name: str) -> pd.Series | None:
    """Finite values of metric ``name`` indexed by step, or None if the metric is absent or
    never finite."""
    if name not in df.columns:
        return None
    s = pd.Series(df[name].to_numpy(dtype="float64"), index=df["step"].to_numpy(), name=name)
    s = s[np.isfinite(s.to_numpy())]
    return s if len(s) else None


def eval_benchmarks(df: pd.DataFrame) -> list[str]:
    """Columns ``eval/<benchmark>/acc`` present with at least one finite value, sorted."""
    return sorted(c for c in df.columns if _EVAL_BENCH.match(c) and series(df, c) is not None)


def eval_accuracy(df: pd.DataFrame) -> tuple[str, pd.Series] | None:
    """The run's evaluation accuracy by step: ``eval/acc_mean`` if logged; else the single
    ``eval/<benchmark>/acc``; else the mean over benchmarks at the steps where all of them
    were evaluated. Returns ``(description, series)`` or None if there is no evaluation."""
    s = series(df, EVAL_MEAN)
    if s is not None:
        return EVAL_MEAN, s
    benches = eval_benchmarks(df)
    if len(benches) == 1:
        return benches[0], series(df, benches[0])
    if benches:
        block = df.set_index("step")[benches].replace([np.inf, -np.inf], np.nan).dropna()
        if len(block):
            return f"mean of {len(benches)} eval/*/acc", block.mean(axis=1)
    return None


def staleness_histogram(df: pd.DataFrame) -> pd.Series | None:
    """Consumed-group counts by staleness k summed over the run (index k ascending, from the
    ``hetero/staleness_hist/<k>`` columns; non-integer k ignored), or None if not logged."""
    counts: dict[int, float] = {}
    for c in df.columns:
        if not c.startswith(HIST_PREFIX):
            continue
        k = to_step(c[len(HIST_PREFIX) :])
        if k is None:
            continue
        v = df[c].to_numpy(dtype="float64")
        counts[k] = counts.get(k, 0.0) + float(np.nansum(np.where(np.isfinite(v), v, np.nan)))
    if not counts:
        return None
    return pd.Series(counts, name="groups").sort_index()


def _last(s: pd.Series | None) -> float:
    return math.nan if s is None else float(s.iloc[-1])


def _mean(s: pd.Series | None) -> float:
    return math.nan if s is None else float(s.mean())


# --------------------------------------------------------------------------- summary


def summarize_metrics(df: pd.DataFrame) -> dict[str, Any]:
    """The numbers of :func:`summarize` from an already loaded metrics frame."""
    steps = df["step"].to_numpy()
    out: dict[str, Any] = {
        "steps": int(len(steps)),
        "first_step": int(steps[0]) if len(steps) else None,
        "last_step": int(steps[-1]) if len(steps) else None,
        "skipped_lines": len(df.attrs.get("skipped_lines", [])),
    }

    ev = eval_accuracy(df)
    if ev is None:
        out.update(
            eval_metric=None,
            eval_count=0,
            eval_first=math.nan,
            eval_last=math.nan,
            eval_best=math.nan,
            eval_first_step=None,
            eval_last_step=None,
            eval_best_step=None,
        )
    else:
        name, s = ev
        out.update(
            eval_metric=name,
            eval_count=int(len(s)),
            eval_first=float(s.iloc[0]),
            eval_last=float(s.iloc[-1]),
            eval_best=float(s.max()),
            eval_first_step=int(s.index[0]),
            eval_last_step=int(s.index[-1]),
            eval_best_step=int(s.idxmax()),
        )

    # staleness: group-weighted from the histogram when logged (a step that consumed nothing
    # logs staleness_mean 0 and must not pull the mean down); else consumed-weighted or plain
    hist = staleness_histogram(df)
    st_mean = series(df, "hetero/staleness_mean")
    st_max = series(df, "hetero/staleness_max")
    if hist is not None and hist.sum() > 0:
        out["staleness_mean"] = float((hist.index.to_numpy() * hist.to_numpy()).sum() / hist.sum())
    elif st_mean is not None:
        consumed = series(df, "hetero/consumed")
        w = None if consumed is None else consumed.reindex(st_mean.index)
        if w is not None and w.notna().all() and w.sum() > 0:
            out["staleness_mean"] = float((st_mean * w).sum() / w.sum())
        else:
            out["staleness_mean"] = float(st_mean.mean())
    else:
        out["staleness_mean"] = math.nan
    maxima = []
    if st_max is not None:
        maxima.append(float(st_max.max()))
    if hist is not None and (hist > 0).any():
        maxima.append(float(hist.index[hist.to_numpy() > 0].max()))
    out["staleness_max"] = max(maxima) if maxima else math.nan
    out["staleness_hist"] = {} if hist is None else {int(k): float(v) for k, v in hist.items()}

    dropped = series(df, "hetero/dropped")
    if dropped is not None:
        out["dropped_total"] = float(dropped.sum())
    else:
        out["dropped_total"] = _last(series(df, "hetero/dropped_total"))

    out["kl_final"] = _last(series(df, "is/kl_sampler_learner"))
    out["weight_var_final"] = _last(series(df, "is/weight_var"))
    out["learner_idle_frac_mean"] = _mean(series(df, "perf/learner_idle_frac"))
    out["reward_first"] = (
        float(series(df, "reward/mean").iloc[0]) if series(df, "reward/mean") is not None else math.nan
    )
    out["reward_last"] = _last(series(df, "reward/mean"))
    out["step_s_mean"] = _mean(series(df, "perf/step_s"))
    return out


def summarize(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Summary numbers of one run (floats are NaN, step fields None, when not logged):

    * ``steps`` (distinct steps logged), ``first_step``, ``last_step``, ``skipped_lines``
    * ``eval_metric`` (which accuracy, see :func:`eval_accuracy`), ``eval_count``,
      ``eval_first``/``eval_last``/``eval_best`` and their ``*_step``
    * ``staleness_mean`` (group-weighted over the run, from the histogram if logged),
      ``staleness_max``, ``staleness_hist`` ({k: groups} summed over the run)
    * ``dropped_total`` (sum of ``hetero/dropped``)
    * ``kl_final`` (last ``is/kl_sampler_learner``), ``weight_var_final`` (last ``is/weight_var``)
    * ``learner_idle_frac_mean``, ``reward_first``, ``reward_last``, ``step_s_mean``
    * ``loss_mode``, ``max_delay``, ``algorithm``, ``label`` from ``config.yaml``
    """
    return summarize_run(load_run(run_dir))


def summarize_run(run: Run) -> dict[str, Any]:
    """:func:`summarize` of an already loaded :class:`Run`."""
    out = summarize_metrics(run.metrics)
    out.update(
        run_dir=str(run.run_dir),
        loss_mode=run.loss_mode,
        max_delay=run.max_delay,
        algorithm=run.algorithm,
        label=run.label,
    )
    return out


# --------------------------------------------------------------------------- drawing


def _note(ax, text: str) -> None:
    """Mark a panel whose metric is absent."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)
    for spine in ax.spines.values():
        spine.set_visible(False)


def _line(ax, s: pd.Series, **kw) -> None:
    """Plot a step series; a lone point (or sparse evaluations) gets markers."""
    marker = "o" if len(s) <= 30 else None
    ax.plot(s.index.to_numpy(), s.to_numpy(), marker=marker, markersize=3, **kw)


def _summary_text(s: dict[str, Any]) -> str:
    """A few summary numbers as monospace text for the spare panel of ``curves.png``."""
    rows = [
        ("steps", _fmt(s["steps"])),
        ("eval first", _fmt(s["eval_first"])),
        ("eval last", _fmt(s["eval_last"])),
        ("eval best", _fmt(s["eval_best"])),
        ("staleness mean", _fmt(s["staleness_mean"])),
        ("staleness max", _fmt(s["staleness_max"])),
        ("dropped total", _fmt(s["dropped_total"])),
        ("final KL", _fmt(s["kl_final"])),
        ("final IS var", _fmt(s["weight_var_final"])),
        ("learner idle", _fmt(s["learner_idle_frac_mean"])),
    ]
    return "\n".join(f"{k:<16}{v}" for k, v in rows)


def reward_band(df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, str] | None:
    """``reward/mean`` ± ``reward/std`` per step [S], kept inside the step's ``reward/min`` and
    ``reward/max`` where logged (a 0/1 reward's band is not -0.1 to 1.1); with its legend label.
    None without a mean and a std."""
    reward, std = series(df, "reward/mean"), series(df, "reward/std")
    if reward is None or std is None:
        return None
    std = std.reindex(reward.index)
    low, high = (reward - std).to_numpy(), (reward + std).to_numpy()
    lowest, highest = series(df, "reward/min"), series(df, "reward/max")
    if lowest is None or highest is None:
        return low, high, "± std"
    low = np.maximum(low, lowest.reindex(reward.index).fillna(-np.inf).to_numpy())
    high = np.minimum(high, highest.reindex(reward.index).fillna(np.inf).to_numpy())
    return low, high, "± std (within min/max)"


def accuracy_interval(p: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A 95% binomial (normal-approximation) interval around accuracies ``p`` [S] of ``n`` [S]
    problems each, clipped to [0, 1]."""
    half = 1.96 * np.sqrt(p * (1 - p) / n)
    return np.clip(p - half, 0, 1), np.clip(p + half, 0, 1)


def draw_curves(df: pd.DataFrame, path: Path, title: str = "", summary: dict[str, Any] | None = None) -> Path:
    """The run's ``curves.png``: reward, eval accuracy, KL(sampler||learner), IS-weight
    variance against step, and the staleness histogram summed over the run; ``summary`` (from
    :func:`summarize_metrics`) as text in the sixth panel. A panel whose metric is absent shows
    a note instead."""
    import matplotlib

    with matplotlib.rc_context(STYLE):
        fig = Figure(figsize=(12, 6.5))
        axes = fig.subplots(2, 3)
        ax_r, ax_e, ax_k, ax_v, ax_h, ax_text = axes.ravel()

        reward = series(df, "reward/mean")
        ax_r.set_title("reward/mean")
        if reward is None:
            _note(ax_r, "reward/mean not logged")
        else:
            _line(ax_r, reward, color="C0", label="mean")
            band = reward_band(df)
            if band is not None:
                low, high, label = band
                ax_r.fill_between(reward.index.to_numpy(), low, high, color="C0", alpha=0.15, label=label)
                ax_r.legend(loc="best")
            ax_r.set_xlabel("step")

        ax_e.set_title("eval accuracy")
        ev = eval_accuracy(df)
        if ev is None:
            _note(ax_e, "no eval/... accuracy logged")
        else:
            benches = eval_benchmarks(df)
            for i, b in enumerate(benches if len(benches) > 1 else []):
                _line(
                    ax_e,
                    series(df, b),
                    color=f"C{(i + 1) % 10}",
                    alpha=0.7,
                    linewidth=1,
                    label=_EVAL_BENCH.match(b)["bench"],
                )
            name, s = ev
            _line(ax_e, s, color="C0", linewidth=2, label=name)
            problems = series(df, "eval/n_problems")
            if problems is not None:  # how much of a change is noise
                n = problems.reindex(s.index).ffill().bfill().to_numpy()
                low, high = accuracy_interval(s.to_numpy(), n)
                ax_e.fill_between(
                    s.index.to_numpy(), low, high, color="C0", alpha=0.15, label=f"95% interval (n={int(n[-1])})"
                )
            ax_e.set_ylim(0, 1)  # accuracy on its whole scale: a 0.008 change is not a cliff
            ax_e.set_xlabel("step")
            ax_e.set_ylabel("accuracy")
            ax_e.legend(loc="best")

        for ax, name, ylabel in (
            (ax_k, "is/kl_sampler_learner", "KL(sampler || learner)"),
            (ax_v, "is/weight_var", "IS-weight variance"),
        ):
            ax.set_title(name)
            s = series(df, name)
            if s is None:
                _note(ax, f"{name} not logged")
            else:
                _line(ax, s, color="C3" if "kl" in name else "C2")
                ax.set_xlabel("step")
                ax.set_ylabel(ylabel)

        ax_h.set_title("staleness histogram (whole run)")
        hist = staleness_histogram(df)
        if hist is None or hist.sum() <= 0:
            _note(ax_h, "hetero/staleness_hist/<k> not logged" if hist is None else "no groups consumed")
        else:
            ax_h.bar(hist.index.to_numpy(), hist.to_numpy(), color="C4", width=0.8)
            ax_h.set_xticks(hist.index.to_numpy())
            ax_h.set_xlabel("staleness k (policy versions)")
            ax_h.set_ylabel("consumed groups")
            ax_h.grid(axis="x", visible=False)

        ax_text.axis("off")
        if summary is not None:
            ax_text.text(
                0.02,
                0.98,
                _summary_text(summary),
                ha="left",
                va="top",
                family="monospace",
                transform=ax_text.transAxes,
                fontsize=8,
            )
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        return save_figure(fig, path)


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def _at(v: Any, step: Any) -> str:
    return "n/a" if step is None else f"{_fmt(v)} (step {step})"


def write_config_notes(run_dir: str | os.PathLike, notes: list[str]) -> None:
    """Keep ``notes`` (:func:`recipe.gepo.options.check_dependencies`) in the run directory for
    report.md; none: no file (a fresh run removes an earlier run's)."""
    path = Path(run_dir) / CONFIG_NOTES_FILE
    if notes:
        path.write_text("".join(f"{n}\n" for n in notes), encoding="utf-8")
    elif path.exists():
        path.unlink()


def read_config_notes(run_dir: str | os.PathLike) -> list[str]:
    path = Path(run_dir) / CONFIG_NOTES_FILE
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line] if path.is_file() else []


def _commit() -> str:
    """The code's git commit (``-dirty`` with uncommitted changes), or ``n/a`` outside a checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "-uno"], capture_output=True, text=True
        )
    except OSError:
        return "n/a"
    if head.returncode != 0:
        return "n/a"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def settings_rows(run_dir: str | os.PathLike, df: pd.DataFrame) -> list[tuple[str, str]]:
    """What a reader needs to cite the run, from its ``config.yaml`` and metrics: engine and mode,
    samplers, delay model, algorithm, learning rate, seed, steps, training wall time (the sum of the
    steps' times), evaluation size and temperature, the code's commit. Empty without a config."""
    from omegaconf import OmegaConf

    from .sections import DelayConfig

    path = Path(run_dir) / CONFIG_FILE
    try:
        node = OmegaConf.load(path)
    except Exception:  # noqa: BLE001 -- no config, no settings (read_run_config already warned)
        return []

    def get(dotted: str, default: Any = None) -> Any:
        try:
            return OmegaConf.select(node, dotted, default=default)
        except Exception:  # noqa: BLE001 -- an interpolation that no longer resolves
            return default

    engine, mode = get("hetero.engine", "embedded"), get("hetero.mode", "async")
    if engine == "verl":
        mode_text = "verl engine, async" + (
            " (remote pools through an exchange)" if get("hetero.transport") == "fs" else ""
        )
        samplers = f"{get('actor_rollout_ref.rollout.name')} rollout replicas"
        eval_t = get("actor_rollout_ref.rollout.val_kwargs.temperature")
    else:
        mode_text = f"embedded engine, {mode}"
        samplers = "1 (replay: one process)" if mode == "replay" else str(get("hetero.num_samplers"))
        eval_t = get("task.eval_temperature")
    try:
        delay = DelayConfig(**(get("hetero.delay") or {})).describe(
            "seconds" if engine == "verl" or mode == "async" else "steps", int(get("hetero.seed", 0) or 0)
        )
    except Exception as err:  # noqa: BLE001 -- a hand-edited config: say so, write the rest
        delay = f"n/a ({type(err).__name__}: {err})"
    step_time = series(df, "perf/wall_s")
    step_time = step_time if step_time is not None else series(df, "timing_s/step")
    return [
        ("engine / mode", mode_text),
        ("samplers", samplers),
        ("delay model", delay),
        ("staleness bound (hetero.max_delay)", str(get("hetero.max_delay"))),
        ("learning rate", str(get("actor_rollout_ref.actor.optim.lr"))),
        ("seed (hetero.seed)", str(get("hetero.seed"))),
        ("training steps", str(get("trainer.total_training_steps"))),
        ("training wall time (s, sum of step times)", _fmt(float(step_time.sum())) if step_time is not None else "n/a"),
        ("evaluation", f"{get('task.eval_size')} problems at temperature {eval_t}"),
        ("code commit", _commit()),
    ]


def render_markdown(
    summary: dict[str, Any],
    df: pd.DataFrame,
    curves_name: str = CURVES_FILE,
    config_notes: list[str] = (),
    settings: list[tuple[str, str]] = (),
) -> str:
    """``report.md`` text for ``summary`` (from :func:`summarize`) and its metrics frame;
    ``config_notes``: options without effect that the run kept (:data:`CONFIG_NOTES_FILE`)."""
    s = summary
    name = Path(s["run_dir"]).name
    step_range = "" if s["first_step"] is None else f" (step {s['first_step']} to {s['last_step']})"
    rows = [
        ("algorithm", f"{s['algorithm']} (loss mode `{s['loss_mode'] or 'n/a'}`)"),
        ("max delay", _fmt(s["max_delay"])),
        ("steps logged", f"{s['steps']}{step_range}"),
        (
            "eval accuracy metric",
            f"`{s['eval_metric']}` ({s['eval_count']} evaluations)" if s["eval_metric"] else "n/a",
        ),
        ("eval accuracy: first", _at(s["eval_first"], s["eval_first_step"])),
        ("eval accuracy: last", _at(s["eval_last"], s["eval_last_step"])),
        ("eval accuracy: best", _at(s["eval_best"], s["eval_best_step"])),
        ("reward/mean: first / last", f"{_fmt(s['reward_first'])} / {_fmt(s['reward_last'])}"),
        ("staleness mean (group-weighted) / max", f"{_fmt(s['staleness_mean'])} / {_fmt(s['staleness_max'])}"),
        ("dropped groups (total)", _fmt(s["dropped_total"])),
        ("final KL(sampler ‖ learner)", _fmt(s["kl_final"])),
        ("final IS-weight variance", _fmt(s["weight_var_final"])),
        ("learner idle fraction (mean)", _fmt(s["learner_idle_frac_mean"])),
        ("step time mean (s)", _fmt(s["step_s_mean"])),
    ]
    lines = [f"# Run report: {name}", "", f"Run directory: `{s['run_dir']}`", ""]
    if settings:
        lines += ["## Settings", "", "| setting | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in settings]
        lines += ["", "## Results", ""]
    lines += ["| quantity | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    benches = eval_benchmarks(df)
    if benches:
        lines += [
            "",
            "## Evaluation by benchmark",
            "",
            "| benchmark | evaluations | first | last | best |",
            "|---|---|---|---|---|",
        ]
        for b in benches:
            e = series(df, b)
            lines.append(
                f"| {_EVAL_BENCH.match(b)['bench']} | {len(e)} | {_fmt(float(e.iloc[0]))} | "
                f"{_fmt(float(e.iloc[-1]))} | {_fmt(float(e.max()))} (step {int(e.idxmax())}) |"
            )
    if s["staleness_hist"]:
        ks = sorted(s["staleness_hist"])
        lines += [
            "",
            "## Staleness histogram (consumed groups, whole run)",
            "",
            "| k | " + " | ".join(str(k) for k in ks) + " |",
            "|---|" + "---|" * len(ks),
            "| groups | " + " | ".join(_fmt(s["staleness_hist"][k]) for k in ks) + " |",
        ]
    wanted = [
        "reward/mean",
        "is/kl_sampler_learner",
        "is/weight_var",
        "hetero/staleness_mean",
        "hetero/dropped",
        "perf/learner_idle_frac",
    ]
    missing = [m for m in wanted if series(df, m) is None]
    if s["eval_metric"] is None:
        missing.append("eval/... accuracy")
    if staleness_histogram(df) is None:
        missing.append("hetero/staleness_hist/<k>")
    notes = [f"No effect: `{n}`." for n in config_notes]
    if missing:
        notes.append("Not logged (shown as n/a): " + ", ".join(f"`{m}`" for m in missing) + ".")
    inf = {c: int(np.isinf(df[c].to_numpy(dtype="float64")).sum()) for c in df.columns if c != "step"}
    inf = {c: n for c, n in inf.items() if n}
    if inf:
        notes.append(
            "Infinite values, left out of the curves and numbers above: "
            + ", ".join(f"`{c}` ({n} step{'s' if n > 1 else ''})" for c, n in sorted(inf.items()))
            + "."
        )
    if s["skipped_lines"]:
        notes.append(
            f"{s['skipped_lines']} unreadable line(s) of metrics.jsonl skipped "
            f"(line numbers: {', '.join(map(str, df.attrs.get('skipped_lines', [])[:10]))})."
        )
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    lines += ["", "## Curves", "", f"![training curves]({curves_name})", ""]
    return "\n".join(lines)


def write_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> tuple[Path, Path]:
    """Write ``report.md`` and ``curves.png`` for ``run_dir`` (into ``out_dir``, default the run
    directory itself) and return their paths ``(report_md, curves_png)``. Raises
    :class:`RunDirError` naming ``run_dir`` if it has no ``metrics.jsonl``."""
    run = load_run(run_dir)
    summary = summarize_run(run)
    out = Path(out_dir) if out_dir is not None else metrics_path(run_dir).parent
    out.mkdir(parents=True, exist_ok=True)
    curves = draw_curves(run.metrics, out / CURVES_FILE, title=f"{run.run_dir.name}: {run.label}", summary=summary)
    md = out / REPORT_FILE
    settings = settings_rows(run.run_dir, run.metrics)
    write_text_atomically(
        md, render_markdown(summary, run.metrics, curves.name, read_config_notes(run.run_dir), settings)
    )
    return md, curves


def report_after_failure(run_dir: str | os.PathLike) -> None:
    """report.md and curves.png for whatever a failed (or interrupted) run logged; a report that
    cannot be written then is a warning, so the run's own error is the one raised."""
    import warnings

    if not (Path(run_dir) / METRICS_FILE).is_file():
        return
    try:
        write_report(run_dir)
    except Exception as err:  # noqa: BLE001 -- never mask the run's own error
        warnings.warn(f"{run_dir}: report not written after the failure ({type(err).__name__}: {err})", stacklevel=2)


def closing_summary(run_dir: str | os.PathLike, total_steps: Any = None, wall_s: float | None = None) -> list[str]:
    """The lines a run prints when it ends (:mod:`recipe.gepo.main_gepo`): steps done (of
    ``total_steps`` when given), held-out accuracy first -> last (:func:`summarize`), ``wall_s``, and
    the paths of report.md, curves.png and the latest HF export (``hf/step_<N>``) that exist, else
    how to evaluate the run. A run without ``metrics.jsonl`` gets one line saying so."""
    run_dir = Path(run_dir)
    try:
        s = summarize(run_dir)
    except RunDirError:
        return [f"run {run_dir}: no metrics were logged ({METRICS_FILE} missing)"]
    done = "n/a" if s["last_step"] is None else str(s["last_step"])
    rows = [("learner steps", done + (f" of {total_steps}" if total_steps not in (None, "") else ""))]
    if s["eval_metric"] is None:
        rows.append(("held-out accuracy", "n/a (no evaluation logged)"))
    else:
        rows.append(
            (
                "held-out accuracy",
                f"{s['eval_first']:.3f} (step {s['eval_first_step']}) -> {s['eval_last']:.3f} "
                f"(step {s['eval_last_step']}), {s['eval_metric']}",
            )
        )
    if wall_s is not None:
        rows.append(("wall time (s)", f"{wall_s:.0f}"))
    for name, file in (("report", REPORT_FILE), ("curves", CURVES_FILE)):
        if (run_dir / file).is_file():
            rows.append((name, str(run_dir / file)))
    exports = sorted(
        (d for d in (run_dir / "hf").glob("step_*") if d.is_dir() and to_step(d.name[len("step_") :]) is not None),
        key=lambda d: int(d.name[len("step_") :]),
    )
    if exports:
        rows.append(("HF export", str(exports[-1])))
    else:
        rows.append(("evaluate", f"python -m {__package__}.evaluate model_path={run_dir}"))
    width = max(len(k) for k, _ in rows)
    return [f"run {run_dir}:"] + [f"  {k:<{width}}  {v}" for k, v in rows]


def main(argv: list[str] | None = None) -> int:
    """CLI: write the report of each RUN_DIR; print the paths. Exit 2 on a bad RUN_DIR."""
    parser = argparse.ArgumentParser(prog=f"python -m {__package__}.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    args = parser.parse_args(argv)
    for d in args.run_dirs:
        try:
            metrics_path(d)
        except RunDirError as e:
            parser.error(str(e))
    for d in args.run_dirs:
        md, png = write_report(d)
        print(f"wrote {md}")
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
