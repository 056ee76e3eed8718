"""verl_ext.data.toy_assets with answer_format: scratchpad parquet rows score through verl's reward
dispatch with the scratchpad reward (the sum after ``=``), short rows with the toy reward."""

import pyarrow.parquet as pq
import pytest

from verl_ext.data.toy.problems import scratchpad_response
from verl_ext.data.toy_assets import prepare_toy_assets
from verl_ext.rewards.dispatch import compute_score


@pytest.mark.parametrize("answer_format", ["short", "scratchpad"])
def test_toy_assets_carry_the_answer_format(tmp_path, answer_format):
    model = tmp_path / "model"
    model.mkdir()
    assets = prepare_toy_assets(
        tmp_path / "out", digits=2, n_train=6, n_val=3, seed=0, model_path=model, answer_format=answer_format
    )
    assert ("_scratch" in assets.train_file.name) == (answer_format == "scratchpad")
    rows = pq.read_table(assets.train_file).to_pylist()
    assert len(rows) == 6
    for row in rows:
        source, truth = row["data_source"], row["reward_model"]["ground_truth"]
        assert source == ("toy_add2" if answer_format == "short" else "toy_add2_scratch")
        a, b = (int(x) for x in row["extra_info"]["problem"].rstrip("=").split("+"))
        right = truth if answer_format == "short" else scratchpad_response(a, b, 2)
        assert compute_score(source, right, truth)["acc"] == 1.0
        # a bare sum is a wrong scratchpad answer (no "="), a right short one
        assert compute_score(source, truth, truth)["acc"] == (1.0 if answer_format == "short" else 0.0)


def test_toy_assets_refuse_an_unknown_format(tmp_path):
    with pytest.raises(ValueError, match="answer_format"):
        prepare_toy_assets(tmp_path, digits=1, n_train=2, n_val=1, model_path=tmp_path, answer_format="long")
