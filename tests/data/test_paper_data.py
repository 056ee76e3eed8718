"""verl_ext.data.paper_data: the paper's sets as verl parquet (MATH train, MATH500, AIME24, AIME25,
AMC23), written once under a folder and reused, the competition sets from HETERORL_DATA_DIR; a
missing folder or file is one error line naming it. The run scripts' use: tests/recipe/test_run_scripts.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from verl_ext.data.paper_data import PaperDataError, main, paper_file, prepare_paper_sets

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
VAL = ["math500", "aime24", "aime25", "amc23"]


@pytest.fixture
def jsonl_dir(tmp_path):
    if not all((SHARED / f"{n}.jsonl").is_file() for n in VAL[1:]):
        pytest.skip(f"no copies of aime24/aime25/amc23.jsonl in {SHARED}")
    folder = tmp_path / "jsonl"
    folder.mkdir()
    for name in VAL[1:]:
        shutil.copy(SHARED / f"{name}.jsonl", folder)
    return folder


def column(file: Path, name: str) -> list:
    return pq.read_table(file).column(name).to_pylist()


def test_each_set_is_written_once_with_its_data_source_and_template(tmp_path, jsonl_dir):
    lines: list[str] = []
    files = prepare_paper_sets(tmp_path / "out", VAL, jsonl_dir=str(jsonl_dir), log=lines.append)
    assert files == [(tmp_path / "out" / "qwen3_think" / f"{n}.parquet").resolve() for n in VAL]
    assert [len(column(f, "data_source")) for f in files] == [500, 30, 30, 40]
    for name, file in zip(VAL, files):
        assert set(column(file, "data_source")) == {name}
        assert {row["template"] for row in column(file, "extra_info")} == {"qwen3_think"}
    assert len(lines) == 4 and lines[0].startswith("prepared math500: 500 rows")
    stamps = [f.stat().st_mtime_ns for f in files]
    again: list[str] = []
    assert prepare_paper_sets(tmp_path / "out", VAL, jsonl_dir=str(jsonl_dir), log=again.append) == files
    assert again == [] and [f.stat().st_mtime_ns for f in files] == stamps  # reused, not rewritten


def test_math_train_is_the_papers_levels_3_to_5_and_thinking_off_has_its_own_folder(tmp_path):
    (file,) = prepare_paper_sets(tmp_path, ["math_train"], thinking=False, jsonl_dir="")
    assert file == paper_file(tmp_path, "math_train", thinking=False) and file.parent.name == "qwen3_nothink"
    info = column(file, "extra_info")
    assert len(info) > 5000 and {row["split"] for row in info} == {"train"}
    assert set(column(file, "data_source")) == {"math_train"}
    assert {row["template"] for row in info} == {"qwen3_nothink"}


def test_a_missing_folder_or_file_is_named_before_anything_is_written(tmp_path, jsonl_dir, monkeypatch):
    monkeypatch.delenv("HETERORL_DATA_DIR", raising=False)
    with pytest.raises(PaperDataError, match=r"^HETERORL_DATA_DIR is not set: .*aime24\.jsonl"):
        prepare_paper_sets(tmp_path / "out", VAL)
    (jsonl_dir / "aime25.jsonl").unlink()
    monkeypatch.setenv("HETERORL_DATA_DIR", str(jsonl_dir))
    with pytest.raises(PaperDataError, match=rf"^HETERORL_DATA_DIR={jsonl_dir}: no file {jsonl_dir}/aime25\.jsonl"):
        prepare_paper_sets(tmp_path / "out", VAL)
    assert not (tmp_path / "out").exists()
    assert prepare_paper_sets(tmp_path / "out", ["math500"])[0].is_file()  # math500 needs no folder


def test_the_command_prints_a_path_or_a_hydra_list_and_one_error_line(tmp_path, jsonl_dir, capsys):
    assert main(["--out-dir", str(tmp_path), "--jsonl-dir", str(jsonl_dir), "math500,aime24", "amc23"]) == 0
    out, err = capsys.readouterr()
    names = ["math500", "aime24", "amc23"]
    assert out == "[" + ",".join(f"'{paper_file(tmp_path, n)}'" for n in names) + "]\n"
    assert err.count("prepared ") == 3
    assert main(["--out-dir", str(tmp_path), "math500"]) == 0
    assert capsys.readouterr() == (f"{paper_file(tmp_path, 'math500')}\n", "")
    assert main(["--out-dir", str(tmp_path), "--jsonl-dir", "", "aime24"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: HETERORL_DATA_DIR is not set") and err.count("\n") == 1
    assert main(["--out-dir", str(tmp_path), "gsm8k"]) == 2
    assert "unknown set 'gsm8k'" in capsys.readouterr().err
