"""The default run's representative cases: the rest are marked slow, and a kept name that matches nothing fails."""

import pytest

from tests.subsets import default_run_keeps


def _slow(param) -> bool:
    return any(mark.name == "slow" for mark in param.marks)


def test_cases_not_kept_go_to_the_slow_tier_and_keep_their_own_marks():
    xfail = pytest.mark.xfail(strict=True)
    cases = ["gepo", "grpo", pytest.param("gspo", marks=[xfail], id="gspo-x"), ("a", 1)]
    out = default_run_keeps(cases, ("grpo", ("a", 1)))
    assert [_slow(p) for p in out] == [True, False, True, False]
    assert out[2].id == "gspo-x" and xfail in out[2].marks
    assert out[3].values == ("a", 1)


def test_a_kept_name_that_matches_no_case_fails_naming_it():
    with pytest.raises(ValueError, match="'gepo_renamed'"):
        default_run_keeps(["gepo", "grpo"], ("gepo_renamed",))
    with pytest.raises(ValueError, match="keeps no case"):
        default_run_keeps([(["x=1"], "x")], lambda case: case[1] == "y")
