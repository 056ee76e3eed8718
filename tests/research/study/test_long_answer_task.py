"""The long-answer (scratchpad) variant of the toy task: problems, targets, reward round trip."""

import pytest

from recipe.gepo.embedded.tasks import Task
from recipe.gepo.sections import TaskConfig
from verl_ext.data.toy.model import build_tokenizer
from verl_ext.data.toy.problems import make_problem, make_problems, response_length, scratchpad_response
from verl_ext.data.toy.scoring import scratchpad_score


def _hand_scratchpad(a: int, b: int, digits: int) -> str:
    # written independently of the implementation: column by column with integer arithmetic
    out, carry = "", 0
    for i in range(digits):
        da, db = (a // 10**i) % 10, (b // 10**i) % 10
        s = da + db + carry
        out += str(da) + str(db) + str(carry) + str(s // 10) + str(s % 10)
        carry = s // 10
    return out + "=" + str(a + b).zfill(digits + 1)


@pytest.mark.parametrize("a,b,digits", [(47, 385, 3), (999, 999, 3), (0, 0, 3), (5, 7, 1), (1234, 8766, 4)])
def test_scratchpad_matches_hand_columns(a, b, digits):
    assert scratchpad_response(a, b, digits) == _hand_scratchpad(a, b, digits)
    assert scratchpad_response(47, 385, 3) == "750124811303104=0432"


def test_problems_reward_round_trip_and_lengths():
    tok = build_tokenizer()
    problems = make_problems(64, 3, seed=5, answer_format="scratchpad")
    short = make_problems(64, 3, seed=5)
    for p, s in zip(problems, short):
        assert p["problem"] == s["problem"] and p["answer"] == s["answer"]  # same operands, same sum
        target = p["meta"]["target"]
        assert target == _hand_scratchpad(p["meta"]["a"], p["meta"]["b"], 3)
        assert scratchpad_score(target, p["answer"]) == 1.0
        assert scratchpad_score(target + "</s>", p["answer"]) == 1.0
        # tokens: one per character + </s>; the documented length
        ids = tok(target, add_special_tokens=False)["input_ids"]
        assert len(ids) + 1 == response_length(3, "scratchpad") == 21
        assert tok.decode(ids) == target
        # only the final sum is rewarded
        wrong_sum = target[:-1] + str((int(target[-1]) + 1) % 10)
        assert scratchpad_score(wrong_sum, p["answer"]) == 0.0
        wrong_pad = ("1" if target[0] != "1" else "2") + target[1:]
        assert scratchpad_score(wrong_pad, p["answer"]) == 1.0
        assert scratchpad_score(p["answer"], p["answer"]) == 0.0  # no '=': the short answer is not accepted
    assert 20 <= response_length(3, "scratchpad") <= 60 and response_length(4, "scratchpad") == 27
    assert response_length(3) == 5


def test_task_routes_format_to_prompts_score_and_target():
    task = Task(TaskConfig(answer_format="scratchpad", eval_size=8), seed=3)
    short = Task(TaskConfig(eval_size=8), seed=3)
    items = task.train_items(6, stream=0, index=2)
    assert items == short.train_items(6, stream=0, index=2)  # the same prompts for both formats
    assert task.eval_name == "toy_scratch" and short.eval_name == "toy"
    for it in items:
        target = task.target_response(it)
        a, b = (int(x) for x in it["prompt"].rstrip("=").split("+"))
        assert target == _hand_scratchpad(a, b, 3) and make_problem(a, b, 3)[1] == it["answer"]
        assert task.score(target, it) == 1.0 and short.score(target, it) == 0.0
        assert short.score(short.target_response(it), it) == 1.0 and task.score(it["answer"], it) == 0.0
    with pytest.raises(ValueError):
        TaskConfig(answer_format="essay")
    with pytest.raises(ValueError):
        TaskConfig(diagnostics_every=-1)
