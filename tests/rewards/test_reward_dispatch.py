"""Rewards have one owner, ``verl_ext.rewards.dispatch``: the embedded engine's
``Task.score`` and verl's reward loop (``custom_reward_function`` of the ``cpu_toy`` preset) both
score through its registry, so the long-answer (scratchpad) reward is reached from both engines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from recipe.gepo.embedded.tasks import Task
from recipe.gepo.sections import TaskConfig
from verl_ext.data.toy.model import build_tokenizer
from verl_ext.data.toy.problems import make_problems, scratchpad_response, toy_data_source
from verl_ext.data.toy.scoring import scratchpad_score
from verl_ext.rewards import dispatch, math_reward, scratchpad_reward, toy_reward

ROOT = Path(__file__).resolve().parents[2]
TARGET = scratchpad_response(47, 385, 3)  # "750124811303104=0432"


@pytest.mark.parametrize(
    "data_source, name",
    [
        ("toy_add3", "toy"),
        ("toy", "toy"),
        ("toy_add3_scratch", "toy_scratch"),
        ("toy_scratch", "toy_scratch"),
        ("math500", "math"),
        ("gsm8k", "math"),
        ("scratch", "math"),
    ],
)
def test_registry_routes_by_data_source(data_source, name):
    assert dispatch.reward_name(data_source) == name
    assert set(dispatch.REWARDS) == {"toy", "toy_scratch", "math"}


def test_scratchpad_reward_scores_only_the_sum_after_equals():
    wrong_pad = "000000000000000=0432"
    for text, acc, why in (
        (TARGET, 1.0, ""),
        (wrong_pad, 1.0, ""),
        (TARGET[:-1] + "3", 0.0, ""),
        ("0432", 0.0, "no_equals"),
        ("1=", 0.0, "no_answer"),
    ):
        out = dispatch.compute_score("toy_add3_scratch", text, "0432")
        assert (out["score"], out["acc"], out["error"]) == (acc, acc, why), text
        assert set(out) == set(math_reward.RESULT_KEYS)
        assert out["score"] == scratchpad_score(text, "0432")  # the data module's rule agrees
    # the short toy reward reads the leading digits: a correct scratchpad scores 0 there
    assert dispatch.compute_score("toy_add3", TARGET, "0432")["score"] == 0.0
    with pytest.raises(ValueError, match="toy ground_truth"):
        scratchpad_reward.compute_score("toy_add3_scratch", TARGET, "sum")


@pytest.mark.parametrize(
    ("response", "acc"),
    [
        (scratchpad_response(8, 1, 1), 1.0),  # "81009=09", the target
        ("81009=09</s>", 1.0),
        (" 81009= 09 ", 1.0),
        ("810108=09", 1.0),  # a six-digit pad (issue 47): the pad is not read
        ("=09", 1.0),  # no pad at all
        ("99999=09", 1.0),  # a wrong pad
        ("81009=091", 0.0),  # more digits than the sum
        ("81009=9", 0.0),  # the sum not zero-padded
        ("81009=08=09", 0.0),  # only the first "=" counts
        ("81009 09", 0.0),  # no "="
    ],
)
def test_scratchpad_reward_accepts_any_pad_and_exactly_the_sum_after_the_first_equals(response, acc):
    """The contract in the reward's docstring, on 8 + 1: the text before the first ``=`` is not
    read (only the final answer is rewarded); the digits right after it must be the sum."""
    out = scratchpad_reward.compute_score("toy_add1_scratch", response, "09")
    assert (out["score"], out["acc"]) == (acc, acc)
    assert dispatch.compute_score(toy_data_source(1, "scratchpad"), response, "09")["acc"] == acc


@pytest.mark.parametrize("answer_format", ["short", "scratchpad"])
def test_task_score_goes_through_dispatch(answer_format):
    task = Task(TaskConfig(answer_format=answer_format, eval_size=8), seed=0)
    assert task.data_source == make_problems(1, 3, answer_format=answer_format)[0]["data_source"]
    assert task.data_source == toy_data_source(3, answer_format)
    for item in task.eval_items:
        good = task.target_response(item)
        assert task.score(good, item) == 1.0
        assert task.score(good, item) == dispatch.compute_score(task.data_source, good, item["answer"])["score"]
        assert task.score(good[:-1] + str((int(good[-1]) + 1) % 10), item) == 0.0  # last digit of the sum off
    if answer_format == "short":
        assert dispatch.REWARDS[dispatch.reward_name(task.data_source)] is toy_reward.compute_score


def test_score_batch_routes_like_compute_score():
    """``score_batch`` (what the evaluation calls) picks the same reward per data_source as
    ``compute_score``: one correct scratchpad, one bare sum, scored as scratchpad and as short rows."""
    responses, golds = [TARGET, "0432", TARGET[:-1] + "3"], ["0432"] * 3
    for source, expected in (("toy_add3_scratch", [1.0, 0.0, 0.0]), ("toy_add3", [0.0, 1.0, 0.0])):
        out = dispatch.score_batch(source, responses, golds)
        assert [r["acc"] for r in out] == expected
        assert out == [dispatch.compute_score(source, r, g) for r, g in zip(responses, golds)]
    math = dispatch.score_batch("math500", ["so \\boxed{4}", "\\boxed{5}"], ["4", "4"])
    assert [r["acc"] for r in math] == [1.0, 0.0] and set(math[0]) == set(math_reward.RESULT_KEYS)
    assert dispatch.BATCH_REWARDS["math"] is math_reward.score_batch
    with pytest.raises(ValueError, match="one ground truth per solution"):
        dispatch.score_batch("toy_add3", ["1"], [])


def _verl_reward_manager():
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.reward import load_reward_manager

    searchpath = f"hydra.searchpath=[pkg://verl.trainer.config,file://{ROOT / 'configs'}]"
    with initialize_config_dir(config_dir=str(ROOT / "recipe" / "gepo" / "config"), version_base=None):
        cfg = compose(config_name="gepo_trainer", overrides=[searchpath, "+verl_preset=cpu_toy"])
    assert cfg.reward.custom_reward_function.path == "pkg://verl_ext.rewards.dispatch"
    tokenizer = build_tokenizer()
    return load_reward_manager(cfg, tokenizer), tokenizer


def _row(tokenizer, prompt: str, response: str, data_source: str, answer: str):
    from verl import DataProto

    p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    width = 32
    responses = torch.full((1, width), tokenizer.pad_token_id, dtype=torch.long)
    responses[0, : len(r)] = torch.tensor(r)
    attention = torch.cat([torch.ones(1, len(p), dtype=torch.long), (responses != tokenizer.pad_token_id).long()], 1)
    attention[0, len(p) : len(p) + len(r)] = 1
    return DataProto.from_dict(
        tensors={"prompts": torch.tensor([p]), "responses": responses, "attention_mask": attention},
        non_tensors={
            "data_source": np.array([data_source], dtype=object),
            "reward_model": np.array([{"ground_truth": answer}], dtype=object),
        },
    )


def test_verl_reward_loop_reaches_the_scratchpad_reward():
    manager, tok = _verl_reward_manager()

    def score(response, data_source):
        out = manager.loop.run_until_complete(manager.run_single(_row(tok, "047+385=", response, data_source, "0432")))
        return out["reward_score"], out["reward_extra_info"]["error"]

    assert score(TARGET, "toy_add3_scratch") == (1.0, "")
    assert score(TARGET[:-1] + "3", "toy_add3_scratch") == (0.0, "")
    assert score("0432", "toy_add3_scratch") == (0.0, "no_equals")
    assert score("0432", "toy_add3") == (1.0, "")


@pytest.fixture(scope="module")
def smollm2_reward():
    """The cpu_smollm2_math preset's reward function, loaded as verl's reward manager loads it."""
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.reward import get_custom_reward_fn

    searchpath = f"hydra.searchpath=[pkg://verl.trainer.config,file://{ROOT / 'configs'}]"
    with initialize_config_dir(config_dir=str(ROOT / "recipe" / "gepo" / "config"), version_base=None):
        cfg = compose(config_name="gepo_trainer", overrides=[searchpath, "+verl_preset=cpu_smollm2_math"])
    assert dict(cfg.reward.custom_reward_function.reward_kwargs) == {"boxed_weight": 0.1}
    return get_custom_reward_fn(cfg)


@pytest.mark.parametrize(
    "response, with_format, accuracy_only",
    [
        ("3 + 2 = 5. The answer is \\boxed{5}.", 1.1, 1.0),
        ("The answer is \\boxed{6}.", 0.1, 0.0),  # a boxed final answer, wrong: the format term only
        ("The answer is 5.", 0.0, 0.0),  # right number, not boxed: nothing
        ("The answer is \\boxed{}.", 0.0, 0.0),  # empty box
        ("The answer is \\boxed{5", 0.0, 0.0),  # unclosed (truncated) box
        ("\\boxed{5} no, \\boxed{6}", 0.1, 0.0),  # the last box is the answer
        ("", 0.0, 0.0),
    ],
)
def test_the_smollm2_preset_adds_a_boxed_format_term_through_verls_reward_loader(
    smollm2_reward, response, with_format, accuracy_only
):
    """cpu_smollm2_math's reward = math_verify accuracy + 0.1 x "a complete \\boxed{} answer"
    (math_reward's ``boxed_weight``, passed as verl's ``reward_kwargs``); without it (every other
    preset) the score stays accuracy alone."""
    out = smollm2_reward("gsm8k", response, "5", {})
    assert out["score"] == pytest.approx(with_format) and out["acc"] == accuracy_only
    assert out["format_boxed"] == (1.0 if with_format else 0.0)
    assert dispatch.compute_score("gsm8k", response, "5")["score"] == accuracy_only  # the default is unchanged
