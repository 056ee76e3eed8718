"""The sweep's statistics: pure functions over per-run dicts (task, algo, lr, delay, seed and the
:func:`run_numbers` keys) -- a run's numbers from its metrics, summaries per condition, paired
drops and comparisons, the learning-rate rule, the design's MDE, KL-variance correlations."""

from __future__ import annotations

import math

from .plan import Plan, condition_key, multi_lr


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample std of the finite values: (NaN, NaN) when there are none, std NaN for one."""
    v = [x for x in values if x is not None and math.isfinite(x)]
    if not v:
        return math.nan, math.nan
    m = sum(v) / len(v)
    s = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else math.nan
    return m, s


#: mechanism metrics averaged over the tail steps: run key -> metrics.jsonl key (NaN when a loss
#: does not log it)
MECHANISMS = {
    "kl": "is/kl_sampler_learner",
    "var": "is/weight_var",
    "weight_mean": "is/weight_mean",
    "clipfrac": "actor/pg_clipfrac",
    "clipfrac_pos": "is/clipfrac_pos_adv",
    "clipfrac_neg": "is/clipfrac_neg_adv",
    "weight_right": "is/grad_weight_pos_adv",
    "weight_wrong": "is/grad_weight_neg_adv",
}


def run_numbers(metrics: list[dict], total_steps: int, last_evals: int = 0) -> dict[str, float]:
    """One run's numbers from its metrics rows (dicts with ``step``).

    Evaluations are ``eval/acc_mean`` at steps > 0 (the step-0 evaluation is the shared warm
    start, reported as ``start``). ``best`` = max, ``last`` = the final one, ``gap`` = best - last,
    ``lq_mean`` (the run's score) = mean of the last ``last_evals`` evaluations, or with
    ``last_evals=0`` of the evaluations at steps > 0.75 * total_steps. The :data:`MECHANISMS`
    (``kl``, ``var``, ``weight_mean``, ``clipfrac``, the clip fractions by advantage sign
    ``clipfrac_pos`` / ``clipfrac_neg`` and the relative gradient weights of right / wrong answers
    ``weight_right`` / ``weight_wrong``, see ``verl_ext.algos.objective.gradient_mechanism_metrics``)
    are means over the training steps > 0.75 * total_steps; ``zero_grad_stale`` = mean share of
    sequences whose whole gradient the loss removed over the steps trained on stale data
    (staleness > 0); ``staleness`` and ``err`` = means of ``hetero/staleness_mean`` and
    ``diag/adv_estimation_error`` over all training steps that logged them, ``staleness_max`` the
    largest ``hetero/staleness_max``.
    """
    evals = [
        (r["step"], r["eval/acc_mean"]) for r in metrics if "eval/acc_mean" in r and r["eval/acc_mean"] is not None
    ]
    start = next((a for s, a in evals if s == 0), math.nan)
    after = [(s, a) for s, a in evals if s > 0]
    cut = 0.75 * total_steps
    out = {"start": start, "best": math.nan, "last": math.nan, "lq_mean": math.nan, "gap": math.nan}
    if after:
        accs = [a for _, a in after]
        out["best"], out["last"] = max(accs), accs[-1]
        lq = accs[-last_evals:] if last_evals > 0 else [a for s, a in after if s > cut]
        out["lq_mean"] = sum(lq) / len(lq) if lq else math.nan
        out["gap"] = out["best"] - out["last"]

    def tail(key: str, all_steps: bool = False) -> list[float]:
        return [
            r[key]
            for r in metrics
            if key in r
            and r[key] is not None
            and r["step"] > 0
            and (all_steps or r["step"] > cut)
            and math.isfinite(r[key])
        ]

    def tail_mean(key: str, all_steps: bool = False) -> float:
        vals = tail(key, all_steps)
        return sum(vals) / len(vals) if vals else math.nan

    for name, key in MECHANISMS.items():
        out[name] = tail_mean(key)
    # replay trains each step on one version: a step's sequences are all as stale as the step
    stale_steps = {r["step"] for r in metrics if r.get("hetero/staleness_mean", 0) and r["step"] > 0}
    zero = [r["is/zero_grad_seq_frac"] for r in metrics if r["step"] in stale_steps and "is/zero_grad_seq_frac" in r]
    out["zero_grad_stale"] = sum(zero) / len(zero) if zero else math.nan
    out["staleness"] = tail_mean("hetero/staleness_mean", all_steps=True)
    out["staleness_max"] = max(tail("hetero/staleness_max", all_steps=True), default=math.nan)
    out["err"] = tail_mean("diag/adv_estimation_error", all_steps=True)
    return out


def paired_drops(per_run: list[dict]) -> dict[tuple, list[float]]:
    """(task, algo, condition != 0) -> lq_mean on-policy minus lq_mean at that condition, one
    difference per seed that ran at both (same task, algo and learning rate)."""
    lq = {(r["task"], r["algo"], r["delay"], r["seed"]): r["lq_mean"] for r in per_run}
    drops: dict[tuple, list[float]] = {}
    for (task, algo, delay, seed), value in sorted(lq.items(), key=lambda kv: kv[0][3]):
        if delay != 0 and (task, algo, 0, seed) in lq:
            drops.setdefault((task, algo, delay), []).append(lq[(task, algo, 0, seed)] - value)
    return drops


def replicate_rows(this: list[dict], other: list[dict]) -> list[dict]:
    """Does the ranking of the methods' drops hold on another draw of the warm start? Per (task,
    stale condition) that both ``this`` and ``other`` (the same design's runs from two warm starts)
    ran: each method's mean drop (paired by seed within its own start) and seed count from each,
    and Spearman's rho between the two over the methods with drops from both (NaN, p NaN, with
    fewer than 3).

    Returns one dict per (task, condition), sorted: ``task``, ``delay``, ``methods`` (a list of
    (algo, drop mean this, n this, drop mean other, n other), n = 0 and NaN where a start has no
    drop), ``rho``, ``rho_p``, ``n_methods`` (the methods with drops from both)."""
    ours, theirs = paired_drops(this), paired_drops(other)
    rows = []
    cells = {k[0::2] for k in ours} & {k[0::2] for k in theirs}  # (task, condition) of both starts
    for task, delay in sorted(cells, key=lambda k: (k[0], condition_key(k[1]))):
        methods = []
        for algo in sorted({a for t, a, d in [*ours, *theirs] if (t, d) == (task, delay)}):
            a, b = ours.get((task, algo, delay), []), theirs.get((task, algo, delay), [])
            methods.append((algo, mean_std(a)[0], len(a), mean_std(b)[0], len(b)))
        both = [(m[1], m[3]) for m in methods if m[2] and m[4]]
        rho = p = math.nan
        if len(both) >= 3:
            from scipy import stats

            result = stats.spearmanr([x for x, _ in both], [y for _, y in both])
            rho, p = float(result.statistic), float(result.pvalue)
        rows.append({"task": task, "delay": delay, "methods": methods, "rho": rho, "rho_p": p, "n_methods": len(both)})
    return rows


# what run_numbers returns, in the order of the per-run CSV
RUN_KEYS = (
    "start",
    "best",
    "last",
    "lq_mean",
    "gap",
    "kl",
    "var",
    "weight_mean",
    "clipfrac",
    "staleness",
    "staleness_max",
    "err",
    "clipfrac_pos",
    "clipfrac_neg",
    "zero_grad_stale",
    "weight_right",
    "weight_wrong",
)


def _group_key(r: dict) -> tuple:
    return (r["task"], r["algo"], condition_key(r["delay"]))


def summarize(per_run: list[dict]) -> list[dict]:
    """Rows per (task, algo, condition) from per-run dicts (keys task, algo, delay, seed and the
    :func:`run_numbers` keys): ``<key>_mean`` / ``<key>_std`` (sample std over seeds, NaN for one
    seed) and ``n``. ``drop`` = lq_mean on-policy minus lq_mean at the row's condition, paired by
    seed (seeds present at both; ``drop_n`` of them), mean and std over seeds; NaN on-policy."""
    groups: dict[tuple, list[dict]] = {}
    for r in per_run:
        groups.setdefault(_group_key(r), []).append(r)
    rows = []
    for _, runs in sorted(groups.items()):
        first = runs[0]
        row = {
            "task": first["task"],
            "algo": first["algo"],
            "delay": first["delay"],
            "n": len(runs),
            "seeds": sorted(r["seed"] for r in runs),
        }
        if "lr" in first:
            row["lr"] = first["lr"]
        for k in RUN_KEYS:
            row[f"{k}_mean"], row[f"{k}_std"] = mean_std([r.get(k, math.nan) for r in runs])
        rows.append(row)
    drops = paired_drops(per_run)
    for row in rows:
        diffs = drops.get((row["task"], row["algo"], row["delay"]), [])
        row["drop_mean"], row["drop_std"] = mean_std(diffs)
        row["drop_n"] = len(diffs)
    return rows


def stability_rows(summary: list[dict], per_run: list[dict]) -> list[dict]:
    """Per (task, algo) of :func:`summarize`'s rows: score at every condition (``lq_<label>``,
    mean over seeds) and the drop from on-policy pooled over every other condition, paired by seed:
    ``pooled_drop`` (mean), ``pooled_se`` (standard error, std / sqrt(n)), ``pooled_n`` (pairs),
    ``worse`` (pairs with a positive drop)."""
    drops = paired_drops(per_run)
    rows: dict[tuple, dict] = {}
    for r in summary:
        row = rows.setdefault((r["task"], r["algo"]), {"task": r["task"], "algo": r["algo"], "diffs": []})
        row[f"lq_{r['delay']}"] = r["lq_mean_mean"]
        row["diffs"] += drops.get((r["task"], r["algo"], r["delay"]), [])
    for row in rows.values():
        diffs = row.pop("diffs")
        m, sd = mean_std(diffs)
        row.update(
            pooled_drop=m,
            pooled_se=sd / math.sqrt(len(diffs)) if diffs else math.nan,
            pooled_n=len(diffs),
            worse=sum(x > 0 for x in diffs),
        )
    return list(rows.values())


def choose_lrs(per_run: list[dict], plan: Plan, tol: float = 0.01) -> tuple[dict, dict]:
    """The learning-rate rule. Per (task, algo): among the grid's rates whose on-policy runs
    finished for every ``lr_seeds`` seed, the rate with the highest mean score (``lq_mean``); a
    smaller rate whose mean is within ``tol`` (absolute accuracy) of that best is preferred (the
    smallest such). Pinned rates (``plan.lrs``) are taken as they are.

    Returns (table rows, {algo: rate}) -- the rate of the first task when several are planned
    (the powered design has one)."""
    table, chosen = [], {}
    for task in plan.tasks:
        for algo in plan.algos:
            if algo in plan.lrs:
                chosen.setdefault(algo, float(plan.lrs[algo]))
                table.append(
                    {
                        "task": task,
                        "algo": algo,
                        "lr": float(plan.lrs[algo]),
                        "mean": math.nan,
                        "sd": math.nan,
                        "n": 0,
                        "chosen": True,
                        "pinned": True,
                    }
                )
                continue
            means = {}
            for lr in plan.lr_grid:
                scores = [
                    r["lq_mean"]
                    for r in per_run
                    if r["task"] == task
                    and r["algo"] == algo
                    and r["delay"] == 0
                    and math.isclose(r["lr"], lr)
                    and r["seed"] in plan.lr_seeds
                ]
                m, sd = mean_std(scores)
                means[float(lr)] = m
                table.append(
                    {
                        "task": task,
                        "algo": algo,
                        "lr": float(lr),
                        "mean": m,
                        "sd": sd,
                        "n": len(scores),
                        "chosen": False,
                        "pinned": False,
                    }
                )
                if len(scores) < len(plan.lr_seeds):
                    means[float(lr)] = math.nan  # incomplete: not eligible yet
            ok = {lr: m for lr, m in means.items() if math.isfinite(m)}
            if len(ok) < len(plan.lr_grid) or not ok:
                continue  # stage 1 unfinished for this algorithm
            best = max(ok.values())
            pick = min(lr for lr, m in ok.items() if m >= best - tol)
            chosen.setdefault(algo, pick)
            for row in table:
                if row["task"] == task and row["algo"] == algo and row["lr"] == pick:
                    row["chosen"] = True
    return table, chosen


def main_runs(per_run: list[dict], plan: Plan, chosen: dict) -> list[dict]:
    """The runs at each algorithm's chosen (or only) rate: what the stability and paired tables use."""
    if not multi_lr(plan):
        return list(per_run)
    return [r for r in per_run if r["algo"] in chosen and math.isclose(r["lr"], chosen[r["algo"]])]


def _lq_by(per_run: list[dict]) -> dict[tuple, float]:
    return {(r["task"], r["algo"], r["delay"], r["seed"]): r["lq_mean"] for r in per_run}


def realised_staleness(runs: list[dict]) -> tuple[float, float]:
    """Mean over runs of each run's mean staleness, and the largest staleness any run saw (NaN
    when none recorded one)."""
    finite_max = [r["staleness_max"] for r in runs if math.isfinite(r.get("staleness_max", math.nan))]
    return mean_std([r.get("staleness", math.nan) for r in runs])[0], max(finite_max, default=math.nan)


def comparison_rows(per_run: list[dict], reference: str, alpha: float = 0.05) -> list[dict]:
    """Paired over seeds, per (task, condition != 0, baseline != reference): the difference of
    drops (reference's drop minus the baseline's; > 0: the reference loses more to staleness) and
    the difference of stale scores (reference minus baseline; > 0: the reference is better there),
    each with its :func:`verl_ext.analysis.stats.paired_test` and the MDE at the observed std of
    the differences; plus on-policy (condition 0) score differences."""
    from verl_ext.analysis.stats import mde, paired_test

    lq = _lq_by(per_run)
    stale = {}
    for r in per_run:
        stale.setdefault((r["task"], r["delay"]), []).append(r)
    rows = []
    tasks = sorted({r["task"] for r in per_run})
    algos = sorted({r["algo"] for r in per_run} - {reference})
    for task in tasks:
        conds = sorted({r["delay"] for r in per_run if r["task"] == task}, key=condition_key)
        for cond in conds:
            runs_here = stale.get((task, cond), [])
            st_mean, st_max = realised_staleness(runs_here)
            for b in algos:
                seeds = sorted({r["seed"] for r in per_run if r["task"] == task})
                drop_d, score_d, ref_drop, b_drop = [], [], [], []
                for s in seeds:
                    keys = [(task, a, c, s) for a in (reference, b) for c in (0, cond)]
                    if cond != 0 and all(k in lq for k in keys):
                        dr = lq[(task, reference, 0, s)] - lq[(task, reference, cond, s)]
                        db = lq[(task, b, 0, s)] - lq[(task, b, cond, s)]
                        ref_drop.append(dr)
                        b_drop.append(db)
                        drop_d.append(dr - db)
                    if (task, reference, cond, s) in lq and (task, b, cond, s) in lq:
                        score_d.append(lq[(task, reference, cond, s)] - lq[(task, b, cond, s)])
                if not score_d:
                    continue
                dt, st = paired_test(drop_d, alpha), paired_test(score_d, alpha)

                def _mde(t):
                    return mde(t.sd, t.n, alpha) if t.n >= 2 and math.isfinite(t.sd) and t.sd > 0 else math.nan

                rows.append(
                    {
                        "task": task,
                        "condition": cond,
                        "staleness_mean": st_mean,
                        "staleness_max": st_max,
                        "reference": reference,
                        "baseline": b,
                        "n_drop": dt.n,
                        "ref_drop": mean_std(ref_drop)[0],
                        "base_drop": mean_std(b_drop)[0],
                        "drop_diff": dt.mean,
                        "drop_lo": dt.ci_low,
                        "drop_hi": dt.ci_high,
                        "drop_p": dt.p,
                        "drop_mde": _mde(dt),
                        "n_score": st.n,
                        "score_diff": st.mean,
                        "score_lo": st.ci_low,
                        "score_hi": st.ci_high,
                        "score_p": st.p,
                        "score_mde": _mde(st),
                    }
                )
    return rows


def dominance_rows(*designs: list[dict], grpo: str = "grpo_paper", alpha: float = 0.05) -> list[dict]:
    """The frontier question, per method m: is m's drop no larger than every other method's in every
    stale condition, and smaller than GRPO's in at least one? "No larger" = not significantly larger
    (the paired difference of drops, m minus the other, has its 95% interval's lower end <= 0);
    "smaller" = significantly smaller (upper end < 0). Only conditions where m and the other both
    have paired runs count; ``complete`` says whether m was compared with every other method in
    every stale condition. ``point_losses``: comparisons where m's mean drop is larger at all.
    ``wins_so_far``: both conditions hold on the comparisons made (``wins`` also needs ``complete``).
    ``beats_grpo_holm_at``: the conditions of ``beats_grpo_at`` that stay significant after Holm's
    adjustment over m's comparisons with GRPO in every stale condition (a sensitivity check of the
    rule's "at least one", which is uncorrected; the "no larger" side only gets easier to pass
    under a correction, so the uncorrected rule is the strict one there).

    ``designs``: one list of runs per design (e.g. the 200-step study and its 600-step ``fix256``
    runs, each with its own on-policy reference); their stale conditions must not overlap."""
    from verl_ext.analysis.stats import holm_adjusted

    _check_disjoint(designs)
    every = [r for runs in designs for r in runs]
    methods = sorted({r["algo"] for r in every})
    stale = sorted({r["delay"] for r in every if r["delay"] != 0}, key=condition_key)
    out = []
    for m in methods:
        comps = [
            c
            for runs in designs
            for c in comparison_rows(runs, m, alpha)  # each design pairs with its own
            if c["condition"] != 0 and c["n_drop"] >= 2
        ]  # on-policy runs
        seen = {(c["condition"], c["baseline"]) for c in comps}
        losses = [c for c in comps if c["drop_lo"] > 0]
        against_grpo = [c for c in comps if c["baseline"] == grpo]
        beats_grpo = [c["condition"] for c in against_grpo if c["drop_hi"] < 0]
        adjusted = holm_adjusted([c["drop_p"] for c in against_grpo])
        beats_grpo_holm = [c["condition"] for c, p in zip(against_grpo, adjusted) if c["drop_hi"] < 0 and p < alpha]
        complete = all((cond, b) in seen for cond in stale for b in methods if b != m)
        wins_so_far = not losses and bool(beats_grpo)
        out.append(
            {
                "algo": m,
                "compared": len(comps),
                "complete": complete,
                "significant_losses": [(c["condition"], c["baseline"]) for c in losses],
                "point_losses": sum(c["drop_diff"] > 0 for c in comps),
                "beats_grpo_at": beats_grpo,
                "beats_grpo_holm_at": beats_grpo_holm,
                "wins_so_far": wins_so_far,
                "wins": complete and wins_so_far,
            }
        )
    return out


def verdict_rows(
    *designs: list[dict], against: tuple[str, ...] = ("gepo", "grpo_paper"), alpha: float = 0.05
) -> list[dict]:
    """Each method against each of ``against``, per stale condition of each design (``designs`` as
    in :func:`dominance_rows`): the paired difference of drops, method minus the other (> 0: the
    method loses more to staleness), its 95% interval, p and ``verdict`` -- "smaller" / "larger"
    when the interval excludes 0, "no difference" otherwise, "-" with fewer than two pairs."""
    _check_disjoint(designs)
    out = []
    for other in against:
        for runs in designs:
            for c in comparison_rows(runs, other, alpha):
                if c["condition"] == 0:
                    continue
                diff, lo, hi = -c["drop_diff"], -c["drop_hi"], -c["drop_lo"]  # method minus other
                verdict = "-" if c["n_drop"] < 2 else "smaller" if hi < 0 else "larger" if lo > 0 else "no difference"
                out.append(
                    {
                        "task": c["task"],
                        "algo": c["baseline"],
                        "against": other,
                        "condition": c["condition"],
                        "n": c["n_drop"],
                        "diff": diff,
                        "lo": lo,
                        "hi": hi,
                        "p": c["drop_p"],
                        "verdict": verdict,
                    }
                )
    return out


def choice_rows(*designs: list[dict], alpha: float = 0.05) -> list[dict]:
    """ "Which loss for which staleness", per stale condition of each design (``designs`` as in
    :func:`dominance_rows`): the method with the highest mean stale score and the methods whose
    score is not significantly below it (the paired score difference, best minus the method, has
    its 95% interval's lower end <= 0), and likewise the smallest mean drop and the methods whose
    drop is not significantly larger. ``score``: method -> mean stale score; ``drop``: method ->
    (mean, low, high) of its paired drop and t interval, for every method with runs there.
    ``seeds``: the most seeds any method has there; with fewer than two nothing can be tested, and
    ``tied_score`` / ``tied_drop`` are None (not "no method ties"). ``untested``: methods with one
    seed there while others have more (no interval: not in the lists, not the best, not ruled out)."""
    from verl_ext.analysis.stats import paired_test

    _check_disjoint(designs)
    out = []
    for runs in designs:
        drops = paired_drops(runs)
        for task in sorted({r["task"] for r in runs}):
            mine = [r for r in runs if r["task"] == task]
            for cond in sorted({r["delay"] for r in mine if r["delay"] != 0}, key=condition_key):
                here = [r for r in mine if r["delay"] == cond]
                score = {
                    a: mean_std([r["lq_mean"] for r in here if r["algo"] == a])[0] for a in {r["algo"] for r in here}
                }
                score = {a: v for a, v in score.items() if math.isfinite(v)}
                drop = {}
                for a in score:
                    t = paired_test(drops.get((task, a, cond), []), alpha)
                    if t.n:
                        drop[a] = (t.mean, t.ci_low, t.ci_high)
                if not score:
                    continue
                per_method = {a: sum(r["algo"] == a for r in here) for a in score}
                seeds = max(per_method.values())
                untested = sorted(a for a, n in per_method.items() if n < 2) if seeds >= 2 else []
                # with two seeds somewhere, the best is chosen among the methods that can be compared
                ranked = [a for a in score if a not in untested]
                best_score = max(ranked, key=score.get)
                tied_score = _not_worse(runs, task, cond, best_score, "score", alpha) if seeds >= 2 else None
                ranked_drop = [a for a in drop if a not in untested]
                best_drop = min(ranked_drop, key=lambda a: drop[a][0]) if ranked_drop else None
                tied_drop = _not_worse(runs, task, cond, best_drop, "drop", alpha) if best_drop and seeds >= 2 else None
                st_mean, st_max = realised_staleness(here)
                out.append(
                    {
                        "task": task,
                        "condition": cond,
                        "steps": max(r.get("steps", 0) or 0 for r in here),
                        "staleness_mean": st_mean,
                        "staleness_max": st_max,
                        "score": score,
                        "drop": drop,
                        "seeds": seeds,
                        "untested": untested,
                        "best_score": best_score,
                        "tied_score": tied_score,
                        "best_drop": best_drop,
                        "tied_drop": tied_drop,
                    }
                )
    return out


def _check_disjoint(designs: tuple[list[dict], ...]) -> None:
    """Designs joined in one table must not share a stale condition: its drops would mix two
    on-policy references."""
    seen: dict = {}
    for i, runs in enumerate(designs):
        for cond in {(r["task"], r["delay"]) for r in runs if r["delay"] != 0}:
            if seen.setdefault(cond, i) != i:
                raise ValueError(f"condition {cond[1]!r} (task {cond[0]!r}) is in two of the joined designs")


def _not_worse(runs: list[dict], task: str, cond, best: str, by: str, alpha: float) -> list[str]:
    """The methods (``best`` first) not significantly worse than ``best`` at ``cond``: by "score",
    the paired score difference best minus m has lower end <= 0; by "drop", the paired difference
    of drops m minus best has lower end <= 0 (:func:`comparison_rows`, paired by seed)."""
    tied = [best]
    for c in comparison_rows(runs, best, alpha):
        if c["task"] != task or c["condition"] != cond:
            continue
        if by == "score" and c["n_score"] >= 2 and not c["score_lo"] > 0:
            tied.append(c["baseline"])
        if by == "drop" and c["n_drop"] >= 2 and not c["drop_hi"] < 0:  # drop_diff = best's - m's
            tied.append(c["baseline"])
    return tied


def recommended(choices: list[dict]) -> list[tuple[str, int]]:
    """Methods by the number of stale conditions (of :func:`choice_rows`) where their score is not
    significantly below the best, most first: the candidates for one default at every staleness. A
    condition with one seed (nothing tested there) counts for no method."""
    counts: dict[str, int] = {}
    for c in choices:
        for a in c["tied_score"] or []:
            counts[a] = counts.get(a, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def drop_rows(per_run: list[dict], alpha: float = 0.05) -> list[dict]:
    """Per (task, algo, condition): score (mean over seeds), realised staleness, the paired drop
    from on-policy with its t interval and p-value, and the mechanism metrics' means."""
    from verl_ext.analysis.stats import paired_test

    drops = paired_drops(per_run)
    out = []
    for row in summarize(per_run):
        t = paired_test(drops.get((row["task"], row["algo"], row["delay"]), []), alpha)
        out.append({**row, "drop_test": t})
    return out


def design_mde(per_run: list[dict], n_seeds: int, alpha: float = 0.05, power: float = 0.8) -> dict:
    """The design's minimum detectable difference of drops: sigma = pooled within-cell std of a
    run's score over seeds (cells with >= 2 seeds), a difference of drops involves four runs, so
    its std is 2 sigma when they are independent (pairing by seed can only help when seeds share
    variance); MDE = :func:`verl_ext.analysis.stats.mde` (2 sigma, n_seeds)."""
    from verl_ext.analysis.stats import mde

    cells: dict[tuple, list[float]] = {}
    for r in per_run:
        if math.isfinite(r["lq_mean"]):
            cells.setdefault(_group_key(r), []).append(r["lq_mean"])
    num = den = 0.0
    for v in cells.values():
        if len(v) >= 2:
            m = sum(v) / len(v)
            num += sum((x - m) ** 2 for x in v)
            den += len(v) - 1
    sigma = math.sqrt(num / den) if den else math.nan
    value = mde(2 * sigma, n_seeds, alpha, power) if math.isfinite(sigma) and sigma > 0 and n_seeds >= 2 else math.nan
    return {"sigma": sigma, "df": den, "n_seeds": n_seeds, "mde_drop_diff": value, "alpha": alpha, "power": power}


def kl_variance_rows(per_run: list[dict]) -> list[dict]:
    """The paper's "the importance weights' variance tracks KL" (its Figure 5e: r = 0.96), per
    method: over its runs (every condition and seed, one point a run: the run's mean
    KL(sampler || learner) and mean variance of the loss's own weights -- token p/q for GRPO,
    sequence ratio for GSPO, p_i / E_q[q] for GEPO), Pearson r and Spearman rho with their
    two-sided p-values, and the mean variance on-policy and at the method's highest-KL condition."""
    from scipy import stats

    out = []
    for algo in sorted({r["algo"] for r in per_run}):
        runs = [
            r
            for r in per_run
            if r["algo"] == algo and math.isfinite(r.get("kl", math.nan)) and math.isfinite(r.get("var", math.nan))
        ]
        x, y = [r["kl"] for r in runs], [r["var"] for r in runs]
        row = {
            "algo": algo,
            "n": len(runs),
            "pearson_r": math.nan,
            "pearson_p": math.nan,
            "spearman_r": math.nan,
            "spearman_p": math.nan,
        }
        if len(runs) >= 3 and len(set(x)) > 1 and len(set(y)) > 1:
            pr, sr = stats.pearsonr(x, y), stats.spearmanr(x, y)
            row.update(
                pearson_r=float(pr.statistic),
                pearson_p=float(pr.pvalue),
                spearman_r=float(sr.statistic),
                spearman_p=float(sr.pvalue),
            )
        by_cond: dict = {}
        for r in runs:
            by_cond.setdefault(r["delay"], []).append(r)
        on = by_cond.get(0, [])
        row["var_on_policy"] = mean_std([r["var"] for r in on])[0] if on else math.nan
        stale = {c: v for c, v in by_cond.items() if c != 0}
        if stale:
            top = max(stale, key=lambda c: mean_std([r["kl"] for r in stale[c]])[0])
            row.update(
                top_condition=top,
                kl_top=mean_std([r["kl"] for r in stale[top]])[0],
                var_top=mean_std([r["var"] for r in stale[top]])[0],
            )
        else:
            row.update(top_condition="-", kl_top=math.nan, var_top=math.nan)
        out.append(row)
    return out
