"""uid -> group index has one owner, ``verl_ext.group_index``; the verl
engine's denominator and the bnpo advantage estimator both go through it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl.trainer.ppo.core_algos import get_adv_estimator_fn

import verl_ext.algos.registry  # noqa: F401 -- registers bnpo
from recipe.gepo.verl_engine import batch_rules
from verl_ext.algos import advantages as adv_lib
from verl_ext.group_index import uid_group_index


def test_dense_labels_follow_sorted_uids_in_any_order():
    uids = np.array(["b", "a", "c", "a", "b"], dtype=object)
    assert uid_group_index(uids).tolist() == [1, 0, 2, 0, 1]
    assert uid_group_index([3, 10, 3]).tolist() == [1, 0, 1]  # compared as str: "10" < "3"
    assert uid_group_index(uids, device="cpu").dtype == torch.long
    with pytest.raises(ValueError, match="None"):
        uid_group_index(["a", None])
    with pytest.raises(ValueError, match="1-D"):
        uid_group_index([["a"], ["b"]])


def test_denominator_and_bnpo_use_it():
    # the denominator groups by the same labels: a uid order change leaves it unchanged
    log_q = torch.tensor([[-1.0, -2.0], [-0.5, -0.1], [-3.0, -1.0], [-0.2, -0.2], [-1.5, -0.3], [-0.7, -0.9]])
    den = batch_rules.group_log_denominator(
        log_q, torch.ones(6, 2), np.array(["p2", "p1", "p2", "p1", "p1", "p2"], dtype=object)
    )
    relabelled = batch_rules.group_log_denominator(
        log_q, torch.ones(6, 2), np.array(["a", "b", "a", "b", "b", "a"], dtype=object)
    )
    assert torch.equal(den, relabelled) and den[0] == den[2] == den[5] and den[1] == den[3] == den[4]
    uids = np.array(["p2", "p1", "p2", "p1", "p1", "p2"], dtype=object)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    mask = torch.ones(6, 3)
    rewards = torch.zeros(6, 3)
    rewards[:, -1] = scores
    adv, _ = get_adv_estimator_fn("bnpo")(token_level_rewards=rewards, response_mask=mask, index=uids)
    expected = adv_lib.bnpo_advantages(scores, uid_group_index(uids))
    assert torch.equal(adv[:, 0], expected)
    with pytest.raises(ValueError, match="None"):
        get_adv_estimator_fn("bnpo")(
            token_level_rewards=rewards,
            response_mask=mask,
            index=np.array(["a", None, "a", "b", "b", "b"], dtype=object),
        )
