"""A design's pinned warm start (``Plan.warm_start_sha256``): the same recipe gives other weights
on another CPU, so the study's rows name the weights they ran from, the package ships the copy the
unfinished design runs from, tables need no build, and a run from other weights is refused."""

from __future__ import annotations

import json

import pytest

from research.study.plan import DESIGNS, POWERED_LONG_WARM_START, Plan
from research.study.rows import append_row, collect, load_rows
from research.study.run import warm_starts
from verl_ext.data.toy.checkpoints import PINNED_WARM_STARTS, warm_start_folder, weights_sha256

#: the package's copy of the warm start powered_long pins (210 scratchpad steps, seed 0)
SHIPPED_LONG = warm_start_folder(PINNED_WARM_STARTS, answer_format="scratchpad", steps=210)


def _plan(**kw) -> Plan:
    base = dict(
        tasks=["long"],
        algos=["gepo"],
        delays=[0, "fix4"],
        seeds=[0],
        steps=8,
        lr=1e-4,
        test_freq=2,
        eval_size=8,
        prompts=2,
        diagnostics_every=0,
        diagnostics_samples=1,
        last_evals=2,
        warm_start_steps=2,
        design="dry",
    )
    return Plan(**{**base, **kw})


def test_the_package_ships_the_weights_powered_long_pins():
    assert weights_sha256(SHIPPED_LONG) == POWERED_LONG_WARM_START
    assert Plan(**DESIGNS["powered_long"]).warm_start_steps == 210


def test_the_designs_that_run_pin_their_weights_and_the_small_ones_build_their_own():
    pins = {name: Plan(**d).warm_start_sha256 for name, d in DESIGNS.items()}
    assert set(pins["powered"]) == set(pins["powered_long"]) == {"long"}
    assert pins["powered"] != pins["powered_long"]  # the long runs were restarted from the shipped copy
    assert pins["dry"] == pins["quick"] == pins["legacy"] == {}


def test_a_pinned_design_runs_from_the_shipped_copy(tmp_path):
    plan = Plan(**DESIGNS["powered_long"])
    models, ws = warm_starts(plan, str(tmp_path / "cache"))
    assert models == {"long": str(SHIPPED_LONG)}
    assert ws == {"long": POWERED_LONG_WARM_START}
    assert not (tmp_path / "cache").exists()  # nothing built


def test_tables_of_a_pinned_design_build_nothing(tmp_path):
    plan = Plan(**DESIGNS["powered"])  # its weights are not shipped: a run would stop
    models, ws = warm_starts(plan, str(tmp_path / "cache"), table_only=True)
    assert models == {} and ws == plan.warm_start_sha256
    assert not (tmp_path / "cache").exists()


def test_a_run_from_other_weights_than_the_pinned_ones_is_refused(tmp_path):
    pin = "0" * 64
    with pytest.raises(SystemExit) as e:
        warm_starts(_plan(warm_start_sha256={"long": pin}), str(tmp_path))
    (built,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    msg = str(e.value)
    assert f"pins the weights sha256 {pin}" in msg and f"has {weights_sha256(built)}" in msg
    assert "--table-only" in msg
    models, ws = warm_starts(_plan(), str(tmp_path))  # unpinned: whatever this machine builds
    assert models == {"long": str(built)} and ws == {"long": weights_sha256(built)}


def test_rows_are_taken_from_the_pinned_weights_whatever_this_machine_builds(tmp_path):
    rows = tmp_path / "rows.csv"
    plan = _plan(warm_start_sha256={"long": "pinned"})
    from research.study.plan import design_id

    for seed, sha in ((0, "pinned"), (1, "this machine")):
        append_row(
            rows,
            {
                "task": "long",
                "algo": "gepo",
                "lr": 1e-4,
                "delay": 0,
                "seed": seed,
                "design_id": design_id(plan),
                "ws_sha256": sha,
                "steps": 8,
                "seconds": 1.0,
                "lq_mean": 0.5,
            },
        )
    assert len(load_rows(rows)) == 2
    plan.seeds = [0, 1]
    got = collect(tmp_path, plan, rows, {"long": "this machine"})
    assert [(r["seed"], r["ws_sha256"]) for r in got] == [(0, "pinned")]
    plan.warm_start_sha256 = {}
    assert [r["seed"] for r in collect(tmp_path, plan, rows, {"long": "this machine"})] == [1]


def test_own_warm_start_counts_a_pinned_designs_cells_from_this_machines_build(tmp_path):
    """``--own-warm-start``: the design's cells count (and would run) from the warm start this
    checkout resolves (the package's copy) and its rows; without it the plan counts the pin's rows
    (a run would stop: test_a_run_from_other_weights_than_the_pinned_ones_is_refused)."""
    import subprocess
    import sys

    from research.study.plan import POWERED_WARM_START, design_id

    cache = tmp_path / "cache"  # stays empty: this checkout's warm start is the package's copy
    rows = tmp_path / "rows.csv"
    append_row(
        rows,
        {
            "task": "long",
            "algo": "gepo",
            "lr": 5e-5,
            "delay": 0,
            "seed": 0,
            "design_id": design_id(Plan(**DESIGNS["powered"])),
            "ws_sha256": POWERED_LONG_WARM_START,
            "steps": 200,
            "seconds": 1.0,
            "lq_mean": 0.5,
        },
    )
    cli = [
        sys.executable,
        "-m",
        "research.study.delay_sweep",
        "--design",
        "powered",
        "--algos",
        "gepo",
        "--plan-only",
        "--cache-dir",
        str(cache),
        "--rows",
        str(rows),
        "--out",
        str(tmp_path / "o"),
    ]
    own = subprocess.run([*cli, "--own-warm-start"], capture_output=True, text=True, timeout=300)
    assert own.returncode == 0, own.stderr[-2000:]
    assert f"weights sha256 {POWERED_LONG_WARM_START[:16]}" in own.stdout and "1 finished rows" in own.stdout
    # the plan alone builds nothing: the pin's rows (none here), and whether a run could start
    pinned = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert pinned.returncode == 0 and "1 finished rows" not in pinned.stdout and "0 finished rows" in pinned.stdout
    assert f"pinned, weights sha256 {POWERED_WARM_START[:16]}... (nothing built)" in pinned.stdout
    assert not cache.exists() or not any(cache.iterdir())


def test_tables_of_other_weights_are_asked_for_by_their_hash(tmp_path):
    """``--warm-start-sha256 HEX`` (tables or the plan): the design's rows of those weights, not of
    its pin (how powered_long's first start is tabulated); a malformed hash or a run is refused."""
    import subprocess
    import sys

    from research.study.plan import design_id

    other = "a" * 64
    rows = tmp_path / "rows.csv"
    append_row(
        rows,
        {
            "task": "long",
            "algo": "gepo",
            "lr": 5e-5,
            "delay": 0,
            "seed": 0,
            "design_id": design_id(Plan(**DESIGNS["powered_long"])),
            "ws_sha256": other,
            "steps": 600,
            "seconds": 1.0,
            "lq_mean": 0.5,
        },
    )
    cli = [
        sys.executable,
        "-m",
        "research.study.delay_sweep",
        "--design",
        "powered_long",
        "--algos",
        "gepo",
        "--lrs",
        "gepo=5e-5",
        "--rows",
        str(rows),
        "--out",
        str(tmp_path / "o"),
    ]

    def sweep(*extra):
        return subprocess.run([*cli, *extra], capture_output=True, text=True, timeout=300)

    assert "; 1 finished rows" in sweep("--plan-only", "--warm-start-sha256", other).stdout
    assert "; 0 finished rows" in sweep("--plan-only").stdout  # the pin's rows: none here
    bad = sweep("--plan-only", "--warm-start-sha256", "a" * 63)
    assert bad.returncode == 2 and f"--warm-start-sha256 '{'a' * 63}': expected a sha256" in bad.stderr
    run = sweep("--warm-start-sha256", other)  # a run: refused before anything starts
    assert run.returncode == 2 and "--warm-start-sha256: only with --table-only or --plan-only" in run.stderr


def test_a_run_folder_of_other_weights_neither_counts_nor_is_overwritten(tmp_path):
    """A finished run folder records its warm start in DONE: collect counts it only for the same
    weights, and a sweep that finds one of other weights stops, naming it, instead of re-running
    into it or recording it under its own hash."""
    from research.study.plan import run_dir
    from research.study.run import Sweep
    from tests.research.study.test_sweep_table import _write_run

    plan = _plan(warm_start_sha256={"long": "mine"})
    d = run_dir(tmp_path, plan, "long", "gepo", 1e-4, "fix4", 0)
    _write_run(
        d, {0: 0.3, 2: 0.4, 4: 0.5, 6: 0.6, 8: 0.7}, {s: 0.01 for s in range(1, 9)}, {s: 0.1 for s in range(1, 9)}
    )
    (d / "DONE").write_text(json.dumps({"seconds": 1.0, "ws_sha256": "theirs"}))
    assert collect(tmp_path, plan, None, {}) == []
    sweep = Sweep(plan, tmp_path, tmp_path / "rows.csv", {"long": "model"}, {"long": "mine"}, workers=1)
    with pytest.raises(SystemExit, match=r"finished from the warm start 'theirs', not this sweep's 'mine'"):
        sweep._jobs_for([("long", "gepo", 1e-4, "fix4", 0)], set())
    assert not (tmp_path / "rows.csv").exists()
    (d / "DONE").write_text(json.dumps({"seconds": 1.0, "ws_sha256": "mine"}))
    (got,) = collect(tmp_path, plan, None, {})
    assert got["dir"] == d and got["lq_mean"] == pytest.approx(0.65)
    assert sweep._jobs_for([("long", "gepo", 1e-4, "fix4", 0)], set()) == []  # recorded, not re-run
    assert [r["ws_sha256"] for r in load_rows(tmp_path / "rows.csv")] == ["mine"]


def test_joined_tables_name_each_designs_own_weights(tmp_path):
    """--join: each design's tables say the weights its own rows ran from (the joined design's
    study page named the main design's)."""
    import subprocess
    import sys

    from research.study.plan import POWERED_WARM_START, design_id
    from research.study.rows import rows_warm_start

    assert rows_warm_start(Plan(**DESIGNS["powered_long"]), {"long": "this machine"}) == {
        "long": POWERED_LONG_WARM_START
    }
    rows = tmp_path / "rows.csv"
    for design, sha, steps in (("powered", POWERED_WARM_START, 200), ("powered_long", POWERED_LONG_WARM_START, 600)):
        for delay in (0, DESIGNS[design]["delays"][-1]):
            append_row(
                rows,
                {
                    "task": "long",
                    "algo": "gepo",
                    "lr": 5e-5,
                    "delay": delay,
                    "seed": 0,
                    "design_id": design_id(Plan(**DESIGNS[design])),
                    "ws_sha256": sha,
                    "steps": steps,
                    "seconds": 1.0,
                    "lq_mean": 0.5,
                },
            )
    out = tmp_path / "o"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "research.study.delay_sweep",
            "--design",
            "powered",
            "--join",
            "powered_long",
            "--algos",
            "gepo",
            "--lrs",
            "gepo=5e-5",
            "--table-only",
            "--no-figures",
            "--rows",
            str(rows),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"weights sha256 `{POWERED_WARM_START}`" in (out / "study_long.md").read_text()
    assert f"weights sha256 `{POWERED_LONG_WARM_START}`" in (out / "powered_long" / "study_long.md").read_text()
    assert (
        f"joined --design powered_long (id {design_id(Plan(**DESIGNS['powered_long']))}): 2 finished runs"
        in proc.stdout
    )


def test_tables_of_a_partly_pinned_plan_build_only_the_unpinned_task(tmp_path):
    models, ws = warm_starts(
        _plan(tasks=["long", "short"], warm_start_sha256={"long": "0" * 64}), str(tmp_path), table_only=True
    )
    assert set(models) == {"short"} and ws["long"] == "0" * 64 and ws["short"] == weights_sha256(models["short"])


def test_a_joined_design_keeps_its_pin_whatever_the_main_design_pins(tmp_path):
    """--join reads each design's rows of the weights it pins, also beside a design without a pin
    (legacy); only --own-warm-start reads them as this machine's build."""
    import subprocess
    import sys

    from research.study.plan import POWERED_WARM_START, design_id

    rows = tmp_path / "rows.csv"
    for seed, sha in ((0, POWERED_WARM_START), (1, "another build")):
        append_row(
            rows,
            {
                "task": "long",
                "algo": "gepo",
                "lr": 5e-5,
                "delay": 0,
                "seed": seed,
                "design_id": design_id(Plan(**DESIGNS["powered"])),
                "ws_sha256": sha,
                "steps": 200,
                "seconds": 1.0,
                "lq_mean": 0.5,
            },
        )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "research.study.delay_sweep",
            "--design",
            "legacy",
            "--tasks",
            "long",
            "--algos",
            "gepo",
            "--table-only",
            "--join",
            "powered",
            "--no-figures",
            "--rows",
            str(rows),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"joined --design powered (id {design_id(Plan(**DESIGNS['powered']))}): 1 finished runs" in proc.stdout
