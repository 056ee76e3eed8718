"""Boxed-answer extraction and the toy task's exact-match reward."""

import pytest

from verl_ext.rewards.extract import last_boxed, last_boxed_content
from verl_ext.rewards.math_reward import RESULT_KEYS
from verl_ext.rewards.toy_reward import compute_score as toy_score
from verl_ext.rewards.toy_reward import extract_sum

EXTRACT_TABLE = [
    (r"so \boxed{5}.", "5"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{ \{1, 2\} }", r"\{1, 2\}"),  # escaped braces do not close the box
    (r"\boxed{a} then \boxed{b}", "b"),
    (r"\boxed{a} then \boxed{b", "a"),  # a truncated last box is ignored
    (r"\fbox{7}", "7"),
    (r"\boxed 12$", "12"),
    (r"\boxed {3}", "3"),
    (r"\boxed{}", None),
    (r"\boxedx{3}", None),  # a different command
    ("no answer", None),
    (r"\boxed{\text{(A)}}", r"\text{(A)}"),
]


@pytest.mark.parametrize("text,content", EXTRACT_TABLE)
def test_last_boxed_content(text, content):
    assert last_boxed_content(text) == content


def test_last_boxed_keeps_command():
    assert last_boxed(r"x \boxed{1} y \fbox{2} z") == r"\fbox{2}"
    assert last_boxed("none") is None
    with pytest.raises(TypeError, match="str"):
        last_boxed(3)


TOY_TABLE = [
    ("0432", "0432", 1.0),
    ("0432</s>", "0432", 1.0),
    (" 0432\n", "0432", 1.0),
    ("432", "0432", 0.0),  # zero padding is part of the answer
    ("04321", "0432", 0.0),
    ("0433", "0432", 0.0),
    ("", "0432", 0.0),
    ("+0432", "0432", 0.0),
]


@pytest.mark.parametrize("response,gold,acc", TOY_TABLE)
def test_toy_exact_match(response, gold, acc):
    out = toy_score("toy_add3", response, gold)
    assert set(out) == set(RESULT_KEYS)
    assert out["acc"] == acc and out["score"] == acc
    assert out["pred"] == extract_sum(response)
    assert out["error"] == ("" if out["pred"] else "no_answer")


@pytest.mark.parametrize("gold", ["", "04a2", None, 1.5, [1]])
def test_toy_bad_gold_named(gold):
    with pytest.raises(ValueError, match="toy ground_truth"):
        toy_score("toy", "0432", gold)


def test_dispatch_routes_by_data_source():
    from verl_ext.rewards.dispatch import compute_score

    toy = compute_score("toy_add3", "0432", "0432")
    assert toy["acc"] == 1.0 and toy["pred"] == "0432"
    # the same text is not a boxed math answer
    math = compute_score("math500", "0432", "432")
    assert math["acc"] == 0.0 and math["error"] == "no_boxed"
    assert compute_score("math500", "\\boxed{0432}", "432")["acc"] == 1.0
    assert set(toy) == set(math)
    with pytest.raises(TypeError, match="data_source"):
        compute_score(None, "1", "1")
