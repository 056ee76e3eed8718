"""Draw the paper's Figure 2 (variance difference against KL) and a bias figure; print a summary.

Usage::

    python -m verl_ext.analysis.figures --out docs/figures

Writes ``figure2_bernoulli.png``, ``figure2_gaussian.png`` and ``bias.png`` into ``--out`` and
prints a numeric summary (plain text) to stdout.  Deterministic for a given ``--seed``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from .montecarlo import group_estimates
from .variance import (
    bernoulli_weight_variance,
    discrete_weight_variance,
    gaussian_weight_variance,
    gaussian_weight_variance_quad,
    gepo_bias,
    theorem1_constants,
    theorem1_counterexample,
    theorem3_constants,
)

KL_EDGES = (0.0, 0.05, 0.2, 0.5, 1.0, 2.0, math.inf)


# --------------------------------------------------------------------------- data


def bernoulli_grid(n_points: int = 50, lo: float = 0.05, hi: float = 0.95) -> dict:
    """``p = Bern(a)``, ``q = Bern(b)`` on an ``n_points x n_points`` grid; arrays ``(n, n)``
    indexed ``[i_b, i_a]`` (rows: b, columns: a)."""
    g = np.linspace(lo, hi, n_points)
    a, b = np.meshgrid(g, g)
    out = bernoulli_weight_variance(a, b)
    out.update(a=a, b=b, axis=g, c_paper=1.0 / out["expectation"])
    return out


def gaussian_grid(n_points: int = 41, lo: float = -1.0, hi: float = 1.0, quad: bool = True) -> dict:
    """``p = N(mu_p, 1)``, ``q = N(mu_q, 1)``; arrays ``(n, n)`` indexed ``[i_mu_p, i_mu_q]``.

    Closed form; with ``quad`` also the quadrature values and the largest disagreement
    (``"quad_max_abs_err"``) between the two over the grid.
    """
    g = np.linspace(lo, hi, n_points)
    mu_q, mu_p = np.meshgrid(g, g)
    out = gaussian_weight_variance(mu_p, mu_q)
    if quad:
        qd = gaussian_weight_variance_quad(mu_p, mu_q)
        out["quad_max_abs_err"] = max(
            float(np.max(np.abs(qd[k] - out[k]))) for k in ("ratio", "group_expectation", "kl")
        )
    out.update(mu_p=mu_p, mu_q=mu_q, axis=g, c_paper=1.0 / out["expectation"])
    return out


def random_pairs(n_pairs: int, support: int, rng: np.random.Generator, max_temp: float = 3.0) -> dict:
    """Random discrete pairs spanning a range of KL: ``q ~ Dirichlet(1)``,
    ``p ∝ q exp(s z)`` with ``z ~ N(0, I)``, ``s ~ U(0, max_temp)``; advantage
    ``A ~ U(-1, 1)``.  Arrays ``(n_pairs, support)``."""
    q = rng.dirichlet(np.ones(support), size=n_pairs)
    q = np.maximum(q, 1e-12)
    q /= q.sum(axis=-1, keepdims=True)
    s = rng.uniform(0.0, max_temp, size=(n_pairs, 1))
    logits = np.log(q) + s * rng.standard_normal((n_pairs, support))
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    adv = rng.uniform(-1.0, 1.0, size=(n_pairs, support))
    return {"p": p, "q": q, "advantage": adv}


def theorem2_counterexample_family(support: int = 8, n: int = 200) -> dict:
    """``p`` uniform on ``support`` points, ``q = (1-d, d/(support-1), ...)``, ``A = 1``, for
    ``d`` from ``(support-1)/support`` (``q = p``) down to 1e-3; arrays ``(n,)`` of ``"kl"``,
    ``"bias"``, ``"paper_bound"``.  The bias exceeds ``||p||/||q||`` once ``q`` is peaked enough."""
    d = np.linspace((support - 1) / support, 1e-3, n)
    q = np.concatenate([1 - d[:, None], np.repeat(d[:, None] / (support - 1), support - 1, axis=1)], axis=1)
    p = np.full_like(q, 1.0 / support)
    b = gepo_bias(p, q, 1.0)
    return {"kl": discrete_weight_variance(p, q)["kl"], "bias": b["bias"], "paper_bound": b["paper_bound"]}


# --------------------------------------------------------------------------- summaries


def kl_bucket_table(kl: np.ndarray, diff: np.ndarray, edges=KL_EDGES) -> list[tuple]:
    """Rows ``(lo, hi, count, frac_group_lower, median_diff)`` per KL bucket; ``diff`` is
    ``Var[p/q] - Var[p/E_q q]`` so ``frac_group_lower`` is the fraction with ``diff > 0``."""
    kl = np.ravel(kl)
    diff = np.ravel(diff)
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (kl >= lo) & (kl < hi)
        if m.any():
            rows.append((lo, hi, int(m.sum()), float((diff[m] > 0).mean()), float(np.median(diff[m]))))
    return rows


def _format_table(rows) -> str:
    lines = ["    KL bucket      points  frac(Var[p/E_q q] < Var[p/q])  median Var difference"]
    for lo, hi, n, frac, med in rows:
        hi_s = "inf" if math.isinf(hi) else f"{hi:g}"
        lines.append(f"    [{lo:g}, {hi_s}){'':<{9 - len(f'{lo:g}') - len(hi_s)}}{n:6d}  {frac:28.3f}  {med:21.4g}")
    return "\n".join(lines)


def summarise(bern: dict, gauss: dict, pairs: dict, bias_stats: dict) -> str:
    out = []
    for name, d in (("Bernoulli", bern), ("Gaussian", gauss)):
        diff = d["ratio"] - d["group_expectation"]
        kl = d["kl"]
        lower = diff > 0
        out.append(
            f"{name} grid ({diff.size} points, KL in [{kl.min():.3g}, {kl.max():.3g}]): "
            f"group-expectation variance lower at {lower.mean():.3f} of points"
        )
        out.append(_format_table(kl_bucket_table(kl, diff)))
        if lower.all() or not lower.any():
            out.append("    (no sign change)")
        else:
            out.append(
                f"    largest KL where Var[p/E_q q] >= Var[p/q]: {kl[~lower].max():.4g}; "
                f"smallest KL where it is lower: {kl[lower].min():.4g}"
            )
        slack = diff - (np.exp(kl) - d["c_paper"])
        out.append(
            f"    Theorem 1 with C = 1/E_q[q]: min over grid of diff - (exp(KL) - C) = {slack.min():.4g} "
            f"({int((slack < 0).sum())} violations)"
        )
        if "quad_max_abs_err" in d:
            out.append(f"    closed form vs scipy quadrature, max abs difference: {d['quad_max_abs_err']:.2e}")

    p, q, adv = pairs["p"], pairs["q"], pairs["advantage"]
    n_pairs, support = p.shape
    d1 = discrete_weight_variance(p, q)
    diff1 = d1["ratio"] - d1["group_expectation"]
    c1 = theorem1_constants(q)
    # Theorem 3 needs |A| >= A_min > 0: use |A| bounded away from 0 by shifting magnitudes.
    adv3 = np.sign(adv) * (0.1 + 0.9 * np.abs(adv))
    d3 = discrete_weight_variance(p, q, adv3)
    diff3 = d3["ratio"] - d3["group_expectation"]
    c3 = theorem3_constants(q, adv3)
    b = gepo_bias(p, q, adv)
    particular = d1["kl"] > np.log(c1["paper"])
    out.append(
        f"Random discrete pairs ({n_pairs} pairs, support {support}, KL in "
        f"[{d1['kl'].min():.3g}, {d1['kl'].max():.3g}]):"
    )
    out.append(
        f"    group-expectation variance lower (A = 1): {(diff1 > 0).mean():.3f}; "
        f"with advantages: {(diff3 > 0).mean():.3f}"
    )
    out.append("  A = 1:")
    out.append(_format_table(kl_bucket_table(d1["kl"], diff1)))
    out.append(
        "    Theorem 1, C = 1/||q||^2: violated by "
        f"{int((diff1 < np.exp(d1['kl']) - c1['paper']).sum())} pairs; "
        f"valid C = 1 + max q(1-q)/||q||^4: {int((diff1 < np.exp(d1['kl']) - c1['valid']).sum())}"
    )
    for q0, m in ((0.5, 2), (0.5, 10)):
        pc, qc = theorem1_counterexample(q0, m)
        dc = discrete_weight_variance(pc, qc)
        cc = theorem1_constants(qc)["paper"]
        out.append(
            f"    counter-example q = ({q0}, {(1 - q0) / m:.3g} x {m}), p = (0.999, {1e-3 / m:.2g} x {m}): "
            f"diff = {float(dc['ratio'] - dc['group_expectation']):.4f} < exp(KL) - C = "
            f"{float(np.exp(dc['kl']) - cc):.4f}"
        )
    out.append(
        f"    'KL > log C => Var[p/q] > Var[p/E_q q]': {int(particular.sum())} pairs with KL > log C, "
        f"{int((diff1[particular] <= 0).sum())} counter-examples"
    )
    out.append(
        "    Theorem 3, C_adv = A_max^2/||q||^2: violated by "
        f"{int((diff3 < c3['a_min'] ** 2 * np.exp(d3['kl']) - c3['paper']).sum())} pairs; valid C: "
        f"{int((diff3 < c3['a_min'] ** 2 * np.exp(d3['kl']) - c3['valid']).sum())}"
    )
    out.append(
        f"    Theorem 2, bias < ||p||/||q|| (|A| <= 1): violated by {int((b['bias'] >= b['paper_bound']).sum())} "
        f"pairs (worst case over |A| <= 1: {int((b['worst_case'] >= b['paper_bound']).sum())}); "
        f"valid bound max|A|(1 + ||p||/||q||): {int((b['bias'] > b['valid_bound']).sum())}"
    )
    fam = theorem2_counterexample_family(support)
    over = fam["bias"] > fam["paper_bound"]
    out.append(
        f"    Theorem 2 counter-example family (p uniform on {support}, q = (1-d, d/{support - 1}, ...), A = 1): "
        f"bias > ||p||/||q|| for KL >= {fam['kl'][over].min():.3g}"
        if over.any()
        else "    Theorem 2 counter-example family: no violation"
    )
    out.append(
        f"Finite groups (G = {bias_stats['group_size']}, {bias_stats['n_groups']} groups per pair), "
        "mean |estimate - E_p[A]| by KL bucket:"
    )
    out.append("    KL bucket      pairs   GSPO p/q   GEPO (in-group E)   GEPO (exact E)   GEPO exact bias")
    kl = d1["kl"]
    for lo, hi in zip(KL_EDGES[:-1], KL_EDGES[1:]):
        m = (kl >= lo) & (kl < hi)
        if not m.any():
            continue
        hi_s = "inf" if math.isinf(hi) else f"{hi:g}"
        out.append(
            f"    [{lo:g}, {hi_s}){'':<{9 - len(f'{lo:g}') - len(hi_s)}}{int(m.sum()):6d}"
            f"   {bias_stats['mae_gspo'][m].mean():8.3f}   {bias_stats['mae_gepo'][m].mean():17.3f}"
            f"   {bias_stats['mae_gepo_exact'][m].mean():14.3f}   {b['bias'][m].mean():15.3f}"
        )
    return "\n".join(out)


# --------------------------------------------------------------------------- drawing


def _setup_matplotlib():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_figure2(d: dict, family: str, path: Path, x_label: str, y_label: str):
    """Four panels: both variances vs KL, KL heatmap, difference heatmap, difference vs KL."""
    plt = _setup_matplotlib()
    from matplotlib.colors import SymLogNorm

    diff = d["ratio"] - d["group_expectation"]
    kl = d["kl"]
    ax_vals = d["axis"]
    extent = (ax_vals[0], ax_vals[-1], ax_vals[0], ax_vals[-1])
    fig, axes = plt.subplots(2, 2, figsize=(10, 8.2))

    ax = axes[0, 0]
    ax.scatter(kl.ravel(), d["ratio"].ravel(), s=4, alpha=0.5, label=r"Var$_q[p/q]$", color="tab:red")
    ax.scatter(kl.ravel(), d["group_expectation"].ravel(), s=4, alpha=0.5, label=r"Var$_q[p/E_q q]$", color="tab:blue")
    ax.set_yscale("symlog", linthresh=1e-2)
    ax.set_xlabel("KL(p || q)")
    ax.set_ylabel("variance of the weight")
    ax.set_title("Variance comparison")
    ax.legend(markerscale=3)

    ax = axes[0, 1]
    im = ax.imshow(kl, origin="lower", extent=extent, cmap="viridis", aspect="equal")
    fig.colorbar(im, ax=ax, label="KL(p || q)")
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title("KL divergence")

    ax = axes[1, 0]
    lim = float(np.abs(diff).max())
    im = ax.imshow(
        diff,
        origin="lower",
        extent=extent,
        cmap="RdBu_r",
        norm=SymLogNorm(linthresh=1e-2, vmin=-lim, vmax=lim),
        aspect="equal",
    )
    ax.contour(ax_vals, ax_vals, diff, levels=[0.0], colors="k", linewidths=1.0)
    fig.colorbar(im, ax=ax, label=r"Var$[p/q]$ - Var$[p/E_q q]$")
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title("Variance reduction (black: zero contour)")

    ax = axes[1, 1]
    pos = diff > 0
    ax.scatter(kl[pos], diff[pos], s=4, alpha=0.5, color="tab:green", label="GEPO weight lower variance")
    ax.scatter(kl[~pos], diff[~pos], s=4, alpha=0.7, color="tab:orange", label="GEPO weight higher variance")
    grid_kl = np.linspace(0, kl.max(), 200)
    ax.plot(grid_kl, np.expm1(grid_kl), "k--", lw=1, label="exp(KL) - 1")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_yscale("symlog", linthresh=1e-2)
    ax.set_xlabel("KL(p || q)")
    ax.set_ylabel(r"Var$[p/q]$ - Var$[p/E_q q]$")
    ax.set_title("KL vs variance reduction")
    ax.legend(markerscale=3, fontsize=8)

    fig.suptitle(f"Figure 2 ({family}): importance-weight variance, p/q vs p/E_q[q]")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def draw_bias(pairs: dict, bias_stats: dict, path: Path):
    """Panel (a): exact GEPO bias and the Theorem-2 bound vs KL; (b): finite-group errors."""
    plt = _setup_matplotlib()
    p, q, adv = pairs["p"], pairs["q"], pairs["advantage"]
    kl = discrete_weight_variance(p, q)["kl"]
    b = gepo_bias(p, q, adv)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))

    ax = axes[0]
    ax.scatter(kl, b["paper_bound"], s=6, color="grey", alpha=0.6, label=r"paper bound $\|p\|_2/\|q\|_2$")
    ax.scatter(kl, b["worst_case"], s=6, color="tab:purple", alpha=0.5, label=r"worst case over $|A|\leq 1$")
    viol = b["bias"] >= b["paper_bound"]
    ax.scatter(kl[~viol], b["bias"][~viol], s=6, color="tab:blue", label="GEPO bias (A ~ U(-1,1))")
    ax.scatter(kl[viol], b["bias"][viol], s=14, color="tab:red", marker="x", label="GEPO bias above the bound")
    ax.scatter(kl, b["gspo_bias"], s=6, color="tab:green", label="GSPO (p/q) bias = 0")
    fam = theorem2_counterexample_family(p.shape[1])
    ax.plot(
        fam["kl"], fam["bias"], color="tab:red", lw=1.5, label=f"p uniform, q=(1-d, d/{p.shape[1] - 1},..), A=1: bias"
    )
    ax.plot(fam["kl"], fam["paper_bound"], color="tab:red", lw=1.5, ls="--", label="... and its paper bound")
    ax.set_xlabel("KL(p || q)")
    ax.set_ylabel(r"$|E_p[A] - E_q[w A]|$")
    ax.set_title("(a) exact bias of the weighted estimate of E_p[A]")
    ax.legend(fontsize=8)

    ax = axes[1]
    edges = np.quantile(kl, np.linspace(0, 1, 9))
    centres = 0.5 * (edges[:-1] + edges[1:])
    which = np.clip(np.searchsorted(edges, kl, side="right") - 1, 0, len(centres) - 1)
    series = (
        ("mae_gspo", "tab:green", "GSPO: w = p/q"),
        ("mae_gepo", "tab:blue", r"GEPO: w = p / ($\sum q_j^2/\sum q_j$) in-group"),
        ("mae_gepo_exact", "tab:cyan", r"GEPO: w = p / $E_q[q]$ exact"),
    )
    for key, color, label in series:
        vals = bias_stats[key]
        ax.scatter(kl, vals, s=4, color=color, alpha=0.25)
        means = np.array([vals[which == i].mean() for i in range(len(centres))])
        ax.plot(centres, means, "o-", color=color, lw=2, label=label + " (bin mean)")
    ax.set_yscale("log")
    ax.set_xlabel("KL(p || q)")
    ax.set_ylabel(r"mean $|\hat E - E_p[A]|$ over groups")
    ax.set_title(f"(b) error of G = {bias_stats['group_size']} group estimates")
    ax.legend(fontsize=8)

    fig.suptitle(f"GEPO vs GSPO-style weights on {p.shape[0]} random discrete pairs (support {p.shape[1]})")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


def compute_bias_stats(pairs: dict, group_size: int, n_groups: int, rng: np.random.Generator) -> dict:
    """Mean absolute error of each group estimator of ``E_p[A]``, arrays ``(n_pairs,)``."""
    keys = ("gspo", "gepo", "gepo_exact")
    mae = {k: np.empty(pairs["p"].shape[0]) for k in keys}
    for i in range(pairs["p"].shape[0]):
        est = group_estimates(pairs["p"][i], pairs["q"][i], pairs["advantage"][i], group_size, n_groups, rng)
        for k in keys:
            mae[k][i] = np.abs(est[k] - est["target"]).mean()
    return {"group_size": group_size, "n_groups": n_groups, **{f"mae_{k}": v for k, v in mae.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m verl_ext.analysis.figures", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="output directory for the PNGs")
    ap.add_argument("--bernoulli-points", type=int, default=50, help="grid points per axis on [0.05, 0.95]")
    ap.add_argument("--gaussian-points", type=int, default=41, help="grid points per axis on [-1, 1]")
    ap.add_argument("--pairs", type=int, default=400, help="random discrete pairs for the bias figure")
    ap.add_argument("--support", type=int, default=8, help="support size of the random pairs")
    ap.add_argument("--group-size", type=int, default=8, help="G for the finite-group estimates")
    ap.add_argument("--groups", type=int, default=400, help="groups per pair for the finite-group estimates")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-quad", action="store_true", help="skip the quadrature cross-check of the Gaussian grid")
    args = ap.parse_args(argv)
    for name in ("bernoulli_points", "gaussian_points", "pairs", "support", "group_size", "groups"):
        if getattr(args, name) < 2:
            ap.error(f"--{name.replace('_', '-')} must be >= 2; got {getattr(args, name)}")

    args.out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    bern = bernoulli_grid(args.bernoulli_points)
    gauss = gaussian_grid(args.gaussian_points, quad=not args.no_quad)
    pairs = random_pairs(args.pairs, args.support, rng)
    bias_stats = compute_bias_stats(pairs, args.group_size, args.groups, rng)

    draw_figure2(
        bern,
        "Bernoulli p=Bern(a), q=Bern(b)",
        args.out / "figure2_bernoulli.png",
        "a  (p = Bern(a), learner)",
        "b  (q = Bern(b), sampler)",
    )
    draw_figure2(
        gauss,
        "Gaussian p=N(mu_p,1), q=N(mu_q,1)",
        args.out / "figure2_gaussian.png",
        "mu_q  (sampler)",
        "mu_p  (learner)",
    )
    draw_bias(pairs, bias_stats, args.out / "bias.png")
    print(summarise(bern, gauss, pairs, bias_stats))
    print(
        f"wrote {', '.join(str(args.out / n) for n in ('figure2_bernoulli.png', 'figure2_gaussian.png', 'bias.png'))}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
