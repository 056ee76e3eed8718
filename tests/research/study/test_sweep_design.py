"""The powered sweep's pieces: staleness conditions mean what they say (through the real config and
replay's draw), rows make the study resumable, the learning-rate rule, paired comparisons."""

import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from research.study.analyse import (
    RUN_KEYS,
    choose_lrs,
    comparison_rows,
    design_mde,
    drop_rows,
    kl_variance_rows,
    run_numbers,
)
from research.study.figures import kl_variance_figure, method_styles, staleness_figure
from research.study.plan import (
    ALGOS,
    DESIGNS,
    LEGACY,
    PINNED_WARM_START_STEPS,
    POWERED,
    Plan,
    condition_key,
    condition_overrides,
    design_id,
    normalize_condition,
    parse_condition,
    run_dir,
    run_overrides,
)
from research.study.render import doc_block, glance_markdown, study_markdown, update_doc
from research.study.rows import append_row, collect, load_rows, make_row
from research.study.run import SECONDS_PER_EVAL_PROBLEM, SECONDS_PER_STEP_16, Sweep, estimate_seconds, progress_line
from tests.research.study.conftest import REPO, compose_cfg
from tests.research.study.test_sweep_table import _write_run
from tests.subsets import default_run_keeps


def _staleness(overrides: list[str], steps: int, seed: int = 0) -> list[int]:
    """The staleness replay mode trains step k on, for steps 0..steps-1 (replay's own rule)."""
    from recipe.gepo.sections import HeteroConfig
    from recipe.gepo.embedded.replay import draw_staleness
    from verl_ext.hetero.delay import DelaySchedule

    hetero = HeteroConfig.from_omegaconf(compose_cfg(overrides + ["hetero.mode=replay", f"hetero.seed={seed}"]).hetero)
    schedule = DelaySchedule(hetero.delay.build(), hetero.seed)
    return [draw_staleness(schedule, k, hetero.max_delay, available=k) for k in range(steps)]


def test_fixed_staleness_is_exactly_k_once_k_versions_exist():
    taus = _staleness(condition_overrides("fix16"), 60)
    assert taus[:16] == list(range(16)) and set(taus[16:]) == {16}


def test_uniform_staleness_covers_0_to_K_evenly():
    taus = _staleness(condition_overrides("uni8"), 2000)[8:]
    assert set(taus) == set(range(9))
    counts = [taus.count(k) for k in range(9)]
    assert max(counts) - min(counts) < 0.35 * len(taus) / 9  # about 221 each


def test_lognormal_and_on_policy_conditions():
    assert set(_staleness(condition_overrides(0), 50)) == {0}
    legacy, named = (_staleness(condition_overrides(c), 200) for c in (64, "logn64"))
    assert legacy == named and 5 < sum(legacy[64:]) / len(legacy[64:]) < 15  # median 8


@pytest.mark.parametrize("bad", ["fix0", "uniform8", "-3", "fix", 2.5])
def test_bad_conditions_are_refused(bad):
    with pytest.raises(ValueError, match="staleness condition"):
        parse_condition(bad)


def test_conditions_sort_and_normalise():
    labels = ["uni64", "fix16", 0, "logn64", "fix4", 8]
    assert sorted(labels, key=condition_key) == [0, "fix4", "fix16", "uni64", 8, "logn64"]
    assert normalize_condition("0") == 0 and normalize_condition("fix4") == "fix4"


def test_run_numbers_last_k_evaluations_and_realised_staleness():
    metrics = [{"step": 0, "eval/acc_mean": 0.1}]
    for s in range(1, 11):
        metrics.append(
            {"step": s, "hetero/staleness_mean": float(min(s - 1, 4)), "hetero/staleness_max": float(min(s - 1, 4))}
        )
        if s % 2 == 0:
            metrics.append({"step": s, "eval/acc_mean": s / 10})
    n = run_numbers(metrics, total_steps=10, last_evals=3)
    assert n["lq_mean"] == pytest.approx((0.6 + 0.8 + 1.0) / 3)
    assert n["staleness"] == pytest.approx((0 + 1 + 2 + 3 + 4 * 6) / 10) and n["staleness_max"] == 4.0
    assert math.isnan(n["clipfrac_pos"])  # not logged: NaN, not 0


def _plan(**kw):
    base = dict(
        tasks=["long"],
        algos=["gepo", "grpo_paper"],
        delays=[0, "fix4"],
        seeds=[0, 1, 2],
        steps=8,
        lr=1e-4,
        test_freq=2,
        eval_size=8,
        prompts=2,
        diagnostics_every=0,
        diagnostics_samples=1,
        last_evals=2,
        design="dry",
    )
    return Plan(**{**base, **kw})


def test_rows_resume_and_filter_by_design_and_warm_start(tmp_path):
    plan = _plan()
    d = run_dir(tmp_path, plan, "long", "gepo", 1e-4, "fix4", 1)
    _write_run(
        d, {0: 0.3, 2: 0.4, 4: 0.5, 6: 0.6, 8: 0.7}, {s: 0.01 for s in range(1, 9)}, {s: 0.1 for s in range(1, 9)}
    )
    rows = tmp_path / "rows.csv"
    append_row(rows, make_row(plan, "long", "gepo", 1e-4, "fix4", 1, d, "abc", 12.5))
    (r,) = load_rows(rows)
    assert (r["algo"], r["lr"], r["delay"], r["seed"], r["ws_sha256"]) == ("gepo", 1e-4, "fix4", 1, "abc")
    assert r["lq_mean"] == pytest.approx(0.65) and r["seconds"] == 12.5
    import shutil

    shutil.rmtree(d)  # the row alone keeps the run: a moved study does not re-run it
    (got,) = collect(tmp_path, plan, rows, {"long": "abc"})
    assert got["dir"] is None and got["lq_mean"] == pytest.approx(0.65)
    assert collect(tmp_path, plan, rows, {"long": "other warm start"}) == []
    assert collect(tmp_path, _plan(steps=9), rows, {"long": "abc"}) == []  # another design id


def test_lr_rule_prefers_the_smaller_rate_within_tolerance():
    plan = _plan(lr_grid=[5e-5, 1e-4, 2e-4], lr_seeds=[0, 1])
    scores = {
        ("gepo", 5e-5): [0.40, 0.42],
        ("gepo", 1e-4): [0.50, 0.52],
        ("gepo", 2e-4): [0.51, 0.52],
        ("grpo_paper", 5e-5): [0.40, 0.40],
        ("grpo_paper", 1e-4): [0.45, 0.47],
        ("grpo_paper", 2e-4): [0.60, 0.62],
    }
    per_run = [
        {"task": "long", "algo": a, "lr": lr, "delay": 0, "seed": s, "lq_mean": v}
        for (a, lr), vals in scores.items()
        for s, v in enumerate(vals)
    ]
    table, chosen = choose_lrs(per_run, plan)
    assert chosen == {"gepo": 1e-4, "grpo_paper": 2e-4}  # gepo: 1e-4 is within 0.01 of 2e-4's 0.515
    assert sum(r["chosen"] for r in table) == 2
    _, partial = choose_lrs([r for r in per_run if not (r["algo"] == "gepo" and r["lr"] == 2e-4)], plan)
    assert partial == {"grpo_paper": 2e-4}  # gepo's grid unfinished: no choice yet
    _, pinned = choose_lrs(per_run, _plan(lr_grid=[5e-5, 1e-4, 2e-4], lr_seeds=[0, 1], lrs={"gepo": 3e-5}))
    assert pinned["gepo"] == 3e-5


def test_comparison_rows_match_hand_computation():
    from scipy import stats

    rng = random.Random(0)
    lq = {}
    for s in range(5):
        for algo, drop in (("gepo", 0.10), ("grpo_paper", 0.02)):
            base = 0.5 + rng.gauss(0, 0.02)
            lq[(algo, 0, s)] = base
            lq[(algo, "fix4", s)] = base - drop + rng.gauss(0, 0.02)
    per_run = [
        {
            "task": "long",
            "algo": a,
            "lr": 1e-4,
            "delay": c,
            "seed": s,
            "lq_mean": v,
            "staleness": 3.0 if c else 0.0,
            "staleness_max": 4.0 if c else 0.0,
        }
        for (a, c, s), v in lq.items()
    ]
    rows = comparison_rows(per_run, "gepo")
    stale = next(r for r in rows if r["condition"] == "fix4")
    diffs = [
        (lq[("gepo", 0, s)] - lq[("gepo", "fix4", s)]) - (lq[("grpo_paper", 0, s)] - lq[("grpo_paper", "fix4", s)])
        for s in range(5)
    ]
    ref = stats.ttest_1samp(diffs, 0.0)
    assert stale["n_drop"] == 5 and stale["drop_diff"] == pytest.approx(sum(diffs) / 5)
    assert stale["drop_p"] == pytest.approx(ref.pvalue)
    assert (stale["drop_lo"], stale["drop_hi"]) == pytest.approx(tuple(ref.confidence_interval(0.95)))
    assert stale["staleness_mean"] == 3.0 and stale["staleness_max"] == 4.0 and stale["drop_mde"] > 0
    on = next(r for r in rows if r["condition"] == 0)
    assert on["n_drop"] == 0 and on["n_score"] == 5
    dm = design_mde(per_run, 5)
    assert dm["sigma"] > 0 and dm["mde_drop_diff"] > 2 * dm["sigma"]  # 5 seeds: MDE ~ 1.7 x (2 sigma)


def _drops_runs(drops: dict, seeds: int = 5, noise: float = 0.005, seed: int = 1) -> list[dict]:
    """Runs whose on-policy score is 0.5 and whose stale score is 0.5 - drop (+ noise), per
    (algo, condition) -> drop."""
    rng = random.Random(seed)
    runs = []
    for (algo, cond), drop in drops.items():
        for s in range(seeds):
            for c, value in ((0, 0.5), (cond, 0.5 - drop)):
                if c == 0 and any(r["algo"] == algo and r["delay"] == 0 and r["seed"] == s for r in runs):
                    continue
                runs.append(
                    {
                        "task": "long",
                        "algo": algo,
                        "lr": 1e-4,
                        "delay": c,
                        "seed": s,
                        "lq_mean": value + rng.gauss(0, noise),
                        "staleness": 1.0,
                        "staleness_max": 1.0,
                    }
                )
    return runs


def test_dominance_names_the_method_never_worse_and_better_than_grpo_somewhere():
    from research.study.analyse import dominance_rows
    from research.study.render import dominance_markdown

    drops = {
        ("grpo_paper", "fix4"): 0.00,
        ("grpo_paper", "fix64"): 0.10,
        ("gepo", "fix4"): 0.15,
        ("gepo", "fix64"): 0.07,
        ("gepo_tc", "fix4"): 0.00,
        ("gepo_tc", "fix64"): 0.05,
    }
    rows = {r["algo"]: r for r in dominance_rows(_drops_runs(drops))}
    assert rows["gepo_tc"]["wins"] and rows["gepo_tc"]["complete"] and rows["gepo_tc"]["beats_grpo_at"] == ["fix64"]
    assert rows["gepo_tc"]["significant_losses"] == []
    assert not rows["gepo"]["wins"] and ("fix4", "grpo_paper") in rows["gepo"]["significant_losses"]
    assert not rows["grpo_paper"]["wins"] and rows["grpo_paper"]["beats_grpo_at"] == []  # cannot beat itself
    assert "**Answer: yes -- gepo_tc.**" in dominance_markdown(list(rows.values()))
    # a method missing a condition is not complete, so it cannot win
    partial = {k: v for k, v in drops.items() if k != ("gepo_tc", "fix4")}
    rows = {r["algo"]: r for r in dominance_rows(_drops_runs(partial))}
    assert not rows["gepo_tc"]["complete"] and not rows["gepo_tc"]["wins"] and rows["gepo_tc"]["wins_so_far"]
    md = dominance_markdown(list(rows.values()))
    assert "**Answer: not decided yet.** On the comparisons made so far gepo_tc meets both conditions" in md
    assert "| not yet (incomplete) |" in md
    # without a method that meets both conditions on what is compared, the answer is no
    rows = {r["algo"]: r for r in dominance_rows(_drops_runs({**partial, ("gepo_tc", "fix64"): 0.10}))}
    assert not any(r["wins_so_far"] for r in rows.values())
    assert "**Answer: no** (no method meets both conditions on the rows so far)." in dominance_markdown(
        list(rows.values())
    )
    # every method compared with every other everywhere: the no is not provisional
    rows = dominance_rows(_drops_runs({**drops, ("gepo_tc", "fix64"): 0.10}))
    assert all(r["complete"] for r in rows) and not any(r["wins"] for r in rows)
    assert "**Answer: no** (no method meets both conditions)." in dominance_markdown(rows)


def test_dominance_says_whether_the_win_over_grpo_survives_holm():
    """One uncorrected p of ~0.025 in three stale conditions: a win by the rule, which Holm's
    adjustment (x3 for the smallest p) does not keep; a clear win (p ~1e-5) it keeps."""
    from scipy import stats

    from research.study.analyse import dominance_rows
    from research.study.render import dominance_markdown

    spread = [0.015, -0.015, 0.01, -0.01, 0.0]  # mean 0, sd 0.0127

    def runs(advantage_at_fix64: float) -> list[dict]:
        out = []
        for s, e in enumerate(spread):
            for algo in ("grpo_paper", "m"):
                out.append(
                    {
                        "task": "long",
                        "algo": algo,
                        "lr": 1e-4,
                        "delay": 0,
                        "seed": s,
                        "lq_mean": 0.5,
                        "staleness": 0.0,
                        "staleness_max": 0.0,
                    }
                )
                for cond in ("fix4", "fix16", "fix64"):
                    lq = 0.4 if algo == "grpo_paper" else 0.4 + e + (advantage_at_fix64 if cond == "fix64" else 0.0)
                    out.append(
                        {
                            "task": "long",
                            "algo": algo,
                            "lr": 1e-4,
                            "delay": cond,
                            "seed": s,
                            "lq_mean": lq,
                            "staleness": 1.0,
                            "staleness_max": 1.0,
                        }
                    )
        return out

    weak = {r["algo"]: r for r in dominance_rows(runs(0.02))}["m"]
    p = stats.ttest_1samp([0.02 + e for e in spread], 0.0).pvalue
    assert 0.05 / 3 < p < 0.05  # significant alone, not after x3
    assert weak["wins"] and weak["beats_grpo_at"] == ["fix64"] and weak["beats_grpo_holm_at"] == []
    assert "rests on uncorrected tests" in dominance_markdown([weak])
    clear = {r["algo"]: r for r in dominance_rows(runs(0.1))}["m"]
    assert clear["wins"] and clear["beats_grpo_holm_at"] == ["fix64"]
    assert "keeps m's smaller drop than GRPO's at fix64." in dominance_markdown([clear])


def test_dominance_spans_designs_each_paired_with_its_own_on_policy_runs():
    """The 600-step fix256 runs join the 200-step study: a method must be no worse there too, and
    its drop there is measured from the 600-step on-policy runs, not the 200-step ones."""
    from research.study.analyse import dominance_rows

    short = {("grpo_paper", "fix64"): 0.10, ("gepo_tc", "fix64"): 0.05}
    long = {("grpo_paper", "fix256"): 0.05, ("gepo_tc", "fix256"): 0.20}
    rows = {r["algo"]: r for r in dominance_rows(_drops_runs(short))}
    assert rows["gepo_tc"]["wins"]
    joined = _drops_runs(long, seed=2)
    for r in joined:  # a different on-policy level: pairing across designs would move every drop by 0.3
        r["lq_mean"] += 0.3
    rows = {r["algo"]: r for r in dominance_rows(_drops_runs(short), joined)}
    assert rows["gepo_tc"]["complete"] and not rows["gepo_tc"]["wins"]
    assert rows["gepo_tc"]["significant_losses"] == [("fix256", "grpo_paper")]
    assert rows["grpo_paper"]["significant_losses"] == [("fix64", "gepo_tc")]
    # a method run in one design only is not complete
    rows = {r["algo"]: r for r in dominance_rows(_drops_runs(short), _drops_runs({("grpo_paper", "fix256"): 0.05}))}
    assert not rows["gepo_tc"]["complete"] and not rows["gepo_tc"]["wins"]
    with pytest.raises(ValueError, match="'fix64'.*two of the joined designs"):
        dominance_rows(_drops_runs(short), _drops_runs(short))


def test_choice_rows_name_the_best_and_the_methods_not_significantly_worse():
    from research.study.analyse import choice_rows, recommended
    from research.study.render import choice_markdown

    drops = {
        ("gepo", "fix4"): 0.15,
        ("grpo_paper", "fix4"): 0.0,
        ("gspo", "fix4"): 0.003,
        ("gepo", "fix64"): 0.07,
        ("grpo_paper", "fix64"): 0.072,
        ("gspo", "fix64"): 0.20,
    }
    runs = _drops_runs(drops, noise=0.005)
    for r in runs:  # gspo starts higher on-policy: best score at fix4 but not the smallest drop
        if r["algo"] == "gspo":
            r["lq_mean"] += 0.02
    rows = {r["condition"]: r for r in choice_rows(runs)}
    assert list(rows) == ["fix4", "fix64"]
    fix4, fix64 = rows["fix4"], rows["fix64"]
    assert fix4["best_score"] == "gspo" and fix4["tied_score"] == ["gspo"]  # 0.02 over 0.005 noise: significant
    assert fix4["best_drop"] == "grpo_paper" and fix4["tied_drop"] == ["grpo_paper", "gspo"]
    assert fix64["best_drop"] == "gepo" and sorted(fix64["tied_drop"]) == ["gepo", "grpo_paper"]
    assert fix64["drop"]["gspo"][0] == pytest.approx(0.20, abs=0.01)
    lq = {(r["algo"], r["delay"], r["seed"]): r["lq_mean"] for r in runs}
    assert fix4["score"]["gepo"] == pytest.approx(sum(lq[("gepo", "fix4", s)] for s in range(5)) / 5)
    assert recommended(list(rows.values()))[0][0] in {"gepo", "grpo_paper", "gspo"}
    md = choice_markdown(list(rows.values()))
    line = next(l for l in md.splitlines() if l.startswith("| `fix4` |"))
    assert "| gspo 0." in line and f"| none | grpo_paper {fix4['drop']['grpo_paper'][0]:+.3f} [" in line
    assert "| gspo |" in line  # the drop not significantly larger than grpo_paper's
    counts = dict(recommended(list(rows.values())))
    leaders = [a for a, n in counts.items() if n == max(counts.values())]
    assert f"**{', '.join(leaders)}**" in md and f"in {max(counts.values())} of the 2 stale conditions:" in md
    # a condition with one seed so far: nothing tested there, said so, and it counts for no method
    one_seed = runs + [
        r | {"delay": "fix256", "lq_mean": r["lq_mean"] - 0.1} for r in runs if r["delay"] == "fix64" and r["seed"] == 0
    ]
    rows = {r["condition"]: r for r in choice_rows(one_seed)}
    assert rows["fix256"]["seeds"] == 1 and rows["fix256"]["tied_score"] is None and rows["fix256"]["tied_drop"] is None
    assert dict(recommended(list(rows.values()))) == counts
    md = choice_markdown(list(rows.values()))
    line = next(l for l in md.splitlines() if l.startswith("| `fix256` |"))
    assert line.count("untested (1 seed)") == 2
    assert "of the 2 stale conditions with two seeds or more:" in md
    # a second seed for two of the three methods: the third is named as untested, not left out silently
    two_seeds = one_seed + [
        r | {"delay": "fix256", "lq_mean": r["lq_mean"] - 0.1}
        for r in runs
        if r["delay"] == "fix64" and r["seed"] == 1 and r["algo"] != "gspo"
    ]
    rows = {r["condition"]: r for r in choice_rows(two_seeds)}
    assert rows["fix256"]["seeds"] == 2 and rows["fix256"]["untested"] == ["gspo"]
    assert "gspo" not in rows["fix256"]["tied_score"] + rows["fix256"]["tied_drop"]
    line = next(l for l in choice_markdown(list(rows.values())).splitlines() if l.startswith("| `fix256` |"))
    assert line.count("(one seed, untested: gspo)") == 2
    assert rows["fix4"]["untested"] == []
    # a one-seed method is never the best, however high its one score
    lifted = [r | {"lq_mean": 0.99} if r["algo"] == "gspo" and r["delay"] == "fix256" else r for r in two_seeds]
    rows = {r["condition"]: r for r in choice_rows(lifted)}
    assert rows["fix256"]["best_score"] != "gspo" and rows["fix256"]["best_drop"] != "gspo"


def test_verdicts_give_each_method_minus_the_reference_with_its_sign():
    from research.study.analyse import verdict_rows
    from research.study.render import verdict_markdown

    drops = {
        ("gepo", "fix4"): 0.15,
        ("grpo_paper", "fix4"): 0.0,
        ("m2po", "fix4"): 0.05,
        ("gepo", "fix64"): 0.07,
        ("grpo_paper", "fix64"): 0.071,
        ("m2po", "fix64"): 0.075,
    }
    rows = {(r["algo"], r["against"], r["condition"]): r for r in verdict_rows(_drops_runs(drops))}
    assert rows[("m2po", "gepo", "fix4")]["verdict"] == "smaller"
    assert rows[("m2po", "gepo", "fix4")]["diff"] == pytest.approx(-0.10, abs=0.01)
    assert rows[("m2po", "grpo_paper", "fix4")]["verdict"] == "larger"
    assert rows[("m2po", "grpo_paper", "fix4")]["lo"] > 0
    assert rows[("gepo", "grpo_paper", "fix64")]["verdict"] == "no difference"
    assert ("gepo", "gepo", "fix4") not in rows
    md = verdict_markdown(list(rows.values()))
    assert md.index("Against gepo") < md.index("Against grpo_paper")
    m2po = [l for l in md.splitlines() if l.startswith("| m2po | ")]
    first = rows[("m2po", "gepo", "fix4")]
    assert len(m2po) == 2 and m2po[0].startswith(f"| m2po | smaller: {first['diff']:+.3f} [{first['lo']:+.3f}, ")


def test_joined_section_keeps_each_designs_blocks_apart():
    from research.study.render import doc_key, joined_markdown

    short, long = _plan(steps=200, design="powered"), _plan(steps=600, delays=[0, "fix256"], design="powered_long")
    assert doc_key("long", short) == "long" and doc_key("long", long) == "long_powered_long"
    runs_short = _drops_runs({("gepo", "fix4"): 0.1, ("grpo_paper", "fix4"): 0.0})
    runs_long = _drops_runs({("gepo", "fix256"): 0.1, ("grpo_paper", "fix256"): 0.2})
    for r in runs_long:
        r["steps"] = 600
    md = joined_markdown("long", [(short, runs_short, {}), (long, runs_long, {})])
    assert "<!-- study:long:joined_choice -->" in md and "<!-- study:long:joined_winner -->" in md
    assert "| `fix4` |" in md and "| `fix256` (600 steps) |" in md
    assert "`powered` (200 steps), `powered_long` (600 steps)" in md


def test_joined_answer_is_marked_provisional_until_every_planned_run_is_in():
    from research.study.render import joined_markdown

    seeds = [0, 1, 2, 3, 4]
    short = _plan(steps=200, design="powered", seeds=seeds)
    long = _plan(steps=600, delays=[0, "fix256"], design="powered_long", seeds=seeds)
    runs_short = _drops_runs({("gepo", "fix4"): 0.1, ("grpo_paper", "fix4"): 0.0})
    runs_long = _drops_runs({("gepo", "fix256"): 0.1, ("grpo_paper", "fix256"): 0.2})

    def winner_block(long_runs):
        md = joined_markdown("long", [(short, runs_short, {}), (long, long_runs, {})])
        return md[md.index("<!-- study:long:joined_winner -->") :]

    assert "Provisional" not in winner_block(runs_long)  # 20 of 20 planned cells of each design
    partial = winner_block([r for r in runs_long if r["seed"] < 3])
    assert "*Provisional: 12 of 20 planned runs of `powered_long` are in the rows." in partial
    assert partial.index("**Answer:") < partial.index("Provisional") < partial.index("<!-- /study -->")
    # a design with no rows yet: its condition is in no verdict, and the answer says so
    assert "*Provisional: 0 of 20 planned runs of `powered_long`" in winner_block([])


def test_joined_answer_is_not_yes_while_a_planned_condition_has_no_run():
    """A method that wins on the 200-step conditions is no winner while fix256 has no run at all."""
    from research.study.render import joined_markdown

    short = _plan(steps=200, design="powered", seeds=[0, 1, 2, 3, 4])
    long = _plan(steps=600, delays=[0, "fix256"], design="powered_long", seeds=[0, 1, 2, 3, 4])
    runs_short = _drops_runs(
        {
            ("grpo_paper", "fix4"): 0.00,
            ("grpo_paper", "fix64"): 0.10,
            ("gepo_tc", "fix4"): 0.00,
            ("gepo_tc", "fix64"): 0.05,
        }
    )
    runs_long = _drops_runs({("gepo_tc", "fix256"): 0.1, ("grpo_paper", "fix256"): 0.1})
    done = joined_markdown("long", [(short, runs_short, {}), (long, runs_long, {})])
    assert "**Answer: yes -- gepo_tc.**" in done
    waiting = joined_markdown("long", [(short, runs_short, {}), (long, [], {})])
    assert "**Answer: yes" not in waiting and "Holm" not in waiting.split("**Answer:")[1]
    assert "| **yes** |" not in waiting and "| not yet (a condition not run) |" in waiting
    assert (
        "**Answer: not decided yet.** On the conditions run so far gepo_tc meets both conditions, but `fix256` "
        "(planned) has no runs yet." in waiting
    )


def test_an_unbeaten_method_is_not_a_no_while_a_planned_condition_has_no_run():
    """No method beats GRPO on what ran, but two are beaten by none: a planned condition without
    runs could still make one win, so neither the answer nor their rows say no."""
    from research.study.analyse import dominance_rows
    from research.study.render import dominance_markdown

    drops = {("grpo_paper", "fix4"): 0.05, ("gepo_tc", "fix4"): 0.05, ("gepo", "fix4"): 0.20}
    rows = dominance_rows(_drops_runs(drops))
    assert "**Answer: no**" in dominance_markdown(rows)
    md = dominance_markdown(rows, ["fix256"])
    assert (
        "**Answer: not decided yet.** No method meets both conditions on the conditions run so far; "
        "gepo_tc, grpo_paper are beaten by no other method so far, and `fix256` (planned) has no runs yet." in md
    )
    assert "| gepo | " in md and md.split("| gepo | ")[1].split("\n")[0].endswith("| no |")  # beaten: no, whatever runs
    assert md.split("| gepo_tc | ")[1].split("\n")[0].endswith("| not yet (a condition not run) |")


def test_join_is_refused_outside_table_only(tmp_path):
    cli = [
        sys.executable,
        "-m",
        "research.study.delay_sweep",
        "--design",
        "powered",
        "--join",
        "powered_long",
        "--out",
        str(tmp_path / "o"),
    ]
    proc = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--join powered_long: only with --table-only" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_study_markdown_has_every_section(tmp_path):
    plan = _plan(lr_grid=[1e-4], lr_seeds=[0])
    per_run = [
        {
            "task": "long",
            "algo": a,
            "lr": 1e-4,
            "delay": c,
            "seed": s,
            "lq_mean": 0.4 + 0.01 * s - (0.05 if c else 0),
            **{k: math.nan for k in RUN_KEYS if k != "lq_mean"},
        }
        for a in ("gepo", "grpo_paper")
        for c in (0, "fix4")
        for s in range(3)
    ]
    table, chosen = choose_lrs(per_run, plan)
    md = study_markdown("long", plan, per_run, table, chosen, {"long": "f" * 64})
    for needle in (
        "weights sha256 `" + "f" * 64,
        "**Learning rates**",
        "**Drops from on-policy**",
        "**Paired differences, gepo minus each baseline**",
        "| fix4 |",
        "**Power of the design.**",
        "**Importance-weight variance against KL**",
        "**At a glance**",
    ):
        assert needle in md, needle
    assert Path(staleness_figure(tmp_path / "fig", per_run)).is_file()
    assert Path(kl_variance_figure(tmp_path / "fig", per_run)).is_file()  # NaN KL everywhere: an empty plot


def test_every_method_of_the_study_has_its_own_style_in_the_figures():
    # 14 methods: matplotlib's default colour cycle repeats after 10, so two methods shared a colour
    from research.study.plan import DESIGNS

    algos = DESIGNS["powered"]["algos"]
    styles = method_styles(list(reversed(algos)))
    assert len(algos) >= 14 and sorted(styles) == sorted(algos)
    assert len({s["color"] for s in styles.values()}) == len(algos)
    assert styles == method_styles(algos[:3] + algos[3:])  # the same style whatever the order given


def test_glance_matrices_hold_each_methods_score_drop_and_paired_difference():
    rng = random.Random(3)
    per_run, lq = [], {}
    for a, drop in (("gepo", 0.10), ("grpo_paper", 0.02), ("gspo", 0.05)):
        for s in range(4):
            base = 0.5 + rng.gauss(0, 0.02)
            for c, v in ((0, base), ("fix16", base - drop + rng.gauss(0, 0.01))):
                lq[(a, c, s)] = v
                per_run.append(
                    {
                        "task": "long",
                        "algo": a,
                        "delay": c,
                        "seed": s,
                        "lq_mean": v,
                        "kl": drop if c else 0.0,
                        "weight_wrong": 1 - 3 * drop if c else 1.0,
                        "staleness": 15.3 if c else 0.0,
                        "staleness_max": 16.0 if c else 0.0,
                    }
                )
    md = glance_markdown(per_run, drop_rows(per_run), {"gepo": comparison_rows(per_run, "gepo")})
    lines = md.splitlines()
    gepo_drop = sum(lq[("gepo", 0, s)] - lq[("gepo", "fix16", s)] for s in range(4)) / 4
    diff = gepo_drop - sum(lq[("grpo_paper", 0, s)] - lq[("grpo_paper", "fix16", s)] for s in range(4)) / 4
    assert "| realised staleness mean / max | 0.0 / 0 | 15.3 / 16 |" in lines
    assert any(l.startswith("| gepo | - | " + f"{gepo_drop:+.3f} [") for l in lines)
    assert any(l.startswith("| grpo_paper | " + f"{diff:+.3f} [") and ", p " in l for l in lines)
    assert any(l.startswith("| gepo | ") and "(4)" in l for l in lines)  # the seed count beside each score
    # the drop ranks with KL here (KL = the planted drop): rho 1 over the 3 stale cells
    assert "Across the 3 stale (method, condition) cells" in md and "mean KL(sampler ‖ learner): rho = 1.00" in md
    # and against the weight left on wrong answers (planted: 1 - 3 x drop): rho -1
    assert "weight on wrong answers' gradients (relative to REINFORCE): rho = -1.00" in md


def test_kl_variance_rows_correlate_each_methods_runs():
    """Per method: Pearson and Spearman over its runs (scipy's values), the on-policy variance and
    the condition with the highest mean KL; a method whose variance does not move gets no r."""
    from scipy import stats

    rng = random.Random(1)
    per_run = []
    for c, kl in ((0, 0.0), ("fix4", 0.01), ("fix16", 0.05), ("uni64", 0.03)):
        for s in range(4):
            k = kl * (1 + 0.1 * rng.random())
            per_run.append(
                {"algo": "grpo_paper", "delay": c, "seed": s, "kl": k, "var": 2.0 * k + 0.001 * rng.random()}
            )
            per_run.append({"algo": "gepo", "delay": c, "seed": s, "kl": k, "var": 0.03})  # flat
    per_run.append({"algo": "gepo", "delay": "fix4", "seed": 9, "kl": math.nan, "var": 0.03})  # skipped
    rows = {r["algo"]: r for r in kl_variance_rows(per_run)}
    grpo = [r for r in per_run if r["algo"] == "grpo_paper"]
    x, y = [r["kl"] for r in grpo], [r["var"] for r in grpo]
    assert rows["grpo_paper"]["n"] == 16
    assert rows["grpo_paper"]["pearson_r"] == pytest.approx(stats.pearsonr(x, y).statistic)
    assert rows["grpo_paper"]["spearman_p"] == pytest.approx(stats.spearmanr(x, y).pvalue)
    assert rows["grpo_paper"]["pearson_r"] > 0.99 and rows["grpo_paper"]["top_condition"] == "fix16"
    assert rows["grpo_paper"]["var_top"] > rows["grpo_paper"]["var_on_policy"]
    assert rows["gepo"]["n"] == 16 and math.isnan(rows["gepo"]["pearson_r"]) and rows["gepo"]["var_on_policy"] == 0.03


def test_budget_estimate_uses_finished_runs_else_the_measured_defaults():
    plan = _plan(steps=200, test_freq=20, eval_size=512, prompts=16)
    secs, how = estimate_seconds(plan, [])
    assert secs == pytest.approx(200 * SECONDS_PER_STEP_16 + 11 * 512 * SECONDS_PER_EVAL_PROBLEM)
    assert "measured defaults" in how
    secs, how = estimate_seconds(plan, [{"seconds": 100.0}, {"seconds": 300.0}, {"seconds": 200.0}])
    assert secs == 200.0 and "3 finished runs; 100-300 s, 0.2 worker-hours in all" in how


def test_a_design_without_runs_estimates_from_the_design_it_takes_rates_from():
    """The long design's first estimate: the 200-step design's median run less its evaluations,
    per step, times 600 steps, plus the long design's evaluations."""
    short = _plan(steps=200, test_freq=20, eval_size=512, prompts=16, design="powered")
    long = _plan(steps=600, test_freq=40, eval_size=512, prompts=16, design="powered_long")
    short_evals = 11 * 512 * SECONDS_PER_EVAL_PROBLEM
    runs = [{"seconds": 100.0 + short_evals}, {"seconds": 140.0 + short_evals}, {"seconds": 120.0 + short_evals}]
    secs, how = estimate_seconds(long, [], (short, runs))
    assert secs == pytest.approx(600 * 0.6 + 16 * 512 * SECONDS_PER_EVAL_PROBLEM)
    assert "3 finished runs of --design powered" in how
    assert estimate_seconds(long, [{"seconds": 5.0}], (short, runs))[0] == 5.0  # its own runs, once it has some
    other_batch = _plan(steps=600, test_freq=40, eval_size=512, prompts=8)
    assert "measured defaults" in estimate_seconds(other_batch, [], (short, runs))[1]


def test_the_outline_counts_each_stage_2_run_left_once(tmp_path):
    """Stage 1's on-policy runs at the chosen rate are stage-2 runs too: counted once (they were
    subtracted twice: the count said 118 where 145 runs were left); rows of other methods count
    for nothing."""
    plan = _plan(lr_grid=[1e-4, 2e-4], lr_seeds=[0, 1])
    rows = [
        {"task": "long", "algo": "gepo", "lr": lr, "delay": 0, "seed": seed, "lq_mean": score, "dir": None}
        for lr, score in [(1e-4, 0.3), (2e-4, 0.5)]
        for seed in (0, 1)
    ]
    rows.append({"task": "long", "algo": "gepo", "lr": 2e-4, "delay": "fix4", "seed": 0, "lq_mean": 0.4, "dir": None})
    rows.append({"task": "long", "algo": "gspo", "lr": 1e-4, "delay": "fix4", "seed": 1, "lq_mean": 0.4, "dir": None})
    sweep = Sweep(plan, tmp_path, tmp_path / "rows.csv", {"long": "x"}, {"long": "h"}, workers=2)
    line = sweep.outline(rows)
    # stage 1: grpo_paper's 4 runs; stage 2: gepo 6 - 2 (stage 1) - 1 (fix4 s0), grpo_paper 6 - 2 (stage 1 will make)
    assert "stage 1 (learning rates, on-policy) 4 runs to do of 8" in line
    assert "stage 2 (conditions x seeds) 7 runs to do of 12" in line


def test_the_plan_says_how_far_each_seed_is(tmp_path):
    """Per seed, stage 2's finished runs of the methods with a rate; a row of another rate or
    method counts for nothing."""
    plan = _plan(lrs={"gepo": 1e-4, "grpo_paper": 1e-4})
    rows = [
        {"task": "long", "algo": algo, "lr": 1e-4, "delay": delay, "seed": 0, "lq_mean": 0.5, "dir": None}
        for algo in ("gepo", "grpo_paper")
        for delay in (0, "fix4")
    ]
    rows.append({"task": "long", "algo": "gepo", "lr": 1e-4, "delay": 0, "seed": 1, "lq_mean": 0.5, "dir": None})
    rows.append({"task": "long", "algo": "gepo", "lr": 2e-4, "delay": "fix4", "seed": 1, "lq_mean": 0.5, "dir": None})
    rows.append({"task": "long", "algo": "gspo", "lr": 1e-4, "delay": 0, "seed": 2, "lq_mean": 0.5, "dir": None})
    sweep = Sweep(plan, tmp_path, tmp_path / "rows.csv", {"long": "x"}, {"long": "h"}, workers=2)
    assert sweep.seed_progress(rows) == "stage 2 by seed: 0 4/4, 1 1/4, 2 0/4"


def test_powered_design_meets_the_issue_minimums():
    """The powered design's minimums: >= 512 evaluation problems, >= 5 evaluations averaged, >= 5 seeds, >= 200
    steps; conditions 0, 4, 16, 64 with fixed and uniform staleness."""
    p = POWERED
    assert p["eval_size"] >= 512 and p["last_evals"] >= 5 and len(p["seeds"]) >= 5 and p["steps"] >= 200
    assert p["steps"] // p["test_freq"] >= p["last_evals"]
    assert {0, "fix4", "fix16", "fix64", "uni64", "logn64"} <= set(p["delays"])
    # the paper's baselines and the project's variant (verl's dual-clip grpo and gepo_adaptive were cut for the budget)
    assert {"gepo", "grpo_paper", "gspo_wide", "gspo", "gepo_tr"} <= set(p["algos"]) and len(p["lr_grid"]) >= 2


def test_designs_that_run_start_from_the_pinned_warm_start_and_keep_their_ids():
    """quick, powered and dry run from the pinned warm start (210 steps); the legacy design has none.
    The committed rows of the powered study carry its design id, so it must not move."""
    steps = {name: Plan(**design).warm_start_steps for name, design in DESIGNS.items()}
    assert steps == {"legacy": 0, "quick": PINNED_WARM_START_STEPS, "powered": 210, "powered_long": 210, "dry": 210}
    assert {Plan(**design).design for design in DESIGNS.values()} == set(DESIGNS)
    ids = {"powered": "19c6d7171502", "powered_long": "5ca4cb33ca5b"}
    assert {name: design_id(Plan(**DESIGNS[name])) for name in ids} == ids
    rows = load_rows(REPO / "docs" / "study_data" / "rows_powered.csv")
    assert {r["design_id"] for r in rows} <= set(ids.values())
    assert (
        sum(r["design_id"] == ids["powered"] for r in rows) >= 180
    )  # the first study's rows stay; the frontier's join them


# by default: a preset alone, a preset with a loss override, a preset with an estimator override, a rollout-correction preset
@pytest.mark.parametrize("algo", default_run_keeps(list(ALGOS), ("gepo", "gepo_adaptive", "gepo_std", "grpo_tis")))
def test_run_overrides_pass_the_entrys_checks(algo, tmp_path, capsys):
    """Each algorithm's run overrides compose with recipe/gepo/config and pass
    ``recipe.gepo.main_gepo.run_local``'s checks (``hetero.dry_run=true``: the checks, no training)."""
    from recipe.gepo.main_gepo import run_local

    plan = Plan(**POWERED)
    overrides = run_overrides(plan, "long", algo, "uni64", 0, str(tmp_path / "model"), tmp_path / "run", 2e-4)
    assert not [o for o in overrides if o.startswith("task.warm_start")]  # the model path is the warm start
    cfg = compose_cfg(overrides + ["hetero.dry_run=true"])
    assert cfg.actor_rollout_ref.actor.optim.lr == 2e-4 and cfg.hetero.max_delay == 64
    assert run_local(cfg) == {}


def test_the_entrys_checks_refuse_an_unregistered_loss(tmp_path):
    from recipe.gepo.main_gepo import run_local

    overrides = run_overrides(Plan(**POWERED), "long", "gepo", 0, 0, str(tmp_path / "model"), tmp_path / "run")
    cfg = compose_cfg(overrides + ["actor_rollout_ref.actor.policy_loss.loss_mode=no_such_loss", "hetero.dry_run=true"])
    with pytest.raises(ValueError, match="no_such_loss"):
        run_local(cfg)


def test_the_legacy_design_is_tabulated_but_never_run(tmp_path):
    """Its accuracy-window warm start is gone: running it fails in one line naming it; its rows
    still make its tables (figures skip runs known from a row alone)."""
    cli = [sys.executable, "-m", "research.study.delay_sweep", "--design", "legacy"]
    proc = subprocess.run(cli + ["--out", str(tmp_path / "ran")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--design legacy is table-only" in proc.stderr and "warm start" in proc.stderr
    assert not (tmp_path / "ran").exists()
    rows = tmp_path / "rows.csv"
    for delay, score in ((0, 0.5), (64, 0.25)):
        append_row(
            rows,
            {
                "task": "long",
                "algo": "gepo",
                "lr": 1e-4,
                "delay": delay,
                "seed": 0,
                "steps": 60,
                "design_id": design_id(Plan(**LEGACY)),
                "ws_sha256": "",
                "seconds": 1.0,
                "best": score,
                "last": score,
                "lq_mean": score,
            },
        )
    out = tmp_path / "tables"
    proc = subprocess.run(
        cli + ["--out", str(out), "--rows", str(rows), "--table-only", "--tasks", "long", "--algos", "gepo"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (out / "table_long.md").read_text()
    assert "| gepo | 0 | 1 | 0.500 |" in table and "| gepo | 64 | 1 | 0.250 | 0.250 | 0.250 | - | 0.250 |" in table


def test_update_doc_replaces_the_pages_study_blocks_and_refuses_unknown_ones(tmp_path):
    generated = "\n".join(
        [
            "# study",
            *doc_block("long", "glance", "| new | table |"),
            "text",
            *doc_block("long", "power", "**Power** 0.064"),
        ]
    )
    page = tmp_path / "results.md"
    page.write_text("intro\n" + "\n".join(doc_block("long", "glance", "| old |\n| rows |")) + "\nprose 0.1\n")
    assert update_doc(page, generated) == ["long:glance"]
    assert page.read_text() == "intro\n<!-- study:long:glance -->\n| new | table |\n<!-- /study -->\nprose 0.1\n"
    # empty blocks, as a new page has: each is filled, none swallows the prose up to the next one
    page.write_text(
        "a\n<!-- study:long:glance -->\n<!-- /study -->\nprose\n<!-- study:long:power -->\n<!-- /study -->\n"
    )
    assert update_doc(page, generated) == ["long:glance", "long:power"]
    assert page.read_text() == (
        "a\n<!-- study:long:glance -->\n| new | table |\n<!-- /study -->\nprose\n"
        "<!-- study:long:power -->\n**Power** 0.064\n<!-- /study -->\n"
    )
    before = page.read_text() + "\n".join(doc_block("short", "glance", "x")) + "\n"
    page.write_text(before)
    with pytest.raises(ValueError, match="short:glance"):
        update_doc(page, generated)
    assert page.read_text() == before  # nothing half-written


def test_progress_line_gives_the_time_left_at_the_stage_pace():
    # 4 of 10 runs done in 2 h of this stage: 6 more at 0.5 h each
    line = progress_line(4, 10, "runs/long/gepo@5e-05/dfix256/s1", 470.4, "", 9000.0, 7200.0)
    assert line == "[4/10] runs/long/gepo@5e-05/dfix256/s1 470s (elapsed 9000s, ~3.0 h left)"
    assert progress_line(10, 10, "r", 1.0, "", 5.0, 5.0).endswith("~0.0 h left)")
    assert "FAILED exit 1 (elapsed" in progress_line(1, 2, "r", 3.0, "exit 1", 5.0, 5.0)
