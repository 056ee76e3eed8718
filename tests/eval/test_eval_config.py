"""evaluate.yaml <-> EvalConfig, clear errors on bad values, records-file reading."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import yaml

from verl_ext.eval.run import EvalConfig, completed_problems, config_from_mapping, read_records

ROOT = Path(__file__).resolve().parents[2]
YAML = ROOT / "recipe" / "gepo" / "config" / "evaluate.yaml"


def test_yaml_declares_exactly_the_dataclass_fields_with_same_defaults():
    raw = yaml.safe_load(YAML.read_text())
    raw.pop("hydra")
    fields = {f.name: f for f in dataclasses.fields(EvalConfig)}
    assert set(raw) == set(fields)
    default = EvalConfig()
    for name, value in raw.items():
        assert getattr(default, name) == value, name
    # every key is documented: its paragraph (block between blank lines) holds a comment
    text = YAML.read_text().split("\nhydra:")[0]
    for para in text.split("\n\n"):
        keys = [ln.split(":")[0] for ln in para.splitlines() if ln and not ln.startswith(("#", " "))]
        if keys:
            assert any(ln.startswith("# ") for ln in para.splitlines()), f"undocumented yaml keys {keys}"


def test_paper_protocol_defaults():
    c = EvalConfig()
    assert (c.temperature, c.top_p, c.top_k, c.samples_per_problem, c.max_new_tokens) == (0.6, 0.95, 20, 8, 4096)
    assert c.benchmarks == ["amc23", "aime24", "aime25", "math500"]
    assert c.ks == [8]


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"benchmarks": ["math500", "aime2024"]}, "aime2024"),
        ({"benchmarks": []}, "benchmarks is empty"),
        ({"benchmarks": ["math500", "math500"]}, "twice"),
        ({"benchmark_paths": {"aime": "/x"}}, "'aime'"),
        ({"samples_per_problem": 0}, "samples_per_problem=0"),
        ({"pass_ks": [1, 16]}, "k=16"),
        ({"template": "chatml"}, "chatml"),
        ({"engine": "sglang"}, "sglang"),
        ({"dtype": "fp8"}, "fp8"),
        ({"limit": 0}, "limit=0"),
        ({"history_file": "h.jsonl"}, "step"),
    ],
)
def test_bad_values_are_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        EvalConfig(**kw)


def test_unknown_key_and_missing_model_path(tmp_path):
    with pytest.raises(ValueError, match="temprature"):
        config_from_mapping({"temprature": 0.6})
    from verl_ext.eval.run import run_evaluation

    with pytest.raises(ValueError, match="model_path is not set"):
        run_evaluation(EvalConfig(output_dir=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        run_evaluation(EvalConfig(model_path=str(tmp_path / "no_such_model"), output_dir=str(tmp_path)))


@pytest.mark.parametrize(
    "override, message",
    [
        ("benchmarks=[math500,aime23]", "error: unknown benchmark(s) ['aime23']"),
        ("model_path=/no/such/model", "error: model_path '/no/such/model' does not exist"),
        ("modl_path=x", "error: unknown key(s) modl_path (did you mean model_path?)"),  # a typo without +
        ("+temprature=1", "error: unknown evaluation setting(s) ['temprature']"),
        ("samples_per_problem=abc", "error: samples_per_problem='abc': expected int (like the default 8)"),
    ],
)
def test_each_bad_setting_is_one_error_line(tmp_path, monkeypatch, capsys, override, message):
    """The command as a user runs it (in this process: hydra reads sys.argv): one line, no traceback."""
    from recipe.gepo import evaluate

    monkeypatch.delenv("HETERORL_DEBUG", raising=False)
    model = [] if override.startswith("model_path") else ["model_path=/no/such/model"]
    monkeypatch.setattr(sys, "argv", ["evaluate", override, *model, f"output_dir={tmp_path}"])
    with pytest.raises(SystemExit) as exit_:
        evaluate.main()
    assert str(exit_.value.code).startswith(message), exit_.value.code
    assert "\n" not in str(exit_.value.code) and "Traceback" not in capsys.readouterr().err


def _rec(b, pid, j, acc=1.0):
    return {"benchmark": b, "problem_id": pid, "sample_idx": j, "acc": acc}


def test_read_records_tolerates_a_torn_last_line_and_repairs(tmp_path):
    f = tmp_path / "records.jsonl"
    good = [_rec("math500", "p0", 0), _rec("math500", "p0", 1), _rec("math500", "p1", 0)]
    text = "".join(json.dumps(r) + "\n" for r in good)
    torn = json.dumps(_rec("math500", "p1", 1))[:17]  # a write cut by a kill
    f.write_text(text + torn)
    assert read_records(f) == good
    assert f.read_text().endswith(torn)  # read-only by default
    assert read_records(f, repair=True) == good
    assert f.read_text() == text  # appends now start on a clean line
    assert completed_problems(good, 2) == {"math500": {"p0"}}

    f.write_text(text[:10] + "\n" + text)  # corruption in the middle is an error naming the line
    with pytest.raises(ValueError, match="records.jsonl:1"):
        read_records(f)
    assert read_records(tmp_path / "absent.jsonl") == []
