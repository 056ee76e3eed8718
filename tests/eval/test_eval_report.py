"""Best/Last on synthetic histories, history formats, and the paper-style table."""

from __future__ import annotations

import json
import random

import pytest

from verl_ext.eval.report import EvalPoint, best_last, best_last_table, load_history, main

BENCHES = ("amc23", "aime24", "aime25", "math500")


def _synthetic(seed: int, n_evals: int = 9) -> list[EvalPoint]:
    rng = random.Random(seed)
    return [EvalPoint(step=128 * (i + 1), scores={b: round(rng.random(), 4) for b in BENCHES}) for i in range(n_evals)]


def test_best_last_by_direct_computation():
    hist = _synthetic(0)
    shuffled = hist[:]
    random.Random(1).shuffle(shuffled)  # order of entries must not matter, steps decide
    res = best_last(shuffled)
    assert list(res["benchmarks"]) == list(BENCHES)  # the paper's column order
    final = max(hist, key=lambda p: p.step)
    for b in BENCHES:
        vals = [(p.scores[b], p.step) for p in hist]
        best = max(v for v, _ in vals)
        assert res["benchmarks"][b]["best"] == best
        assert res["benchmarks"][b]["best_step"] == min(s for v, s in vals if v == best)
        assert res["benchmarks"][b]["last"] == final.scores[b]
        assert res["benchmarks"][b]["n_evals"] == len(hist)
    avgs = [sum(p.scores.values()) / 4 for p in hist]
    assert res["average"]["best"] == pytest.approx(max(avgs))
    assert res["average"]["last"] == pytest.approx(sum(final.scores.values()) / 4)
    assert res["average"]["gap"] == pytest.approx(max(avgs) - res["average"]["last"])
    mob = sum(max(p.scores[b] for p in hist) for b in BENCHES) / 4
    assert res["average"]["mean_of_best"] == pytest.approx(mob)
    assert res["average"]["mean_of_best"] >= res["average"]["best"] - 1e-12


def test_average_only_over_complete_evaluations():
    hist = [
        EvalPoint(0, {"math500": 0.2, "aime24": 0.0}),
        EvalPoint(10, {"math500": 0.9}),  # aime24 not evaluated here
        EvalPoint(20, {"math500": 0.4, "aime24": 0.2}),
    ]
    res = best_last(hist)
    assert res["benchmarks"]["math500"] == {"best": 0.9, "best_step": 10, "last": 0.4, "last_step": 20, "n_evals": 3}
    assert res["benchmarks"]["aime24"]["n_evals"] == 2
    assert res["average"]["best"] == pytest.approx(0.3)  # step 20; step 10 has no average
    assert res["average"]["last_step"] == 20
    with pytest.raises(ValueError, match="amc23"):
        best_last(hist, ["math500", "amc23"])
    with pytest.raises(ValueError, match="empty"):
        best_last([])


def test_table_layout_and_values(tmp_path):
    runs = {"GEPO": _synthetic(3), "GRPO": _synthetic(4)}
    md = best_last_table(runs)
    lines = md.strip().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == [
        "Method",
        "AMC23 Best",
        "AMC23 Last",
        "AIME24 Best",
        "AIME24 Last",
        "AIME25 Best",
        "AIME25 Last",
        "MATH500 Best",
        "MATH500 Last",
        "Avg Best",
        "Avg Last",
        "Δ",
    ]
    assert len(lines) == 2 + len(runs)
    for line, (label, hist) in zip(lines[2:], runs.items()):
        cells = [c.strip() for c in line.strip("|").split("|")]
        res = best_last(hist)
        assert cells[0] == label
        assert cells[1] == f"{100 * res['benchmarks']['amc23']['best']:.1f}"
        assert cells[8] == f"{100 * res['benchmarks']['math500']['last']:.1f}"
        assert cells[11] == f"{100 * res['average']['gap']:.1f}"


def test_history_formats_and_cli(tmp_path, capsys):
    # 1. our own history jsonl
    own = tmp_path / "history.jsonl"
    own.write_text(
        "\n".join(
            json.dumps({"step": s, "scores": {"math500": v, "aime24": w}})
            for s, v, w in [(1, 0.5, 0.1), (2, 0.7, 0.0), (3, 0.6, 0.2)]
        )
        + "\n"
    )
    # 2. verl's file logger: training lines without validation are skipped; acc preferred over reward
    verl = tmp_path / "verl.jsonl"
    verl.write_text(
        "\n".join(
            json.dumps(x)
            for x in [
                {"step": 1, "data": {"actor/loss": 0.1}},
                {
                    "step": 128,
                    "data": {
                        "val-core/math500/acc/mean@8": 0.4,
                        "val-core/math500/reward/mean@8": 0.9,
                        "val-aux/math500/acc/std@8": 0.1,
                    },
                },
                {"step": 256, "data": {"val-core/math500/acc/mean@8": 0.45, "actor/loss": 0.2}},
            ]
        )
        + "\n"
    )
    pts = load_history(verl)
    assert [(p.step, dict(p.scores)) for p in pts] == [(128, {"math500": 0.4}), (256, {"math500": 0.45})]
    # 3. summary.json files
    summ = []
    for s, v in [(5, 0.25), (9, 0.125)]:
        f = tmp_path / f"summary_{s}.json"
        f.write_text(json.dumps({"step": s, "benchmarks": {"math500": {"samples_per_problem": 4, "mean@4": v}}}))
        summ.append(str(f))
    assert [p.scores["math500"] for p in load_history(summ)] == [0.25, 0.125]

    out_md, out_json = tmp_path / "t.md", tmp_path / "t.json"
    main([f"own={own}", f"verl={verl}", "--benchmarks", "math500", "--out", str(out_md), "--json", str(out_json)])
    printed = capsys.readouterr().out
    assert printed == out_md.read_text()
    res = json.loads(out_json.read_text())
    assert res["own"]["benchmarks"]["math500"]["best"] == 0.7
    assert res["own"]["benchmarks"]["math500"]["last"] == 0.6
    assert res["verl"]["benchmarks"]["math500"]["best"] == 0.45
    assert "| own | 70.0 | 60.0 | 70.0 | 60.0 | 10.0 |" in printed

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "scores": {"a": 1}}\n{"step": 2, "sco\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_history(bad)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_history(tmp_path / "nope.jsonl")


def test_history_from_a_training_run_directory(tmp_path, capsys):
    """Format 4: a run directory of either engine, read through verl_ext.rundir (torn last line
    skipped): the embedded engine's eval/<bench>/acc lines and the verl engine's val-core keys."""
    run = tmp_path / "gepo_run"
    run.mkdir()
    lines = [
        {"step": 0, "eval/toy/acc": 0.25, "eval/acc_mean": 0.25},
        {"step": 1, "reward/mean": 0.5},  # a training line: no evaluation
        {"step": 2, "reward/mean": 0.6, "eval/toy/acc": 0.75, "eval/acc_mean": 0.75},
        {"step": 4, "val-core/toy/acc/mean@1": 0.5, "val-core/gsm8k/reward/mean@4": 0.125},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 5, "eval/toy/a')
    with pytest.warns(UserWarning, match="truncated last line"):
        hist = load_history(run)
    assert hist == [
        EvalPoint(0, {"toy": 0.25}),
        EvalPoint(2, {"toy": 0.75}),
        EvalPoint(4, {"toy": 0.5, "gsm8k": 0.125}),
    ]
    with pytest.warns(UserWarning):
        assert load_history(run / "metrics.jsonl") == hist
    res = best_last(hist, ["toy"])["benchmarks"]["toy"]
    assert (res["best"], res["best_step"], res["last"], res["last_step"]) == (0.75, 2, 0.5, 4)
    with pytest.warns(UserWarning):
        main([str(run), "--benchmarks", "toy"])
    assert "gepo_run" in capsys.readouterr().out  # a bare run directory is labelled by its name
