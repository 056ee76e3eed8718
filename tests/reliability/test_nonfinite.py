"""The learner never takes a NaN step: a non-finite loss or gradient is skipped (weights and
optimizer untouched) and counted; ``max_nonfinite_steps`` in a row stop the run loudly. Groups
whose rewards all tie (zero std) give finite zero advantages and a finite step.

Drives the real ``Learner.train_step`` on the cached toy model with crafted groups (the buffer
would reject such groups; this is the learner's own last line of defence)."""

import numpy as np
import pytest
import torch
from verl.utils.config import omega_conf_to_dataclass

from recipe.gepo.embedded.learner import Learner, NonFiniteStepError
from recipe.gepo.embedded.policy import load_policy
from verl_ext.algos.advantages import sequence_advantages
from verl_ext.hetero.records import RolloutGroup

from .conftest import compose_trainer

G, R = 4, 5


@pytest.fixture(scope="module")
def setup(toy_model_path):
    torch.manual_seed(0)
    cfg = compose_trainer()
    actor_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    algorithm_config = omega_conf_to_dataclass(cfg.algorithm)
    model, tokenizer = load_policy(toy_model_path)
    return model, tokenizer, actor_config, algorithm_config


def make_group(tokenizer, uid, seed, rewards=None):
    rng = np.random.default_rng(seed)
    prompt = np.asarray(tokenizer("123+456=", add_special_tokens=False)["input_ids"], dtype=np.int64)
    vocab = [i for i in range(len(tokenizer)) if i != tokenizer.pad_token_id]
    lengths = rng.integers(2, R + 1, size=G)
    mask = (np.arange(R)[None, :] < lengths[:, None]).astype(np.int8)
    rewards = rng.integers(0, 2, size=G).astype(np.float32) if rewards is None else np.asarray(rewards, np.float32)
    return RolloutGroup(
        group_uid=uid,
        prompt_ids=prompt,
        response_ids=(rng.choice(vocab, size=(G, R)) * mask).astype(np.int64),
        response_mask=mask,
        sampler_logprobs=(-rng.uniform(0.5, 3.0, size=(G, R)) * mask).astype(np.float32),
        rewards=rewards,
        advantages=(rewards - rewards.mean()).astype(np.float32),
        policy_version=0,
        sampler_id="test",
    )


def poison(group, how):
    if how == "nan_logprob":
        group.sampler_logprobs[0, 0] = np.nan
    elif how == "nan_advantage":
        group.advantages[1] = np.nan
    elif how == "inf_advantage":
        group.advantages[2] = np.inf
    return group


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("how", ["nan_logprob", "nan_advantage", "inf_advantage"])
def test_nonfinite_step_is_skipped_counted_and_too_many_stop_the_run(setup, how):
    model, tokenizer, actor_config, _ = setup
    learner = Learner(model, actor_config, temperature=1.0, pad_token_id=tokenizer.pad_token_id, max_nonfinite_steps=3)
    good = lambda i: [make_group(tokenizer, f"g{i}-{j}", seed=10 * i + j) for j in range(2)]  # noqa: E731
    bad = lambda i: [make_group(tokenizer, f"b{i}-0", 100 + i), poison(make_group(tokenizer, f"b{i}-1", 200 + i), how)]  # noqa: E731

    before = params(model)
    metrics = learner.train_step(bad(0))
    assert metrics["actor/nonfinite_skipped"] == 1.0 and learner.nonfinite_skipped == 1
    assert learner.version == 0 and metrics["training/policy_version"] == 0.0
    assert same(before, params(model)), "a non-finite step changed the weights"
    assert not learner.optimizer.state, "a non-finite step touched the optimizer state"

    # a finite step in between resets the consecutive count and does update
    metrics = learner.train_step(good(1))
    assert np.isfinite(metrics["actor/loss"]) and learner.version == 1
    after_good = params(model)
    assert not same(before, after_good)

    learner.train_step(bad(2))
    learner.train_step(bad(3))  # two in a row: still below the threshold of 3
    assert learner.nonfinite_skipped == 3 and learner.version == 1
    with pytest.raises(NonFiniteStepError, match=r"3 consecutive steps had a non-finite loss or gradient"):
        learner.train_step(bad(4))
    assert learner.nonfinite_skipped == 4 and learner.version == 1
    final = params(model)
    assert same(after_good, final), "weights changed during the non-finite streak"
    assert all(torch.isfinite(v).all() for v in final.values() if v.is_floating_point())


def test_groups_whose_rewards_all_tie_give_zero_advantages_and_a_finite_step(setup):
    model, tokenizer, actor_config, algorithm_config = setup
    assert algorithm_config.adv_estimator == "grpo"
    # sampler side: verl's grpo estimator on a batch of two groups, one all-tied (std 0)
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    mask = torch.ones(8, R, dtype=torch.long)
    uids = ["tied"] * 4 + ["mixed"] * 4
    for norm in ("true", "false"):
        config = omega_conf_to_dataclass(compose_trainer(f"algorithm.norm_adv_by_std_in_grpo={norm}").algorithm)
        adv = sequence_advantages(rewards, mask, uids, config)
        assert torch.isfinite(adv).all()
        assert torch.allclose(adv[:4], torch.zeros(4)), adv
        assert (adv[4:] != 0).all()
    # learner side: a batch where every group ties
    learner = Learner(model, actor_config, temperature=1.0, pad_token_id=tokenizer.pad_token_id)
    groups = [make_group(tokenizer, f"t{i}", seed=300 + i, rewards=[float(i % 2)] * G) for i in range(3)]
    for g in groups:
        g.advantages = np.zeros(G, dtype=np.float32)
    metrics = learner.train_step(groups)
    assert np.isfinite(metrics["actor/loss"]) and learner.nonfinite_skipped == 0 and learner.version == 1


def test_the_run_of_nonfinite_steps_goes_on_across_a_resume(setup):
    """A learner restored from a checkpoint taken mid-streak keeps counting the streak: a crash
    between non-finite steps does not reset max_nonfinite_steps."""
    model, tokenizer, actor_config, _ = setup
    make = lambda: Learner(
        model, actor_config, temperature=1.0, pad_token_id=tokenizer.pad_token_id, max_nonfinite_steps=2
    )  # noqa: E731
    bad = lambda i: [
        make_group(tokenizer, f"r{i}-0", 400 + i),
        poison(make_group(tokenizer, f"r{i}-1", 500 + i), "nan_advantage"),
    ]  # noqa: E731
    first = make()
    first.train_step(bad(0))
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    with pytest.raises(NonFiniteStepError, match="2 consecutive steps"):
        resumed.train_step(bad(1))
