"""Best/Last report from a run's evaluation history, laid out like the paper's table.

**Best** is the maximum over a run's evaluations, **Last** the evaluation with the largest step,
per benchmark and for the average; the average is taken per evaluation (macro mean over the
benchmarks, only evaluations that cover all of them), so Avg-Best is the best single checkpoint's
average (the mean of per-benchmark bests is the JSON's ``mean_of_best``). ``Δ`` = Avg-Best - Avg-Last,
the paper's best-to-last gap. A history (:func:`load_history`) is any of: the jsonl that
``recipe.gepo.evaluate`` appends to (``history_file``: ``{"step", "scores"}`` a line); verl's file
logger's lines ``{"step", "data"}`` (keys ``val-core/<data_source>/acc/mean@<n>``, else
``.../reward/mean@<n>``); ``recipe.gepo.evaluate``'s ``summary.json`` files (each with a ``step``);
a training run directory (its ``metrics.jsonl``: ``eval/<benchmark>/acc`` or ``val-core/...``).

    python -m verl_ext.eval.report GEPO=runs/gepo/history.jsonl GRPO=runs/grpo/history.jsonl \
        --benchmarks amc23,aime24,aime25,math500 --out best_last.md --json best_last.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from verl_ext.rundir import METRICS_FILE, read_metric_rows

__all__ = [
    "EvalPoint",
    "DISPLAY_NAMES",
    "PAPER_ORDER",
    "load_history",
    "parse_history_lines",
    "best_last",
    "best_last_table",
    "main",
]

#: How benchmarks are titled in tables.
DISPLAY_NAMES = {
    "amc23": "AMC23",
    "aime24": "AIME24",
    "aime25": "AIME25",
    "math500": "MATH500",
    "gsm8k": "GSM8K",
    "toy": "Toy",
}
#: Column order of the paper's table.
PAPER_ORDER = ("amc23", "aime24", "aime25", "math500")


@dataclass(frozen=True)
class EvalPoint:
    """One evaluation of a run: training ``step`` and accuracy per benchmark (0..1)."""

    step: int
    scores: Mapping[str, float]


_VERL_KEY = re.compile(r"^val-core/(?P<src>.+)/(?P<var>acc|reward)/mean@(?P<n>\d+)$")


def _from_verl_data(data: Mapping[str, float]) -> dict[str, float]:
    found: dict[str, dict[str, tuple[int, float]]] = {}
    for key, val in data.items():
        m = _VERL_KEY.match(key)
        if m is None:
            continue
        n = int(m["n"])
        slot = found.setdefault(m["src"], {})
        if m["var"] not in slot or n > slot[m["var"]][0]:
            slot[m["var"]] = (n, float(val))
    return {src: (v["acc"] if "acc" in v else v["reward"])[1] for src, v in found.items()}


def _from_summary(obj: Mapping) -> dict[str, float]:
    scores = {}
    for name, m in obj["benchmarks"].items():
        k = m["samples_per_problem"]
        scores[name] = float(m[f"mean@{k}"])
    return scores


def parse_history_lines(lines: Iterable[str], source: str = "<history>") -> list[EvalPoint]:
    """Parse jsonl history lines of format 1 or 2 (see module doc); blank lines are skipped."""
    points = []
    for i, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{source}:{i}: not valid JSON ({e.msg})") from None
        if "step" not in obj:
            raise ValueError(f"{source}:{i}: entry has no 'step'")
        if "scores" in obj:
            scores = {str(k): float(v) for k, v in obj["scores"].items()}
        elif "data" in obj:
            scores = _from_verl_data(obj["data"])
            if not scores:
                continue  # a training-step line without validation metrics
        elif "benchmarks" in obj:
            scores = _from_summary(obj)
        else:
            raise ValueError(f"{source}:{i}: entry has none of 'scores', 'data', 'benchmarks'")
        points.append(EvalPoint(step=int(obj["step"]), scores=scores))
    return points


_RUN_EVAL_KEY = re.compile(r"^eval/(?P<bench>.+)/acc$")


def _from_run_dir(path: Path) -> list[EvalPoint]:
    """Format 4: the evaluations a training run logged to its ``metrics.jsonl``."""
    points = []
    for row in read_metric_rows(path):
        scores = {m["bench"]: v for k, v in row.items() if (m := _RUN_EVAL_KEY.match(k)) and math.isfinite(v)}
        scores.update(_from_verl_data(row))
        if scores:
            points.append(EvalPoint(step=row["step"], scores=scores))
    return points


def load_history(paths: str | Path | Sequence[str | Path]) -> list[EvalPoint]:
    """Read an evaluation history from a jsonl file, one or more ``summary.json``, or a training
    run directory (formats 1-4 of the module doc)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    points: list[EvalPoint] = []
    for p in map(Path, paths):
        if p.is_dir() or p.name == METRICS_FILE:
            points.extend(_from_run_dir(p))
            continue
        if not p.is_file():
            raise FileNotFoundError(f"history file {str(p)!r} does not exist")
        text = p.read_text()
        if p.suffix == ".json":
            obj = json.loads(text)
            if "step" not in obj or obj["step"] is None:
                raise ValueError(f"{p}: summary has no 'step'; evaluate with step=<training step>")
            points.append(EvalPoint(step=int(obj["step"]), scores=_from_summary(obj)))
        else:
            points.extend(parse_history_lines(text.splitlines(), source=str(p)))
    return points


def _best_last_series(series: list[tuple[int, float]]) -> dict:
    if not series:
        return {"best": math.nan, "best_step": None, "last": math.nan, "last_step": None, "n_evals": 0}
    best_step, best = series[0]
    for step, v in series[1:]:
        if v > best:  # earliest step wins ties
            best_step, best = step, v
    last_step, last = series[-1]
    return {"best": best, "best_step": best_step, "last": last, "last_step": last_step, "n_evals": len(series)}


def best_last(history: Sequence[EvalPoint], benchmarks: Sequence[str] | None = None) -> dict:
    """Best/Last per benchmark and for the average.

    Returns ``{"benchmarks": {name: {best, best_step, last, last_step, n_evals}},
    "average": {... same keys ..., "mean_of_best", "gap"}}``. Evaluations are ordered by step
    (stable, so for a repeated step the later entry is "later"). ``benchmarks`` defaults to
    the paper's order restricted to what the history holds, followed by any others.
    """
    if not history:
        raise ValueError("best_last: empty evaluation history")
    pts = sorted(history, key=lambda p: p.step)
    seen: list[str] = []
    for p in pts:
        seen += [b for b in p.scores if b not in seen]
    if benchmarks is None:
        benchmarks = [b for b in PAPER_ORDER if b in seen] + [b for b in seen if b not in PAPER_ORDER]
    else:
        unknown = [b for b in benchmarks if b not in seen]
        if unknown:
            raise ValueError(f"benchmark(s) {unknown} never evaluated in this history; have {seen}")
    per = {b: _best_last_series([(p.step, float(p.scores[b])) for p in pts if b in p.scores]) for b in benchmarks}
    avg_series = [
        (p.step, sum(float(p.scores[b]) for b in benchmarks) / len(benchmarks))
        for p in pts
        if all(b in p.scores for b in benchmarks)
    ]
    avg = _best_last_series(avg_series)
    avg["mean_of_best"] = sum(per[b]["best"] for b in benchmarks) / len(benchmarks)
    avg["gap"] = avg["best"] - avg["last"]
    return {"benchmarks": per, "average": avg}


def _fmt(v: float, scale: float, digits: int) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * scale:.{digits}f}"


def best_last_table(
    runs: Mapping[str, Sequence[EvalPoint] | Mapping],
    benchmarks: Sequence[str] | None = None,
    scale: float = 100.0,
    digits: int = 1,
    label_header: str = "Method",
) -> str:
    """Markdown table, one row per run, columns ``<Bench> Best | <Bench> Last`` per benchmark,
    then ``Avg Best | Avg Last | Δ``. ``runs`` maps a row label to a history or to the result
    of :func:`best_last`. Values are multiplied by ``scale`` (percent by default)."""
    if not runs:
        raise ValueError("best_last_table: no runs")
    results = {
        label: (r if isinstance(r, Mapping) and "benchmarks" in r else best_last(r, benchmarks))
        for label, r in runs.items()
    }
    if benchmarks is None:
        benchmarks = list(next(iter(results.values()))["benchmarks"])
    head = [label_header]
    for b in benchmarks:
        name = DISPLAY_NAMES.get(b, b)
        head += [f"{name} Best", f"{name} Last"]
    head += ["Avg Best", "Avg Last", "Δ"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + [":---:"] * (len(head) - 1)) + "|"]
    for label, res in results.items():
        row = [label]
        for b in benchmarks:
            m = res["benchmarks"].get(b, {"best": math.nan, "last": math.nan})
            row += [_fmt(m["best"], scale, digits), _fmt(m["last"], scale, digits)]
        a = res["average"]
        row += [_fmt(a["best"], scale, digits), _fmt(a["last"], scale, digits), _fmt(a["gap"], scale, digits)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> str:
    ap = argparse.ArgumentParser(prog="python -m verl_ext.eval.report", description=__doc__.split("\n")[0])
    ap.add_argument(
        "runs",
        nargs="+",
        help="LABEL=PATH[,PATH...] (a history jsonl, a verl file-logger "
        "jsonl, summary.json files, or a training run directory); a bare PATH uses its "
        "folder's name as label",
    )
    ap.add_argument("--benchmarks", default=None, help="comma-separated, e.g. amc23,aime24,aime25,math500")
    ap.add_argument("--scale", type=float, default=100.0, help="multiply accuracies (100 = percent)")
    ap.add_argument("--digits", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--json", default=None, help="write the Best/Last numbers here")
    args = ap.parse_args(argv)
    benches = args.benchmarks.split(",") if args.benchmarks else None
    results = {}
    for spec in args.runs:
        label, _, paths = spec.rpartition("=")
        files = paths.split(",")
        first = Path(files[0]).resolve()
        label = label or (first.name if first.is_dir() else first.parent.name)
        results[label] = best_last(load_history(files), benches)
    table = best_last_table(results, benches, scale=args.scale, digits=args.digits)
    print(table, end="")
    if args.out:
        Path(args.out).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return table


if __name__ == "__main__":
    main()
