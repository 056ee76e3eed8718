"""Math reward: answer-equivalence table, errors, timeouts, threads, format terms, verl plug-in.

Everything runs for real: math_verify in the reward's worker processes, verl's loader.
"""

import math
import os
import signal
import threading
import time

import pytest

from verl_ext.rewards import math_reward
from verl_ext.rewards.math_reward import (
    RESULT_KEYS,
    RewardConfig,
    answer_tag_ok,
    compute_score,
    compute_score_batch,
    reward_stats,
    score_batch,
    think_format_ok,
)
from verl_ext.rewards.verify_pool import VerifyPool, get_pool

B = "\\boxed"

# (gold, response, expected acc, expected error)
EQUIVALENCE_TABLE = [
    # fractions vs decimals, \frac12 shorthand, \dfrac, slash
    ("0.5", B + r"{\frac{1}{2}}", 1.0, ""),
    (r"\frac{1}{2}", B + "{0.5}", 1.0, ""),
    (r"\frac12", B + r"{\frac{1}{2}}", 1.0, ""),
    ("1/2", B + r"{\dfrac{1}{2}}", 1.0, ""),
    (r"\frac{\sqrt{2}}{2}", B + r"{\sqrt2/2}", 1.0, ""),
    ("2", B + "{2.0}", 1.0, ""),
    ("50", B + "{0.5}", 0.0, ""),
    ("2", B + "{2.0000001}", 0.0, ""),
    # intervals: endpoints matter
    ("[1,2)", B + "{[1, 2)}", 1.0, ""),
    (r"(-\infty, 3]", B + r"{(-\infty,3]}", 1.0, ""),
    ("[1,2)", B + "{(1,2]}", 0.0, ""),
    # sets and unordered answer lists
    (r"\{1,2,3\}", B + r"{\{3,2,1\}}", 1.0, ""),
    ("1,2,3", B + "{3, 2, 1}", 1.0, ""),
    (r"\{1,2\}", B + r"{\{1,2,3\}}", 0.0, ""),
    # tuples, matrices
    (r"\left( 3, \frac{\pi}{2} \right)", B + r"{(3,\frac{\pi}{2})}", 1.0, ""),
    (r"\begin{pmatrix}1\\2\end{pmatrix}", B + r"{\begin{pmatrix}1\\2\end{pmatrix}}", 1.0, ""),
    # units, degrees, currency, thousands separators, equations, letter choices
    ("10", B + r"{10\text{ cm}}", 1.0, ""),
    (r"30^\circ", B + "{30}", 1.0, ""),
    (r"\$18", B + "{18}", 1.0, ""),
    ("1000", B + "{1,000}", 1.0, ""),
    ("3", B + "{x = 3}", 1.0, ""),
    # percentages: 17% reads as 17 or 0.17 (math_verify's semantics, whatever antlr is installed)
    (r"17\%", B + r"{17\%}", 1.0, ""),
    (r"17\%", B + "{17}", 1.0, ""),
    (r"17\%", B + "{0.17}", 1.0, ""),
    (r"17\%", B + "{18}", 0.0, ""),
    ("0.5", B + r"{50\%}", 1.0, ""),
    # golds written with sentence punctuation or \! thousands separators are still usable
    (r"7\text{ hours}.", B + "{7}", 1.0, ""),
    (r"\dfrac{1}{29,\!322,\!216}", B + r"{\frac{1}{29322216}}", 1.0, ""),
    (r"\text{(C)}", B + "{C}", 1.0, ""),
    # wrong answers; only the LAST boxed answer counts
    ("204", B + "{205}", 0.0, ""),
    ("204", "first " + B + "{100}, corrected: " + B + "{204}.", 1.0, ""),
    ("204", "first " + B + "{204}, then changed to " + B + "{205}", 0.0, ""),
    ("204", r"\fbox{204}", 1.0, ""),
    ("204", B + " 204$", 1.0, ""),
    # no boxed answer
    ("3", "The answer is 3.", 0.0, "no_boxed"),
    ("3", "truncated " + B + "{3", 0.0, "no_boxed"),
    ("3", B + "{ }", 0.0, "no_boxed"),
    # a box math_verify extracts nothing from; and free text that merely differs
    ("3", B + r"{\text{}}", 0.0, "pred_unparsable"),
    ("3", B + r"{\text{no idea}}", 0.0, ""),
    # unparsable gold never scores, even when the response repeats it verbatim
    ("???", B + "{???}", 0.0, "gold_unparsable"),
    ("", B + "{3}", 0.0, "gold_unparsable"),
    (r"\frac{", B + r"{\frac{}", 0.0, "no_boxed"),  # "\frac{" unbalanced: no complete box
    (r"\frac{", B + "{3}", 0.0, "gold_unparsable"),
]


@pytest.mark.parametrize("gold,response,acc,error", EQUIVALENCE_TABLE)
def test_equivalence_table(gold, response, acc, error):
    out = compute_score("math500", response, gold)
    assert set(out) == set(RESULT_KEYS)
    assert out["acc"] == acc, out
    assert out["score"] == acc  # default config: score is accuracy only
    assert out["error"] == error, out
    assert out["gold_unparsable"] == (1.0 if error == "gold_unparsable" else 0.0)
    assert out["timeout"] == 0.0


def test_pred_is_last_boxed_content():
    out = compute_score("m", r"we get \boxed{1} and finally \boxed{\frac{a}{b}}.", "3")
    assert out["pred"] == r"\frac{a}{b}"
    assert out["acc"] == 0.0
    assert compute_score("m", "no box", "3")["pred"] == ""


def test_numeric_and_list_ground_truth():
    assert compute_score("m", B + "{204}", 204)["acc"] == 1.0
    assert compute_score("m", B + "{0.25}", 0.25)["acc"] == 1.0
    # a list of acceptable golds: any match counts; an unparsable member does not poison it
    assert compute_score("m", B + "{12}", ["\\frac{", "12"])["acc"] == 1.0
    assert compute_score("m", B + "{13}", ["11", "12"])["acc"] == 0.0


@pytest.mark.parametrize(
    "bad,match",
    [(None, "ground_truth"), (True, "ground_truth"), ([], "ground_truth"), ({"a": 1}, "ground_truth")],
)
def test_bad_ground_truth_named(bad, match):
    with pytest.raises(TypeError, match=match):
        compute_score("m", B + "{1}", bad)


def test_bad_solution_named():
    with pytest.raises(TypeError, match="solution_str"):
        compute_score("m", None, "1")


# ---------------------------------------------------------------------------------------------
# timeouts and the worker pool


# sympy evaluates this power tower exactly while comparing with 3: it runs for minutes
PATHOLOGICAL = B + "{9^{9^{9^{9}}}}"


def test_timeout_scores_zero_is_counted_and_pool_recovers():
    before = reward_stats()["timeouts"]
    t0 = time.monotonic()
    out = compute_score("m", PATHOLOGICAL, "3", timeout_seconds=1.0)
    elapsed = time.monotonic() - t0
    assert out["error"] == "timeout"
    assert out["acc"] == 0.0 and out["score"] == 0.0 and out["timeout"] == 1.0
    assert elapsed < 6.0  # 1 s budget + kill + (no) restart; far below the minutes it would take
    assert reward_stats()["timeouts"] == before + 1
    # the killed worker is replaced: scoring goes on
    assert compute_score("m", B + "{3}", "3")["acc"] == 1.0


def test_timeout_in_batch_does_not_block_the_rest():
    sols = [PATHOLOGICAL, B + "{1}", B + "{2}", B + "{4}"]
    out = score_batch(sols, ["3", "1", "2", "5"], timeout_seconds=1.0)
    assert [o["error"] for o in out] == ["timeout", "", "", ""]
    assert [o["acc"] for o in out] == [0.0, 1.0, 1.0, 0.0]


def test_scoring_from_threads():
    # math_verify's own signal.alarm timeouts raise outside the main thread; ours do not
    results = {}

    def run(i):
        results[i] = compute_score("m", B + "{%d/4}" % i, str(i / 4))["acc"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: 1.0 for i in range(1, 9)}


def test_worker_killed_from_outside_is_replaced():
    pool = VerifyPool(num_workers=1)
    try:
        assert pool.check(["2"], "2", timeout=10)["correct"] is True
        (pid,) = pool.worker_pids()
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
        assert pool.check(["2"], "3", timeout=10) == {"status": "ok", "correct": False}
        assert pool.stats["worker_errors"] == 1
        assert pool.worker_pids() != [pid]
    finally:
        pool.close()
    assert pool.worker_pids() == []


def test_pool_timeout_kills_the_worker_process():
    pool = VerifyPool(num_workers=1)
    try:
        pool.check(["1"], "1", timeout=10)  # start the worker
        (pid,) = pool.worker_pids()
        assert pool.check(["3"], "9^{9^{9^{9}}}", timeout=0.5)["status"] == "timeout"
        assert pool.worker_pids() == []
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    finally:
        pool.close()


def test_pool_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_workers"):
        VerifyPool(num_workers=0)
    with pytest.raises(ValueError, match="timeout"):
        get_pool().check(["1"], "1", timeout=0)


# ---------------------------------------------------------------------------------------------
# batch scoring


def test_score_batch_matches_single_calls_in_order():
    sols = [B + "{%d}" % i for i in range(12)] + ["no answer"]
    golds = [str(i if i % 3 else i + 1) for i in range(12)] + ["1"]
    batch = score_batch(sols, golds)
    single = [compute_score("m", s, g) for s, g in zip(sols, golds)]
    assert batch == single
    assert [b["acc"] for b in batch] == [0.0 if i % 3 == 0 else 1.0 for i in range(12)] + [0.0]


def test_score_batch_length_mismatch_named():
    with pytest.raises(ValueError, match="3 solutions and 2 ground truths"):
        score_batch(["a", "b", "c"], ["1", "2"])


def test_compute_score_batch_verl_signature():
    out = compute_score_batch(["m", "m"], [B + "{1}", B + "{2}"], ["1", "3"], [{}, {}])
    assert [o["acc"] for o in out] == [1.0, 0.0]


# ---------------------------------------------------------------------------------------------
# format terms and weights

THINK_TABLE = [
    ("<think>reasoning</think> answer " + B + "{1}", True),
    ("reasoning</think>\nThe answer is 1.", True),  # opening tag in the prompt
    ("  <think>x</think>y", True),
    ("<think>reasoning</think>   ", False),  # nothing after the thoughts
    ("<think>never closed " + B + "{1}", False),
    ("<think>a</think>b</think>c", False),
    ("<think>a<think>b</think>c", False),
    ("preamble <think>a</think>b", False),
    ("</think><think>b", False),
    (B + "{1}", False),
]


@pytest.mark.parametrize("text,ok", THINK_TABLE)
def test_think_format(text, ok):
    assert think_format_ok(text) is ok


ANSWER_TABLE = [
    ("<answer>" + B + "{3}</answer>", True),
    ("<think>t</think><answer>3</answer>", True),
    ("<answer>3</answer><think>t</think>", False),  # answer must follow the thoughts
    ("<answer>  </answer>", False),
    ("<answer>3</answer><answer>4</answer>", False),
    ("<answer>3", False),
    ("3</answer>", False),
]


@pytest.mark.parametrize("text,ok", ANSWER_TABLE)
def test_answer_tag_format(text, ok):
    assert answer_tag_ok(text) is ok


def test_weighted_total():
    cfg = RewardConfig(accuracy_weight=1.0, boxed_weight=0.1, think_weight=0.2, answer_tag_weight=0.4)
    full = "<think>t</think><answer>" + B + "{7}</answer>"
    out = compute_score("m", full, "7", config=cfg)
    assert (out["acc"], out["format_boxed"], out["format_think"], out["format_answer"]) == (1, 1, 1, 1)
    assert math.isclose(out["score"], 1.7)
    wrong = compute_score("m", full, "8", config=cfg)
    assert math.isclose(wrong["score"], 0.7) and wrong["acc"] == 0.0
    bare = compute_score("m", "no tags, no box", "8", config=cfg)
    assert bare["score"] == 0.0
    # keyword overrides (verl's reward_kwargs) replace single fields of the config
    assert math.isclose(compute_score("m", full, "8", config=cfg, think_weight=0.0)["score"], 0.5)
    assert math.isclose(compute_score("m", full, "7", config={"accuracy_weight": 2.0})["score"], 2.0)


@pytest.mark.parametrize(
    "field,value",
    [
        ("timeout_seconds", 0),
        ("timeout_seconds", float("inf")),
        ("accuracy_weight", float("nan")),
        ("boxed_weight", "0.1"),
        ("float_rounding", -1),
        ("num_workers", 0),
    ],
)
def test_config_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        RewardConfig(**{field: value})


def test_unknown_override_named_but_verl_kwargs_ignored():
    with pytest.raises(TypeError, match="thinkweight"):
        compute_score("m", B + "{1}", "1", thinkweight=0.1)
    out = compute_score("m", B + "{1}", "1", reward_router_address=None, reward_model_tokenizer=None)
    assert out["acc"] == 1.0


def test_every_config_field_is_documented():
    source = open(math_reward.__file__).read()
    block = source[source.index("class RewardConfig") : source.index("def __post_init__")]
    for line in [ln for ln in block.splitlines() if ln.startswith("    ") and ": " in ln and " = " in ln]:
        idx = block.splitlines().index(line)
        assert block.splitlines()[idx - 1].strip().startswith("#:"), f"undocumented field: {line.strip()}"


# ---------------------------------------------------------------------------------------------
# verl loads it unchanged


@pytest.mark.parametrize("path", ["pkg://verl_ext.rewards.math_reward", os.path.abspath(math_reward.__file__)])
def test_loads_through_verl_custom_reward_function(path):
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    cfg = OmegaConf.create(
        {
            "reward": {
                "custom_reward_function": {
                    "path": path,
                    "name": "compute_score",
                    "reward_kwargs": {"think_weight": 0.5},
                }
            }
        }
    )
    fn = get_custom_reward_fn(cfg)
    out = fn(data_source="math500", solution_str="<think>t</think> " + B + "{2}", ground_truth="2", extra_info={})
    assert out["score"] == 1.5 and out["acc"] == 1.0


def test_forked_child_gets_its_own_pool():
    # DataLoader-style fork after the pool exists: the child must not talk to the parent's workers
    parent_pool = get_pool()
    assert compute_score("m", B + "{1}", "1")["acc"] == 1.0
    parent_pids = parent_pool.worker_pids()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            ok = compute_score("m", B + r"{\frac{2}{4}}", "0.5")["acc"] == 1.0
            fresh = get_pool() is not parent_pool and not set(get_pool().worker_pids()) & set(parent_pids)
            os.write(w, b"1" if ok and fresh else b"0")
        finally:
            os._exit(0)
    os.close(w)
    answer = os.read(r, 1)
    os.waitpid(pid, 0)
    os.close(r)
    assert answer == b"1"
    assert parent_pool.worker_pids() == parent_pids  # the parent's workers are untouched
    assert compute_score("m", B + "{2}", "2")["acc"] == 1.0
