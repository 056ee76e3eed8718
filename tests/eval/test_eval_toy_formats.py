"""The evaluation scores every toy answer format with that format's reward (the registry of
``verl_ext.rewards.dispatch``, by data_source): a scratchpad problem set with the scratchpad reward
(the sum after ``=``), a short one with the toy reward (the leading digits)."""

from __future__ import annotations

import json

import pytest

from verl_ext.eval.run import (
    EvalConfig,
    _check_run_config,
    load_problems,
    read_records,
    run_evaluation,
    score_samples,
)
from verl_ext.data.toy.problems import response_length, scratchpad_response, toy_data_source
from verl_ext.rewards import scratchpad_reward, toy_reward

SAMPLES = 4


def _cfg(**kw) -> EvalConfig:
    base = dict(
        benchmarks=["toy"],
        toy_n=8,
        toy_digits=3,
        toy_seed=99,
        samples_per_problem=SAMPLES,
        max_new_tokens=12,
        batch_size=16,
        device="cpu",
        dtype="float32",
        engine="hf",
        progress=False,
        seed=5,
    )
    base.update(kw)
    return EvalConfig(**base)


@pytest.mark.parametrize("answer_format", ["short", "scratchpad"])
def test_each_format_is_scored_by_its_own_reward(answer_format):
    problems = load_problems(_cfg(toy_answer_format=answer_format), "toy")
    assert len(problems) == 8 and {p["data_source"] for p in problems} == {toy_data_source(3, answer_format)}
    for p in problems:
        a, b = p["meta"]["a"], p["meta"]["b"]
        pad, bare = scratchpad_response(a, b, 3), p["answer"]  # the right scratchpad, the right bare sum
        wrong_sum = pad[:-1] + str((int(pad[-1]) + 1) % 10)
        scores = [s["acc"] for s in score_samples(p["data_source"], [pad, bare, wrong_sum], [p["answer"]] * 3, {})]
        # a scratchpad problem wants the scratchpad then the sum; a short one the bare sum
        assert scores == ([1.0, 0.0, 0.0] if answer_format == "scratchpad" else [0.0, 1.0, 0.0]), (p, scores)


def test_toy_answer_format_is_checked_and_part_of_the_fingerprint(tmp_path):
    with pytest.raises(ValueError, match="toy_answer_format"):
        _cfg(toy_answer_format="long")
    assert _cfg().fingerprint()["toy_answer_format"] == "short"
    # records written before the field existed (no key in run_config.json) were short-answer ones
    fp = _cfg(model_path=str(tmp_path)).fingerprint()
    del fp["toy_answer_format"]
    (tmp_path / "run_config.json").write_text(json.dumps(fp))
    _check_run_config(tmp_path, _cfg(model_path=str(tmp_path)))  # resumes
    with pytest.raises(ValueError, match="toy_answer_format: 'short' -> 'scratchpad'"):
        _check_run_config(tmp_path, _cfg(model_path=str(tmp_path), toy_answer_format="scratchpad"))


def test_a_scratchpad_checkpoint_is_scored_with_the_scratchpad_reward(toy_scratchpad_model_path, tmp_path):
    """End to end on the shipped scratchpad warm start: every record's score is the scratchpad
    reward of its response, the model solves some problems, and some of those the short-answer
    reward scores 0 (so the data_source picked the scratchpad reward). The pad's shape is the
    model's, not the reward's (the reward does not read it), so nothing here depends on it."""
    cfg = _cfg(
        model_path=str(toy_scratchpad_model_path),
        toy_digits=3,
        toy_answer_format="scratchpad",
        max_new_tokens=response_length(3, "scratchpad") + 1,
        output_dir=str(tmp_path),
    )
    summary = run_evaluation(cfg)
    records = read_records(tmp_path / "records.jsonl")
    assert len(records) == 8 * SAMPLES and {r["data_source"] for r in records} == {"toy_add3_scratch"}
    for r in records:
        assert r["acc"] == scratchpad_reward.compute_score(r["data_source"], r["response"], r["ground_truth"])["acc"]
    correct = [r for r in records if r["acc"] == 1.0]
    assert correct, "the shipped scratchpad warm start solves some problems"
    for r in correct:
        assert r["response"].partition("=")[2].strip().startswith(r["ground_truth"])  # the sum after "="
    assert any(toy_reward.compute_score("toy_add3", r["response"], r["ground_truth"])["acc"] == 0.0 for r in correct)
    assert summary["benchmarks"]["toy"]["n_correct"] == len(correct)
