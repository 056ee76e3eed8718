"""The gate's shortcuts give the verdicts the plain checks give: a re-score runs its forward on a
group's distinct responses, a version's weights are copied into the scorer tensor by tensor, the
rewards check scores each distinct response once and keeps the advantages it recomputed by their
exact inputs. Real groups of the tiny toy model, the real :class:`GroupVerifier` of a
:class:`TrustGate` (``Lab`` of ``test_trust_gate.py``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from verl_ext.sampling import sequence_token_log_probs
from verl_ext.trust.verifier import distinct_responses, group_log_probs, group_scores
from verl_ext.hetero.weights import serialize_state_dict

from .test_trust_gate import Lab, _with_rewards


def _with_repeated_rows(group, rows):
    """``group`` with its responses (tokens, masks, q, rewards, advantages) taken from ``rows``."""
    rows = np.asarray(rows)
    return dataclasses.replace(
        group,
        response_ids=group.response_ids[rows].copy(),
        response_mask=group.response_mask[rows].copy(),
        sampler_logprobs=group.sampler_logprobs[rows].copy(),
        rewards=group.rewards[rows].copy(),
        advantages=group.advantages[rows].copy(),
    )


def _full_forward(model, group) -> np.ndarray:
    """float32 [G, R]: every row of the group through one forward, duplicates included (the re-score
    before it ran on distinct rows)."""
    g = group.response_ids.shape[0]
    prompt_mask = group.prompt_mask if group.prompt_mask is not None else np.ones_like(group.prompt_ids)
    with torch.no_grad():
        return (
            sequence_token_log_probs(
                model,
                torch.as_tensor(group.prompt_ids).long().expand(g, -1),
                torch.as_tensor(prompt_mask).long().expand(g, -1),
                torch.as_tensor(group.response_ids).long(),
                torch.as_tensor(group.response_mask).long(),
                1.0,
            )
            .float()
            .numpy()
        )


def test_distinct_responses_tell_rows_apart_by_tokens_and_mask():
    group = type("G", (), {})()
    group.response_ids = np.asarray([[5, 7, 0], [5, 7, 0], [5, 7, 0], [6, 7, 0]])
    group.response_mask = np.asarray([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0]])  # row 2: token 0 is real
    firsts, row_of = distinct_responses(group)
    assert firsts.tolist() == [0, 2, 3]
    assert row_of.tolist() == [0, 0, 1, 2]


def test_a_group_with_repeated_responses_is_rescored_as_a_full_forward_would(tiny_model_path, tmp_path):
    lab = Lab(tiny_model_path, tmp_path)
    group = _with_repeated_rows(lab.groups("sampler-0", n=1)[0], [0, 1, 0, 1])
    expected = _full_forward(lab.model, group)
    np.testing.assert_allclose(group_log_probs(lab.model, group, 1.0), expected, rtol=0, atol=1e-6)
    logprobs, logits = group_scores(lab.model, group, 1.0)
    np.testing.assert_allclose(logprobs, expected, rtol=0, atol=1e-6)
    assert logits.shape[0] == 4 and torch.equal(logits[0], logits[2]) and torch.equal(logits[1], logits[3])
    # the gate's verdicts on it: honest passes; q of one copy scaled fails
    assert lab.gate.verifier.measure_logprobs(group)[0] is None
    lying = dataclasses.replace(group, sampler_logprobs=group.sampler_logprobs.copy())
    lying.sampler_logprobs[2] *= 1.5  # a copy of row 0 whose q is not row 0's
    assert lab.gate.verifier.measure_logprobs(lying)[0][0] == "bad_logprobs"


def test_each_version_is_rescored_with_its_own_weights_whatever_was_loaded_before(tiny_model_path, tmp_path):
    """The scorer switches between versions 0 and 1 (weights copied into its tensors): every re-score
    is the claimed version's, and a group honest under one version fails claiming the other."""
    lab = Lab(tiny_model_path, tmp_path)
    verifier = lab.gate.verifier
    of_v0 = lab.groups("sampler-0", n=1)[0]
    of_v1 = dataclasses.replace(lab.groups("sampler-1", n=1, model=lab.v1)[0], policy_version=1)
    for _ in range(2):  # v0, v1, v0, v1: each check needs the version the scorer does not hold
        for group, model in ((of_v0, lab.model), (of_v1, lab.v1)):
            np.testing.assert_allclose(verifier.rescore(group), group_log_probs(model, group, 1.0), rtol=0, atol=1e-6)
            assert verifier.measure_logprobs(group)[0] is None
    assert verifier.measure_logprobs(dataclasses.replace(of_v0, policy_version=1))[0][0] == "bad_logprobs"
    assert verifier.measure_logprobs(dataclasses.replace(of_v1, policy_version=0))[0][0] == "bad_logprobs"


def test_a_version_message_that_does_not_fit_the_scorer_is_refused_by_name(tiny_model_path, tmp_path):
    lab = Lab(tiny_model_path, tmp_path)
    state = lab.model.state_dict()
    missing = sorted(state)[0]
    lab.gate.verifier.remember(2, serialize_state_dict({k: v for k, v in state.items() if k != missing}, 2))
    group = dataclasses.replace(lab.groups("sampler-0", n=1)[0], policy_version=2)
    with pytest.raises(RuntimeError, match=missing):
        lab.gate.verifier.measure_logprobs(group)


def test_rewards_of_repeated_responses_and_reused_advantages_still_catch_lies(tiny_model_path, tmp_path):
    lab = Lab(tiny_model_path, tmp_path)
    verifier = lab.gate.verifier
    group = lab.groups("sampler-0", n=1)[0]
    repeated = _with_repeated_rows(group, [0, 0, 1, 1])
    _with_rewards(lab, repeated, repeated.rewards)  # the advantages of its rewards
    assert verifier.check_group_rewards(repeated) is None
    assert verifier.check_group_rewards(repeated) is None  # its advantages now reused
    # two identical responses reported with different rewards (advantages made consistent with them)
    flipped = dataclasses.replace(repeated, rewards=repeated.rewards.copy())
    flipped.rewards[1] = 1.0 - flipped.rewards[1]
    _with_rewards(lab, flipped, flipped.rewards)
    assert verifier.check_group_rewards(flipped)[0] == "bad_rewards"
    # the same rewards and mask as an accepted group, other advantages: the reused ones still differ
    wrong = dataclasses.replace(repeated, advantages=-repeated.advantages + 0.5)
    assert verifier.check_group_rewards(wrong)[0] == "bad_advantages"
