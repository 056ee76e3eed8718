"""verl_ext.data.toy.problems: prompts, answers, the task's name, response lengths."""

import numpy as np
import pytest

from verl_ext.data.toy.problems import (
    ANSWER_FORMATS,
    correct_response,
    is_scratchpad,
    make_problem,
    make_problems,
    parse_problem,
    response_length,
    scratchpad_response,
    toy_data_source,
)


def test_make_problem_zero_pads():
    assert make_problem(47, 385, 3) == ("047+385=", "0432")
    assert make_problem(999, 999, 3) == ("999+999=", "1998")
    assert make_problem(0, 0, 2) == ("00+00=", "000")


@pytest.mark.parametrize(
    "a,b,digits,match", [(1000, 1, 3, "a must"), (1, -1, 3, "b must"), (1, 1, 0, "digits"), (1, 1, 10, "digits")]
)
def test_make_problem_rejects_bad_values(a, b, digits, match):
    with pytest.raises(ValueError, match=match):
        make_problem(a, b, digits)


def test_make_problems_deterministic_and_correct():
    a = make_problems(200, digits=4, seed=11)
    assert a == make_problems(200, digits=4, seed=11)
    assert a != make_problems(200, digits=4, seed=12)
    for r in a:
        x, y = r["meta"]["a"], r["meta"]["b"]
        assert r["problem"] == f"{x:04d}+{y:04d}="
        assert r["answer"] == f"{x + y:05d}"
        assert r["data_source"] == "toy_add4"
    assert len({r["id"] for r in a}) == 200
    with pytest.raises(ValueError, match="n must"):
        make_problems(0)


def test_toy_data_source_is_the_one_name_of_the_task():
    assert toy_data_source(3) == "toy_add3" and toy_data_source(3, "short") == "toy_add3"
    assert toy_data_source(4, "scratchpad") == "toy_add4_scratch"
    for fmt in ANSWER_FORMATS:
        rec = make_problems(2, digits=2, seed=1, answer_format=fmt)[1]
        assert rec["data_source"] == toy_data_source(2, fmt)
        assert rec["id"] == f"{toy_data_source(2, fmt)}/1/1"
        assert is_scratchpad(rec) == (fmt == "scratchpad")
    with pytest.raises(ValueError, match="answer_format"):
        toy_data_source(3, "long")
    with pytest.raises(ValueError, match="digits"):
        toy_data_source(0)


def test_correct_response_and_its_length():
    assert correct_response(47, 385, 3) == "0432"
    assert correct_response(47, 385, 3, "scratchpad") == scratchpad_response(47, 385, 3) == "750124811303104=0432"
    for digits in (1, 3, 9):
        for fmt in ANSWER_FORMATS:
            assert len(correct_response(10**digits - 1, 1, digits, fmt)) + 1 == response_length(digits, fmt)  # + </s>
    with pytest.raises(ValueError, match="answer_format"):
        correct_response(1, 2, 1, "long")


@pytest.mark.parametrize("digits", [1, 3, 5])
def test_parse_problem_inverts_make_problem_and_refuses_other_texts(digits):
    """The one reader of the prompt format (the learner recomputes rewards against it)."""
    rng = np.random.default_rng(digits)
    for a, b in rng.integers(0, 10**digits, size=(20, 2)):
        prompt, _ = make_problem(int(a), int(b), digits)
        assert parse_problem(prompt, digits) == (a, b)
    zeros = "0" * digits
    for text in (
        "0" + zeros + "+" + zeros + "=",
        zeros + "+" + zeros,
        "x" * digits + "+" + zeros + "=",
        zeros + "-" + zeros + "=",
        " " + zeros + "+" + zeros + "=",
    ):
        assert parse_problem(text, digits) is None, text
