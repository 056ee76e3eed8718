"""Evaluation end to end on the toy model: report arithmetic from records, resume after a kill,
the Hydra CLI with a history file feeding the Best/Last report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from verl_ext.eval.run import EvalConfig, read_records, run_evaluation
from verl_ext.eval.generate import HFGenerator
from verl_ext.eval.metrics import pass_at_k

ROOT = Path(__file__).resolve().parents[2]
N_PROBLEMS, SAMPLES, BATCH = 20, 4, 12  # chunks of BATCH // SAMPLES = 3 problems -> 7 chunks


def _cfg(model_path, out, **kw) -> EvalConfig:
    base = dict(
        model_path=str(model_path),
        benchmarks=["toy"],
        toy_n=N_PROBLEMS,
        toy_digits=1,
        toy_seed=99,
        samples_per_problem=SAMPLES,
        pass_ks=[1, 2, 4],
        max_new_tokens=6,
        batch_size=BATCH,
        device="cpu",
        dtype="float32",
        engine="hf",
        output_dir=str(out),
        progress=False,
        seed=5,
    )
    base.update(kw)
    return EvalConfig(**base)


class CountingGenerator:
    """The real HF generator, counting calls; optionally dying after ``die_after`` calls."""

    def __init__(self, inner: HFGenerator, die_after: int | None = None):
        self.inner, self.die_after, self.calls, self.prompts = inner, die_after, 0, 0
        self.tokenizer, self.params = inner.tokenizer, inner.params

    def generate(self, prompts, n, seed=0, desc=""):
        if self.die_after is not None and self.calls >= self.die_after:
            raise KeyboardInterrupt("simulated kill")
        self.calls += 1
        self.prompts += len(prompts)
        return self.inner.generate(prompts, n, seed=seed, desc=desc)


@pytest.fixture(scope="module")
def full_run(toy_model_path, hf_gen, tmp_path_factory):
    assert hf_gen.batch_size == BATCH  # conftest's generator
    out = tmp_path_factory.mktemp("full")
    gen = CountingGenerator(hf_gen)
    summary = run_evaluation(_cfg(toy_model_path, out), generator=gen)
    return out, summary, gen


def _by_key(records):
    return {(r["problem_id"], r["sample_idx"]): r for r in records}


def test_report_arithmetic_matches_records(full_run):
    out, summary, gen = full_run
    records = read_records(out / "records.jsonl")
    assert len(records) == N_PROBLEMS * SAMPLES
    assert gen.calls == -(-N_PROBLEMS // (BATCH // SAMPLES))  # one generate call per chunk
    from verl_ext.rewards.toy_reward import compute_score

    per = {}
    for r in records:
        # every record's score is the toy reward of its own response
        assert r["acc"] == compute_score(r["data_source"], r["response"], r["ground_truth"])["acc"]
        assert 1 <= r["n_tokens"] <= 6
        per.setdefault(r["problem_id"], []).append(r["acc"])
    assert all(len(v) == SAMPLES for v in per.values())
    m = summary["benchmarks"]["toy"]
    exp_mean = sum(sum(v) / SAMPLES for v in per.values()) / N_PROBLEMS
    assert m[f"mean@{SAMPLES}"] == pytest.approx(exp_mean)
    for k in (1, 2, 4):
        exp = sum(pass_at_k(SAMPLES, int(sum(v)), k) for v in per.values()) / N_PROBLEMS
        assert m[f"pass@{k}"] == pytest.approx(exp)
    assert m["pass@4"] == pytest.approx(sum(1.0 for v in per.values() if sum(v) > 0) / N_PROBLEMS)
    assert m["n_correct"] == sum(sum(v) for v in per.values())
    assert m["mean_response_tokens"] == pytest.approx(sum(r["n_tokens"] for r in records) / len(records))
    md = (out / "summary.md").read_text()
    assert f"| Toy | {N_PROBLEMS} | {100 * exp_mean:.1f} |" in md
    assert json.loads((out / "summary.json").read_text())["benchmarks"]["toy"] == m


def test_resume_after_kill_with_torn_line_equals_uninterrupted(toy_model_path, hf_gen, full_run, tmp_path):
    full_out, full_summary, _ = full_run
    cfg = _cfg(toy_model_path, tmp_path)
    with pytest.raises(KeyboardInterrupt):
        run_evaluation(cfg, generator=CountingGenerator(hf_gen, die_after=3))
    rec = tmp_path / "records.jsonl"
    assert len(read_records(rec)) == 3 * 3 * SAMPLES  # 3 chunks x 3 problems were written
    # the kill tore the write of the 4th chunk's first line
    full_lines = (full_out / "records.jsonl").read_text().splitlines(keepends=True)
    with open(rec, "a") as f:
        f.write(full_lines[9 * SAMPLES][:25])

    gen = CountingGenerator(hf_gen)
    summary = run_evaluation(cfg, generator=gen)
    assert gen.calls == 7 - 3 and gen.prompts == N_PROBLEMS - 9  # only the unfinished chunks
    a, b = _by_key(read_records(full_out / "records.jsonl")), _by_key(read_records(rec))
    assert a.keys() == b.keys()
    assert all(a[k]["response"] == b[k]["response"] for k in a)  # same as never killed
    assert summary["benchmarks"] == full_summary["benchmarks"]


def test_resume_redoes_only_a_partially_recorded_problem(toy_model_path, hf_gen, full_run, tmp_path):
    full_out, _, _ = full_run
    lines = (full_out / "records.jsonl").read_text().splitlines(keepends=True)
    # keep all of the first 5 problems except the last two samples of problem 5 (index 4),
    # then half a line: problem index 4 is incomplete
    kept = "".join(lines[: 5 * SAMPLES - 2]) + lines[5 * SAMPLES - 2][:30]
    (tmp_path / "records.jsonl").write_text(kept)
    (tmp_path / "run_config.json").write_text((full_out / "run_config.json").read_text())
    gen = CountingGenerator(hf_gen)
    summary = run_evaluation(_cfg(toy_model_path, tmp_path), generator=gen)
    # chunk 1 (problems 3-5) redoes problem 4 and 5 only; chunks 2..6 run in full
    assert gen.prompts == N_PROBLEMS - 4
    recs = read_records(tmp_path / "records.jsonl")
    grouped = _by_key(recs)
    assert len(grouped) == N_PROBLEMS * SAMPLES
    per = {}
    for (pid, _), r in grouped.items():
        per.setdefault(pid, []).append(r["acc"])
    exp = sum(sum(v) / SAMPLES for v in per.values()) / N_PROBLEMS
    assert summary["benchmarks"]["toy"][f"mean@{SAMPLES}"] == pytest.approx(exp)


def test_resume_refuses_changed_settings(toy_model_path, full_run):
    full_out, _, _ = full_run
    with pytest.raises(ValueError, match=r"temperature: 0\.6 -> 0\.8"):
        run_evaluation(_cfg(toy_model_path, full_out, temperature=0.8))


def test_cli_end_to_end_with_history_and_best_last(toy_model_path, hf_gen, tmp_path):
    hist = tmp_path / "history.jsonl"
    common = dict(
        toy_n=6,
        samples_per_problem=2,
        pass_ks=None,
        output_dir=str(tmp_path / "step64"),
        step=64,
        history_file=str(hist),
    )
    # step 64 through the Hydra command line (a fresh process), step 128 in-process
    args = [
        sys.executable,
        "-m",
        "recipe.gepo.evaluate",
        f"model_path={toy_model_path}",
        "benchmarks=[toy]",
        "toy_n=6",
        "toy_digits=1",
        "toy_seed=99",
        "samples_per_problem=2",
        "max_new_tokens=6",
        "batch_size=12",
        "device=cpu",
        "seed=5",
        f"output_dir={tmp_path / 'step64'}",
        "step=64",
        f"history_file={hist}",
        "progress=false",
    ]
    r = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| Toy | 6 |" in r.stdout
    assert (tmp_path / "step64" / "evaluate.log").exists()
    # the CLI wrote what the Python API computes from the same settings
    assert (
        json.loads((tmp_path / "step64" / "run_config.json").read_text())
        == _cfg(toy_model_path, "x", **common).fingerprint()
    )
    common.update(output_dir=str(tmp_path / "step128"), step=128, seed=6)
    run_evaluation(_cfg(toy_model_path, "x", **common), generator=hf_gen)

    lines = [json.loads(x) for x in hist.read_text().splitlines()]
    assert [x["step"] for x in lines] == [64, 128]
    for x in lines:
        s = json.loads((tmp_path / f"step{x['step']}" / "summary.json").read_text())
        assert x["scores"]["toy"] == s["benchmarks"]["toy"]["mean@2"]
        assert s["step"] == x["step"]
    r = subprocess.run(
        [sys.executable, "-m", "verl_ext.eval.report", f"toy={hist}", "--json", str(tmp_path / "bl.json")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    bl = json.loads((tmp_path / "bl.json").read_text())["toy"]["benchmarks"]["toy"]
    assert bl["best"] == max(x["scores"]["toy"] for x in lines)
    assert bl["last"] == lines[-1]["scores"]["toy"]
    assert "| Toy Best | Toy Last |" in r.stdout
