"""Diagnostics from runs: the estimation error of E[A] (the GEPO paper's Figure 5) and its
relation to staleness, KL and importance-weight variance.

For a logged batch (G responses per prompt from the sampler q of version v - tau) the learner p
(version v) trains on, per prompt group g with A_i = r_i - b_g (b_g the group's mean logged reward,
for every algorithm): E_hat_w[A]_g = (1/G) sum_i w_i A_i (unnormalised, as the losses use the
weights), against M fresh samples y_j ~ p: mean_j (r(y_j) - b_g). ``diag/adv_estimation_error/<kind>``
is the mean over groups of |E_hat_w[A]_g - E_fresh[A]_g| for each of :data:`WEIGHT_KINDS`: ``ratio``
(p_i / q_i, the run's sequence reduction), ``group_expectation`` (p_i / E_hat_q[q], GEPO's),
``ratio_full`` (prod_t p_t / q_t) and ``none`` (w = 1); ``diag/adv_estimation_error`` is the loss's
own family (:func:`main_weight_kind`), ``diag/fresh_std_error`` the fresh mean's Monte-Carlo noise
beside it. The embedded engine logs them every ``task.diagnostics_every`` steps.

    python -m verl_ext.analysis.run_diagnostics RUN_DIR... --out DIR   # scatter plots, Pearson's r
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch

from verl_ext.algos.importance import group_expectation_log_denominator
from verl_ext.analysis import run_figures
from verl_ext.rundir import RunDirError, load_runs

ERROR = "diag/adv_estimation_error"
WEIGHT_KINDS = ("ratio", "group_expectation", "ratio_full", "none")
GROUP_EXPECTATION_LOSSES = ("gepo", "gepo_adaptive", "gepo_tr", "eqp")
STALENESS = "hetero/staleness_mean"
KL = "is/kl_sampler_learner"
VAR = "is/weight_var"
#: (x, y) pairs the CLI correlates and draws
DIAG_PAIRS: tuple[tuple[str, str], ...] = (
    (STALENESS, ERROR),
    (KL, ERROR),
    (VAR, ERROR),
    (STALENESS, KL),
    (STALENESS, VAR),
    (KL, VAR),
)


def main_weight_kind(loss_mode: str) -> str:
    """The weight family of a loss mode: ``group_expectation`` for GEPO's losses, else ``ratio``."""
    return "group_expectation" if loss_mode in GROUP_EXPECTATION_LOSSES else "ratio"


def weighted_advantage_estimates(
    seq_log_p: torch.Tensor,
    seq_log_q: torch.Tensor,
    full_log_p: torch.Tensor,
    full_log_q: torch.Tensor,
    rewards: torch.Tensor,
    group_index: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Per-group importance-weighted estimates of E_p[A], A_i = r_i - mean of the group's r.

    Args:
        seq_log_p, seq_log_q: [B] sequence log-probs with the run's reduction (mean: length-normalised).
        full_log_p, full_log_q: [B] summed sequence log-probs (for ``ratio_full``).
        rewards: [B] logged rewards.
        group_index: [B] group labels 0..n_groups-1 (dense).

    Returns:
        {kind: [n_groups] estimate} for each of :data:`WEIGHT_KINDS`, and ``"baseline"``: [n_groups]
        the group's mean logged reward b_g.
    """
    seq_log_p, seq_log_q = seq_log_p.double(), seq_log_q.double()
    full_log_p, full_log_q = full_log_p.double(), full_log_q.double()
    rewards = rewards.double()
    n_groups = int(group_index.max()) + 1
    group_index = group_index.to(rewards.device)
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=rewards.device)
    counts = zeros.clone().index_add_(0, group_index, torch.ones_like(rewards))
    baseline = zeros.clone().index_add_(0, group_index, rewards) / counts
    adv = rewards - baseline[group_index]
    log_den = group_expectation_log_denominator(seq_log_q, group_index)
    weights = {
        "ratio": torch.exp(seq_log_p - seq_log_q),
        "group_expectation": torch.exp(seq_log_p - log_den),
        "ratio_full": torch.exp((full_log_p - full_log_q).clamp(max=50.0)),
        "none": torch.ones_like(rewards),
    }
    out = {}
    for kind, w in weights.items():
        out[kind] = zeros.clone().index_add_(0, group_index, w * adv) / counts
    out["baseline"] = baseline
    return out


def estimation_errors(
    estimates: dict[str, torch.Tensor], fresh_rewards: torch.Tensor, main_kind: str = "ratio"
) -> dict[str, float]:
    """``diag/*`` metrics: mean over groups of |IS estimate - fresh estimate| per weight kind.

    Args:
        estimates: output of :func:`weighted_advantage_estimates`.
        fresh_rewards: [n_groups, M] rewards of M fresh learner samples per prompt (M >= 1).
        main_kind: the variant also logged as ``diag/adv_estimation_error``.
    """
    fresh_rewards = fresh_rewards.double()
    m = fresh_rewards.shape[1]
    fresh = fresh_rewards.mean(dim=1) - estimates["baseline"]
    sem = fresh_rewards.std(dim=1, unbiased=True) / math.sqrt(m) if m > 1 else torch.full_like(fresh, math.nan)
    out = {
        "diag/fresh_adv_mean": fresh.mean().item(),
        "diag/fresh_std_error": sem.mean().item(),
        "diag/fresh_reward_mean": fresh_rewards.mean().item(),
    }
    for kind in WEIGHT_KINDS:
        err = (estimates[kind] - fresh).abs().mean().item()
        out[f"{ERROR}/{kind}"] = err
        out[f"diag/adv_estimate/{kind}"] = estimates[kind].mean().item()
    out[ERROR] = out[f"{ERROR}/{main_kind}"]
    return out


# --------------------------------------------------------------------------- run-level figures


def diag_correlations(runs, labels, pairs=DIAG_PAIRS) -> pd.DataFrame:
    """Pearson r per pair of :data:`DIAG_PAIRS`, per run and pooled (:func:`run_figures.correlations`)."""
    return run_figures.correlations(runs, labels, pairs)


def _name(x: str, y: str) -> str:
    return f"diag_{y.split('/')[-1]}_vs_{x.split('/')[-1]}"


def make_diag_figures(runs, labels, out: Path, fmt: str = "png", log=print) -> tuple[dict[str, Path], pd.DataFrame]:
    """Scatter plots of :data:`DIAG_PAIRS` and ``diag_correlations.csv`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    corr = diag_correlations(runs, labels)
    written = {}
    for x, y in DIAG_PAIRS:
        p = run_figures.plot_scatter(runs, labels, corr, x, y, out / f"{_name(x, y)}.{fmt}")
        if p is None:
            log(f"note: skipped {_name(x, y)}: no run logged both {x} and {y}")
        else:
            written[_name(x, y)] = p
    corr.to_csv(out / "diag_correlations.csv", index=False)
    written["diag_correlations"] = out / "diag_correlations.csv"
    return written, corr


def error_summary(runs, labels) -> pd.DataFrame:
    """Per run: mean of each ``diag/adv_estimation_error/<kind>`` over the logged steps."""
    rows = []
    for run, label in zip(runs, labels):
        row = {"label": label}
        for kind in WEIGHT_KINDS + ("",):
            col = f"{ERROR}/{kind}" if kind else ERROR
            vals = run.metrics[col].dropna() if col in run.metrics.columns else pd.Series(dtype=float)
            row[kind or "main"] = float(vals.mean()) if len(vals) else math.nan
        fresh = run.metrics.get("diag/fresh_std_error")
        row["fresh_std_error"] = float(fresh.dropna().mean()) if fresh is not None and len(fresh.dropna()) else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m verl_ext.analysis.run_diagnostics", description=__doc__.split("\n")[0]
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--out", required=True)
    parser.add_argument("--labels", nargs="+", default=None)
    parser.add_argument("--format", default="png", choices=("png", "pdf", "svg"))
    args = parser.parse_args(argv)
    try:
        runs, labels = load_runs(args.run_dirs, args.labels)
    except (RunDirError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    written, corr = make_diag_figures(runs, labels, Path(args.out), args.format)
    for name, path in written.items():
        print(f"{name}: {path}")
    print(run_figures.correlation_table(corr))
    print(error_summary(runs, labels).to_string(index=False, float_format=lambda v: f"{v:.4f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
