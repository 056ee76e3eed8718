"""The sweep's outputs: markdown tables, the per-run and summary CSVs, a task's section of
docs/study.md (:func:`study_markdown`, with the methods x conditions matrices of
:func:`glance_markdown`), and :func:`update_doc`, which copies its marked blocks into a page."""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

from .analyse import (
    RUN_KEYS,
    choice_rows,
    comparison_rows,
    design_mde,
    dominance_rows,
    drop_rows,
    kl_variance_rows,
    main_runs,
    mean_std,
    realised_staleness,
    recommended,
    replicate_rows,
    stability_rows,
    summarize,
    verdict_rows,
)
from .figures import kl_variance_figure, run_figures, staleness_figure
from .plan import TASKS, Plan, condition_key, design_id, multi_lr, normalize_condition


def _cell(m: float, s: float, digits: int = 3, sci: bool = False) -> str:
    """``m ± s`` (``m`` alone when ``s`` is not finite, ``-`` when ``m`` is not)."""
    if not math.isfinite(m):
        return "-"
    f = (lambda v: f"{v:.2e}") if sci else (lambda v: f"{v:.{digits}f}")
    return f(m) if not math.isfinite(s) else f"{f(m)} ± {f(s)}"


def _ci(m: float, lo: float, hi: float) -> str:
    """A signed mean with its interval, ``+m [lo, hi]``."""
    if not math.isfinite(m):
        return "-"
    return f"{m:+.3f}" if not math.isfinite(lo) else f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def _p(p: float) -> str:
    """A p-value: three decimals, scientific below 0.001."""
    return "-" if not math.isfinite(p) else (f"{p:.3f}" if p >= 0.001 else f"{p:.1e}")


def markdown_table(rows: list[dict]) -> str:
    """``table_<task>.md``: one line per :func:`research.study.analyse.summarize` row."""
    head = (
        "| algo | max delay | n | Best | Last | last-quarter mean | best-last gap | drop from delay 0 (lq) "
        "| KL(q‖p) | IS-weight var | E[A] error |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['algo']} | {r['delay']} | {r['n']} | {_cell(r['best_mean'], r['best_std'])} | "
            f"{_cell(r['last_mean'], r['last_std'])} | {_cell(r['lq_mean_mean'], r['lq_mean_std'])} | "
            f"{_cell(r['gap_mean'], r['gap_std'])} | {_cell(r['drop_mean'], r['drop_std'])} | "
            f"{_cell(r['kl_mean'], r['kl_std'], sci=True)} | {_cell(r['var_mean'], r['var_std'], sci=True)} | "
            f"{_cell(r['err_mean'], r['err_std'])} |"
        )
    return "\n".join(lines)


def stability_table(rows: list[dict]) -> str:
    """``stability_<task>.md`` from :func:`research.study.analyse.stability_rows`, largest pooled drop first."""
    delays = sorted({normalize_condition(k[3:]) for r in rows for k in r if k.startswith("lq_")}, key=condition_key)
    head = (
        "| algo | " + " | ".join(f"lq, delay {d}" for d in delays) + " | drop over delays > 0 (± s.e.) | pairs worse |"
    )
    lines = [head, "|" + "---|" * (len(delays) + 3)]
    for r in sorted(rows, key=lambda r: -r["pooled_drop"] if math.isfinite(r["pooled_drop"]) else 0):
        cells = " | ".join(_cell(r.get(f"lq_{d}", math.nan), math.nan) for d in delays)
        lines.append(
            f"| {r['algo']} | {cells} | {_cell(r['pooled_drop'], r['pooled_se'])} | {r['worse']}/{r['pooled_n']} |"
        )
    return "\n".join(lines)


def glance_markdown(per_run: list[dict], drops: list[dict], comparisons: dict[str, list[dict]]) -> str:
    """The study's numbers as methods x conditions matrices (what docs/results.md quotes): the
    realised staleness of each condition, each method's score (mean ± sd over seeds, n) and its
    drop from on-policy (mean [95% t interval], paired by seed), and for each reference method the
    paired difference of drops against every other method (> 0: the reference loses more).
    ``drops`` = :func:`drop_rows` (per_run), ``comparisons`` = reference -> :func:`comparison_rows`
    (per_run, reference): the same rows the long tables print, computed once by the caller."""
    conds = sorted({r["delay"] for r in per_run}, key=condition_key)
    algos = sorted({r["algo"] for r in per_run})
    head = "| | " + " | ".join(f"`{c}`" for c in conds) + " |"
    rule = "|---|" + "---|" * len(conds)
    stale = []
    for c in conds:
        mean, mx = realised_staleness([r for r in per_run if r["delay"] == c])
        stale.append(f"{_cell(mean, math.nan, 1)} / {_cell(mx, math.nan, 0)}")
    rows = {(r["algo"], r["delay"]): r for r in drops}
    score = [head, rule, "| realised staleness mean / max | " + " | ".join(stale) + " |"]
    drop = [head, rule]
    for a in algos:
        cells_s, cells_d = [], []
        for c in conds:
            r = rows.get((a, c))
            cells_s.append(f"{_cell(r['lq_mean_mean'], r['lq_mean_std'])} ({r['n']})" if r else "")
            t = r["drop_test"] if r else None
            cells_d.append(_ci(t.mean, t.ci_low, t.ci_high) if t and t.n else ("-" if c == 0 else ""))
        score.append(f"| {a} | " + " | ".join(cells_s) + " |")
        drop.append(f"| {a} | " + " | ".join(cells_d) + " |")
    out = [
        "Score (mean of the last evaluations; mean ± sd over seeds, number of seeds):",
        "",
        *score,
        "",
        "Drop from on-policy (on-policy score minus the condition's, paired by seed; mean [95% t interval]):",
        "",
        *drop,
    ]
    for key, what in (
        ("kl_mean", "mean KL(sampler ‖ learner)"),
        ("weight_wrong_mean", "weight on wrong answers' gradients (relative to REINFORCE)"),
    ):
        out += _drop_correlation(list(rows.values()), key, what)
    for ref, ref_rows in comparisons.items():
        comp = {(c["baseline"], c["condition"]): c for c in ref_rows}
        stale_conds = [c for c in conds if c != 0]
        lines = [
            "| baseline | " + " | ".join(f"`{c}`" for c in stale_conds) + " |",
            "|---|" + "---|" * len(stale_conds),
        ]
        for b in [a for a in algos if a != ref]:
            cells = []
            for c in stale_conds:
                x = comp.get((b, c))
                p = f", p {_p(x['drop_p'])}" if x and math.isfinite(x["drop_p"]) else ""
                cells.append(f"{_ci(x['drop_diff'], x['drop_lo'], x['drop_hi'])}{p}" if x and x["n_drop"] else "")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        out += [
            "",
            f"{ref}'s drop minus each baseline's (paired by seed; > 0: {ref} loses more to staleness):",
            "",
            *lines,
        ]
    return "\n".join(out)


def _drop_correlation(drops: list[dict], key: str, what: str) -> list[str]:
    """A line: the Spearman correlation, over the stale (method, condition) cells with a drop and a
    finite ``key``, between the drop and the cell's ``key`` (none with fewer than 3 cells)."""
    cells = [
        r
        for r in drops
        if r["delay"] != 0 and r["drop_test"].n and math.isfinite(r["drop_test"].mean) and math.isfinite(r[key])
    ]
    if len(cells) < 3:
        return []
    from scipy import stats

    rho = stats.spearmanr([r[key] for r in cells], [r["drop_test"].mean for r in cells])
    return [
        "",
        f"Across the {len(cells)} stale (method, condition) cells, the drop's Spearman correlation with "
        f"the cell's {what}: rho = {rho.statistic:.2f} (p {_p(float(rho.pvalue))}).",
    ]


def dominance_markdown(rows: list[dict], not_run: list[str] = ()) -> str:
    """The table of :func:`research.study.analyse.dominance_rows` and its answer in one line; ``not_run``:
    planned stale conditions without a single run yet (a win is not decided while one is)."""
    table = [
        "| method | comparisons (stale) | complete | significantly larger drop than | larger mean drop (of the "
        "comparisons) | drop smaller than grpo_paper's at | of those, after Holm over the stale conditions | wins |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        losses = ", ".join(f"{b} at {c}" for c, b in r["significant_losses"][:4])
        more = len(r["significant_losses"]) - 4
        losses += f" (+{more} more)" if more > 0 else ""
        table.append(
            f"| {r['algo']} | {r['compared']} | {'yes' if r['complete'] else 'no'} | {losses or 'none'} | "
            f"{r['point_losses']} | {', '.join(str(c) for c in r['beats_grpo_at']) or 'none'} | "
            f"{', '.join(str(c) for c in r['beats_grpo_holm_at']) or 'none'} | "
            f"{_win_cell(r, not_run)} |"
        )
    winners = [r["algo"] for r in rows if r["wins"]]
    pending = [r["algo"] for r in rows if r["wins_so_far"] and not r["complete"]]
    # while a planned condition has no run, a method no other beats anywhere may still win there
    unbeaten = [r["algo"] for r in rows if not r["significant_losses"] and not r["wins"]]
    waiting = f"{', '.join(f'`{c}`' for c in not_run)} (planned) {'has' if len(not_run) == 1 else 'have'} no runs yet"
    if winners and not_run:
        answer = (
            f"**Answer: not decided yet.** On the conditions run so far {', '.join(winners)} "
            f"meet{'s' if len(winners) == 1 else ''} both conditions, but {waiting}."
        )
    elif not_run and unbeaten:
        answer = (
            f"**Answer: not decided yet.** No method meets both conditions on the conditions run so far; "
            f"{', '.join(unbeaten)} {'is' if len(unbeaten) == 1 else 'are'} beaten by no other method so far, and "
            f"{waiting}."
        )
    elif winners:
        answer = f"**Answer: yes -- {', '.join(winners)}.**"
    elif pending:
        answer = (
            f"**Answer: not decided yet.** On the comparisons made so far {', '.join(pending)} "
            f"meet{'s' if len(pending) == 1 else ''} both conditions, but a stale condition still lacks the "
            "paired runs (two seeds or more) to compare every method there."
        )
    else:
        so_far = "" if all(r["complete"] for r in rows) else " on the rows so far"  # a missing pair could still
        answer = f"**Answer: no** (no method meets both conditions{so_far})."  # make one meet them
    for r in rows:
        if r["wins"] and not not_run:
            kept = ", ".join(str(c) for c in r["beats_grpo_holm_at"])
            answer += (
                f" Holm's adjustment over the stale conditions keeps {r['algo']}'s smaller drop than GRPO's at {kept}."
                if kept
                else f" None of {r['algo']}'s smaller drops than GRPO's survives Holm's "
                "adjustment over the stale conditions: that half of the win rests on uncorrected tests."
            )
    return "\n".join(table + ["", answer])


def _win_cell(row: dict, not_run) -> str:
    """The winner table's last column: yes only when nothing planned is missing; not yet while a
    planned condition has no run and no other method beats this one anywhere."""
    if row["wins"] and not not_run:
        return "**yes**"
    if row["wins"] or (not_run and not row["significant_losses"]):
        return "not yet (a condition not run)"
    return "not yet (incomplete)" if row["wins_so_far"] else "no"


def _others(tied: list[str] | None, seeds: int, untested: list[str]) -> str:
    """The methods tied with the best (after it, which comes first), or why none can be named, and
    the methods with one seed that could not be compared."""
    if tied is None:
        return f"untested ({seeds} seed{'s' if seeds != 1 else ''})"
    named = ", ".join(tied[1:]) or "none"
    return named + (f" (one seed, untested: {', '.join(untested)})" if untested else "")


def choice_markdown(rows: list[dict], references: tuple[str, ...] = ("gepo", "grpo_paper")) -> str:
    """The "which loss for which staleness" table of :func:`research.study.analyse.choice_rows`, a row per
    stale condition, and a line naming the methods not significantly below the best score in the
    most conditions (:func:`research.study.analyse.recommended`); ``references``' scores and drops beside."""
    table = [
        "| condition | realised staleness mean / max | highest score | not significantly below it | smallest drop "
        "[95% CI] | not significantly larger | " + " | ".join(f"{a} score / drop" for a in references) + " |",
        "|" + "---|" * (6 + len(references)),
    ]
    for r in rows:
        cond = f"`{r['condition']}`" + (
            f" ({r['steps']} steps)" if r["steps"] and r["steps"] != rows[0]["steps"] else ""
        )
        best = r["best_drop"]
        drop = f"{best} {_ci(*r['drop'][best])}" if best else "-"
        refs = [
            f"{_cell(r['score'].get(a, math.nan), math.nan)} / {_ci(*r['drop'].get(a, (math.nan,) * 3))}"
            for a in references
        ]
        table.append(
            f"| {cond} | {_cell(r['staleness_mean'], math.nan, 1)} / {_cell(r['staleness_max'], math.nan, 0)} | "
            f"{r['best_score']} {_cell(r['score'][r['best_score']], math.nan)} | "
            f"{_others(r['tied_score'], r['seeds'], r['untested'])} | {drop} | "
            f"{_others(r['tied_drop'], r['seeds'], r['untested'])} | " + " | ".join(refs) + " |"
        )
    ranked = recommended(rows)
    if not ranked:
        return "\n".join(table)
    top = ranked[0][1]
    leaders = [a for a, n in ranked if n == top]
    others = ", ".join(f"{a} {n}" for a, n in ranked if n != top)
    tested = sum(r["tied_score"] is not None for r in rows)
    where = f"{tested} stale conditions" + (" with two seeds or more" if tested < len(rows) else "")
    line = f"Not significantly below the best score in {top} of the {where}: **{', '.join(leaders)}**" + (
        f" (then: {others})." if others else "."
    )
    return "\n".join(table + ["", line])


def verdict_markdown(rows: list[dict]) -> str:
    """:func:`research.study.analyse.verdict_rows` as one methods x conditions matrix per reference: the
    verdict, the paired difference of drops (method minus the reference) and its interval."""
    out = []
    for other in dict.fromkeys(r["against"] for r in rows):
        mine = [r for r in rows if r["against"] == other]
        conds = sorted({r["condition"] for r in mine}, key=condition_key)
        cell = {(r["algo"], r["condition"]): r for r in mine}
        lines = ["| method | " + " | ".join(f"`{c}`" for c in conds) + " |", "|---|" + "---|" * len(conds)]
        for algo in sorted({r["algo"] for r in mine}):
            cells = []
            for c in conds:
                r = cell.get((algo, c))
                cells.append(f"{r['verdict']}: {_ci(r['diff'], r['lo'], r['hi'])}" if r and r["n"] else "")
            lines.append(f"| {algo} | " + " | ".join(cells) + " |")
        out += [
            f"Against {other} (each method's drop minus {other}'s, paired by seed; smaller / larger: the 95% "
            "interval excludes 0):",
            "",
            *lines,
            "",
        ]
    return "\n".join(out).rstrip("\n")


def doc_key(task: str, plan: Plan) -> str:
    """The name a design's blocks carry in a page (``<!-- study:<key>:<name> -->``): the task for
    the powered study (and its dry run), ``<task>_<design>`` for a design joined to it."""
    return task if plan.design in ("powered", "dry") else f"{task}_{plan.design}"


def study_markdown(
    task: str, plan: Plan, per_run: list[dict], lr_table: list[dict], chosen: dict, ws: dict | None = None
) -> str:
    """The section of docs/study.md for one task, from its runs."""
    from verl_ext.analysis.stats import binomial_eval_sd, mde

    mine = [r for r in main_runs(per_run, plan, chosen) if r["task"] == task]
    key = doc_key(task, plan)
    lines = [
        f"### Task `{task}` ({TASKS[task].answer_format} answers), design `{plan.design}` (id {design_id(plan)})",
        "",
    ]
    if ws and task in ws:
        which = "pinned" if task in plan.warm_start_sha256 else "this machine's build (not pinned)"
        lines += [
            f"Warm start: {which}, {plan.warm_start_steps} supervised steps, seed 0; weights sha256 `{ws[task]}`.",
            "",
        ]
    lines += [
        f"{plan.steps} learner steps, {plan.prompts} prompts x G=8, evaluation every {plan.test_freq} steps on "
        f"{plan.eval_size} held-out problems (one sample each, temperature 1); a run's score = mean of its last "
        f"{plan.last_evals or 'quarter of'} evaluations. Intervals: 95% t over seeds, paired by seed.",
        "",
    ]
    present = {r["algo"] for r in mine}
    refs = [plan.reference] + [v for v in plan.variants if v in present and v != plan.reference]
    dominance = dominance_rows(mine)
    # a method the winner rule names gets its paired table too: the numbers a verdict on it quotes
    refs += [r["algo"] for r in dominance if r["wins"] and r["algo"] not in refs]
    drops = drop_rows(mine)
    comparisons = {ref: [c for c in comparison_rows(mine, ref) if c["task"] == task] for ref in refs}
    lines += ["**At a glance**", "", *doc_block(key, "glance", glance_markdown(mine, drops, comparisons)), ""]
    grid = [r for r in lr_table if r["task"] == task]
    if grid:
        lines += [
            "**Learning rates** (stage 1, on-policy; rule: highest mean score, a smaller rate within 0.01 of it "
            "preferred):",
            "",
            "| algo | lr | n | score (mean ± sd) | chosen |",
            "|---|---|---|---|---|",
        ]
        for r in grid:
            lines.append(
                f"| {r['algo']} | {r['lr']:g} | {r['n']} | {_cell(r['mean'], r['sd'])} | "
                f"{'**yes**' if r['chosen'] else ''}{' (pinned)' if r['pinned'] else ''} |"
            )
        lines.append("")
    lines += ["**Drops from on-policy** (score on-policy minus score at the condition, paired by seed):", ""]
    table = [
        "| algo | lr | condition | realised staleness mean / run max (mean over seeds) | n | score | drop [95% CI] | p | KL(q‖p) "
        "| IS-weight var | clip frac | clip frac A>0 / A<0 | mean weight | weight right / wrong "
        "| zero-grad share (stale) |",
        "|" + "---|" * 15,
    ]
    for r in sorted(drops, key=lambda r: (r["algo"], condition_key(r["delay"]))):
        t = r["drop_test"]
        table.append(
            f"| {r['algo']} | {r.get('lr', plan.lr):g} | {r['delay']} | {_cell(r['staleness_mean'], math.nan, 1)} / "
            f"{_cell(r['staleness_max_mean'], math.nan, 0)} | {r['n']} | {_cell(r['lq_mean_mean'], r['lq_mean_std'])} | "
            f"{_ci(t.mean, t.ci_low, t.ci_high)} | {_p(t.p)} | {_cell(r['kl_mean'], math.nan, sci=True)} | "
            f"{_cell(r['var_mean'], math.nan, sci=True)} | {_cell(r['clipfrac_mean'], math.nan)} | {_cell(r['clipfrac_pos_mean'], math.nan)} / "
            f"{_cell(r['clipfrac_neg_mean'], math.nan)} | {_cell(r['weight_mean_mean'], math.nan)} | "
            f"{_cell(r['weight_right_mean'], math.nan)} / {_cell(r['weight_wrong_mean'], math.nan)} | "
            f"{_cell(r['zero_grad_stale_mean'], math.nan)} |"
        )
    lines += doc_block(key, "drops", "\n".join(table))
    for reference, comp in comparisons.items():
        lines += [
            "",
            f"**Paired differences, {reference} minus each baseline** (drop diff > 0: {reference} "
            "loses more to staleness; score diff > 0: it scores higher at that condition). MDE: the true "
            "difference a 5% two-sided paired t test on these n seeds detects with 80% power at the observed sd.",
            "",
            "| condition | staleness mean / max | baseline | n | drop diff [95% CI] | p | MDE | score diff [95% CI] "
            "| p | MDE |",
            "|" + "---|" * 10,
        ]
        for c in comp:
            lines.append(
                f"| {c['condition']} | {_cell(c['staleness_mean'], math.nan, 1)} / {_cell(c['staleness_max'], math.nan, 0)} | "
                f"{c['baseline']} | {c['n_score']} | {_ci(c['drop_diff'], c['drop_lo'], c['drop_hi'])} | {_p(c['drop_p'])} | "
                f"{_cell(c['drop_mde'], math.nan)} | {_ci(c['score_diff'], c['score_lo'], c['score_hi'])} | "
                f"{_p(c['score_p'])} | {_cell(c['score_mde'], math.nan)} |"
            )
    lines += [
        "",
        "**Is there a method whose drop is no larger than every other method's in every stale condition, "
        'and smaller than GRPO\'s (`grpo_paper`) in at least one?** ("no larger": not significantly larger, the '
        '95% interval of the paired difference of drops reaching 0 or below; "smaller": significantly smaller)',
        "",
    ]
    lines += doc_block(key, "winner", dominance_markdown(dominance, _not_run(plan, mine)))
    lines += [
        "",
        "**Which loss for which staleness** (per stale condition: the highest mean score and the methods "
        "not significantly below it, paired by seed; the smallest drop and the methods whose drop is not "
        "significantly larger):",
        "",
    ]
    lines += doc_block(key, "choice", choice_markdown(choice_rows(mine)))
    lines += [
        "",
        '**Importance-weight variance against KL** (the paper\'s "variance tracks KL"; one point a run, '
        "every condition and seed; the variance is of each loss's own weights, so compare methods by r, not by "
        "level):",
        "",
    ]
    table = [
        "| algo | runs | Pearson r (p) | Spearman rho (p) | var on-policy | stalest condition by KL | KL there "
        "| var there |",
        "|" + "---|" * 8,
    ]
    for r in kl_variance_rows(mine):
        table.append(
            f"| {r['algo']} | {r['n']} | {_cell(r['pearson_r'], math.nan, 2)} ({_p(r['pearson_p'])}) | "
            f"{_cell(r['spearman_r'], math.nan, 2)} ({_p(r['spearman_p'])}) | "
            f"{_cell(r['var_on_policy'], math.nan, sci=True)} | {r['top_condition']} | "
            f"{_cell(r['kl_top'], math.nan, sci=True)} | {_cell(r['var_top'], math.nan, sci=True)} |"
        )
    lines += doc_block(key, "klvar", "\n".join(table))
    dm = design_mde(mine, len(plan.seeds))
    acc = mean_std([r["lq_mean"] for r in mine])[0]
    floor = (
        binomial_eval_sd(min(max(acc, 0.0), 1.0), plan.eval_size, 1, max(plan.last_evals, 1))
        if math.isfinite(acc)
        else math.nan
    )
    floor_mde = (
        mde(2 * floor, len(plan.seeds)) if math.isfinite(floor) and floor > 0 and len(plan.seeds) >= 2 else math.nan
    )
    power = (
        f"**Power of the design.** Pooled seed-to-seed std of a run's score sigma = {_cell(dm['sigma'], math.nan)} "
        f"({dm['df']:.0f} df); a difference of drops combines four runs (std 2 sigma if independent), so with "
        f"{len(plan.seeds)} seeds the minimum detectable difference of drops (5% two-sided, 80% power) is "
        f"**{_cell(dm['mde_drop_diff'], math.nan)}**. The evaluation alone (binomial, {plan.eval_size} problems x "
        f"{max(plan.last_evals, 1)} evaluations at accuracy {_cell(acc, math.nan)}) gives sigma >= "
        f"{_cell(floor, math.nan)}, MDE >= {_cell(floor_mde, math.nan)}."
    )
    lines += ["", *doc_block(key, "power", power), ""]
    return "\n".join(lines)


def joined_markdown(task: str, designs: list[tuple[Plan, list[dict], dict]]) -> str:
    """The questions that span designs (the 200-step study and the longer runs of its harsher
    condition), for one task: "which loss for which staleness" over every stale condition, and
    the frontier question "is there a method never worse and better than GRPO somewhere?". ``designs``: (plan,
    finished runs, chosen rates) per design; each design's drops pair with its own on-policy runs."""
    parts = [[r for r in main_runs(runs, plan, chosen) if r["task"] == task] for plan, runs, chosen in designs]
    missing, not_run = [], []
    for (plan, _, _), part in zip(designs, parts):
        have, planned = len(_cells(part)), plan.main_runs_per_task()
        if have < planned:
            missing.append(f"{have} of {planned} planned runs of `{plan.design}`")
        not_run += _not_run(plan, part)
    parts = [p for p in parts if p]
    names = ", ".join(f"`{plan.design}` ({plan.steps} steps)" for plan, runs, _ in designs if runs)
    lines = [
        f"### Task `{task}`, every stale condition of {names}",
        "",
        "**Which loss for which staleness**",
        "",
        *doc_block(task, "joined_choice", choice_markdown(choice_rows(*parts))),
        "",
        "**Each method against GEPO and GRPO**",
        "",
        *doc_block(task, "joined_verdicts", verdict_markdown(verdict_rows(*parts))),
        "",
        "**Is there a method whose drop is no larger than every other method's in every stale condition, and "
        "smaller than GRPO's in at least one?**",
        "",
        *doc_block(
            task,
            "joined_winner",
            dominance_markdown(dominance_rows(*parts), not_run)
            + (
                f"\n\n*Provisional: {'; '.join(missing)} are in the rows. A design's missing runs can change "
                "every verdict above, and a condition without rows is not in them at all.*"
                if missing
                else ""
            ),
        ),
        "",
    ]
    return "\n".join(lines)


def replicate_markdown(
    task: str, plan: Plan, this: list[dict], other: list[dict], this_sha: str, other_sha: str
) -> str:
    """``plan``'s drops from its pinned warm start (``this``) beside those from another build of the
    same recipe (``other``), per stale condition both ran, with Spearman's rho of the methods' mean
    drops between the two (:func:`research.study.analyse.replicate_rows`): a block ``replicate`` of
    ``doc_key(task, plan)``."""
    rows = [r for r in replicate_rows(this, other) if r["task"] == task]
    parts = []
    for r in rows:
        table = [
            f"| method | drop, `{this_sha[:8]}...` (seeds) | drop, `{other_sha[:8]}...` (seeds) |",
            "|---|---|---|",
        ]
        for algo, ours, n_ours, theirs, n_theirs in sorted(r["methods"], key=lambda m: (math.isnan(m[1]), m[1])):
            table.append(
                f"| {algo} | {_ci(ours, math.nan, math.nan)} ({n_ours}) | {_ci(theirs, math.nan, math.nan)} ({n_theirs}) |"
            )
        rho = (
            f"Spearman's rho of the {r['n_methods']} methods' mean drops between the two warm starts: "
            f"**{r['rho']:.2f}** (p {_p(r['rho_p'])})."
            if math.isfinite(r["rho"])
            else f"Fewer than 3 methods have drops from both warm starts ({r['n_methods']}): no rho."
        )
        parts += [f"`{r['delay']}` (sorted by the first column):", "", *table, "", rho, ""]
    if not rows:
        parts = ["No stale condition has drops from both warm starts."]
    return "\n".join(doc_block(doc_key(task, plan), "replicate", "\n".join(parts).rstrip()))


def _not_run(plan: Plan, runs: list[dict]) -> list[str]:
    """The plan's stale conditions without a single run among ``runs``."""
    ran = {condition_key(r["delay"]) for r in runs}
    return [str(d) for d in plan.delays if d != 0 and condition_key(d) not in ran]


def _cells(runs: list[dict]) -> set[tuple]:
    """The (method, condition, seed) cells that runs fill (a cell counted once)."""
    return {(r["algo"], str(r["delay"]), r["seed"]) for r in runs}


_BLOCK = re.compile(r"<!-- study:(\w+):(\w+) -->\n(?:.*?\n)??<!-- /study -->", re.S)  # may be empty


def doc_block(task: str, name: str, text: str) -> list[str]:
    """A generated section, between markers that :func:`update_doc` finds (HTML comments: invisible
    when the markdown is rendered)."""
    return [f"<!-- study:{task}:{name} -->", text, "<!-- /study -->"]


def update_doc(doc: Path, generated: str) -> list[str]:
    """Replace every ``<!-- study:<task>:<name> -->`` block of ``doc`` with the same block of
    ``generated`` (a ``study_<task>.md``), so the numbers a page quotes are the study's own output;
    returns the names replaced. A block the study did not produce raises, naming it, and leaves the
    page untouched."""
    fresh = {(m.group(1), m.group(2)): m.group(0) for m in _BLOCK.finditer(generated)}
    text = doc.read_text()
    wanted = [(m.group(1), m.group(2)) for m in _BLOCK.finditer(text)]
    missing = [f"{t}:{n}" for t, n in wanted if (t, n) not in fresh]
    if missing:
        raise ValueError(f"{doc}: blocks {missing} are not in the study's output (have {sorted(fresh)})")
    doc.write_text(_BLOCK.sub(lambda m: fresh[(m.group(1), m.group(2))], text))
    return [f"{t}:{n}" for t, n in wanted]


def write_outputs(
    out: Path,
    plan: Plan,
    per_run: list[dict],
    figures: bool = True,
    log=print,
    lr_table: list[dict] | None = None,
    chosen: dict | None = None,
    ws: dict | None = None,
) -> None:
    """Every output of a plan's finished runs (``per_run``, from :func:`research.study.rows.collect`) in
    ``out``, per task: ``table_<task>.md``, ``summary_<task>.csv``, ``runs_<task>.csv``,
    ``stability_<task>.md``, for the powered designs ``study_<task>.md``, and the figures
    (``figures_<task>/acc_vs_staleness.png``, ``kl_vs_weight_var.png``)."""
    chosen = chosen if chosen is not None else {}
    main = main_runs(per_run, plan, chosen)
    rows = summarize(main)
    for task in plan.tasks:
        mine = [r for r in rows if r["task"] == task]
        if not mine:
            continue
        md = markdown_table(mine)
        (out / f"table_{task}.md").write_text(md + "\n")
        with open(out / f"summary_{task}.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(mine[0].keys()))
            w.writeheader()
            w.writerows(mine)
        # one row per run, the seed-level numbers behind the summary (every rate tried)
        with open(out / f"runs_{task}.csv", "w", newline="") as fh:
            fields = ["task", "algo", *(["lr"] if multi_lr(plan) else []), "delay", "seed", *RUN_KEYS]
            w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
            w.writeheader()
            w.writerows(r for r in per_run if r["task"] == task)
        task_runs = [r for r in main if r["task"] == task]
        stable = stability_table(stability_rows(mine, task_runs))
        (out / f"stability_{task}.md").write_text(stable + "\n")
        log(f"\n## {task} answers ({TASKS[task].answer_format})\n{md}\n\nStability (sorted by drop):\n{stable}")
        if plan.design in ("powered", "dry", "powered_long"):
            section = study_markdown(task, plan, per_run, lr_table or [], chosen, ws)
            (out / f"study_{task}.md").write_text(section)
            log("\n" + section)
            if figures:
                staleness_figure(out / f"figures_{task}", task_runs)
                kl_variance_figure(out / f"figures_{task}", task_runs)
        elif figures:
            run_figures(out, task, task_runs, log)
