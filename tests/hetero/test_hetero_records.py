"""Rollout records: validation names field and sampler; serialisation round-trips."""

import pickle

import numpy as np
import pytest
import torch

from verl_ext.hetero.records import RecordRejected, RecordSpec, RolloutGroup, validate_group


def test_valid_group_passes_and_round_trips(make_group):
    group = make_group("s1-g0", version=3, group_size=4, sampler="s1")
    validate_group(group, RecordSpec(group_size=4, reward_range=(0.0, 1.0)), learner_version=3)
    for restored in (RolloutGroup.from_bytes(group.to_bytes()), pickle.loads(pickle.dumps(group))):
        assert restored.group_uid == "s1-g0" and restored.policy_version == 3 and restored.sampler_id == "s1"
        assert restored.created_at == group.created_at
        for name in (
            "prompt_ids",
            "prompt_mask",
            "response_ids",
            "response_mask",
            "sampler_logprobs",
            "rewards",
            "advantages",
        ):
            np.testing.assert_array_equal(getattr(restored, name), getattr(group, name))
            assert getattr(restored, name).dtype == getattr(group, name).dtype


def test_torch_inputs_are_accepted_and_as_torch_gives_tensors(make_group):
    base = make_group("g", version=0)
    group = RolloutGroup(
        group_uid="t",
        prompt_ids=torch.from_numpy(base.prompt_ids),
        response_ids=torch.from_numpy(base.response_ids),
        response_mask=torch.from_numpy(base.response_mask),
        sampler_logprobs=torch.from_numpy(base.sampler_logprobs),
        rewards=torch.from_numpy(base.rewards),
        advantages=torch.from_numpy(base.advantages),
        policy_version=0,
        sampler_id=2,
        extra={"source": "toy"},
    )
    validate_group(group, RecordSpec(group_size=4))
    tensors = RolloutGroup.from_bytes(group.to_bytes()).as_torch()
    assert tensors["response_mask"].dtype == torch.bool and tensors["response_ids"].dtype == torch.int64
    assert torch.equal(tensors["response_ids"], torch.from_numpy(base.response_ids))
    assert tensors["extra"] == {"source": "toy"}
    assert group.sampler_id == "2" and tensors["sampler_id"] == "2"  # integer sampler ids become strings


@pytest.mark.parametrize(
    "field,make_value,reason",
    [
        ("sampler_logprobs", lambda g: np.where(g.response_mask, np.nan, 0).astype(np.float32), "nonfinite_logprob"),
        ("sampler_logprobs", lambda g: np.abs(g.sampler_logprobs) + g.response_mask * 0.5, "positive_logprob"),
        ("rewards", lambda g: np.array([1, np.inf, 0, 0], dtype=np.float32), "nonfinite_reward"),
        ("rewards", lambda g: np.zeros(3, dtype=np.float32), "shape"),
        ("advantages", lambda g: np.full(4, np.nan, dtype=np.float32), "nonfinite_advantage"),
        ("advantages", lambda g: np.zeros((4, 2), dtype=np.float32), "shape"),
        ("response_mask", lambda g: np.zeros((4, 5), dtype=np.int8), "shape"),
        ("response_mask", lambda g: g.response_mask * 2, "mask"),
        ("response_mask", lambda g: np.concatenate([np.zeros((1, 6), np.int8), g.response_mask[1:]]), "empty_response"),
        ("response_ids", lambda g: g.response_ids.astype(np.float32), "dtype"),
        ("prompt_ids", lambda g: np.zeros((0,), dtype=np.int64), "shape"),
        ("policy_version", lambda g: 9, "future_version"),
        ("policy_version", lambda g: -1, "version"),
        ("group_uid", lambda g: "", "uid"),
    ],
)
def test_bad_field_is_rejected_naming_field_and_sampler(make_group, field, make_value, reason):
    group = make_group("bad-1", version=2, sampler="sampler-7")
    setattr(group, field, make_value(group))
    with pytest.raises(RecordRejected) as info:
        validate_group(group, RecordSpec(group_size=4), learner_version=5)
    assert info.value.reason == reason
    assert info.value.field == field
    assert "sampler-7" in str(info.value) and repr(field) in str(info.value)


def test_a_malformed_group_from_the_future_is_rejected_for_what_is_malformed(make_group):
    """Content first, timing last: a wrong-size group whose version is also ahead of the learner
    (as after a learner crash) names its size, the fault a sampler can fix."""
    group = make_group("g", version=9, group_size=3)
    with pytest.raises(RecordRejected) as info:
        validate_group(group, RecordSpec(group_size=4), learner_version=5)
    assert info.value.reason == "group_size"
    with pytest.raises(RecordRejected) as info:
        validate_group(make_group("g", version=9), RecordSpec(group_size=4), learner_version=5)
    assert info.value.reason == "future_version"


def test_group_size_reward_range_and_tolerance(make_group):
    group = make_group("g", version=0, group_size=3)
    with pytest.raises(RecordRejected, match="group size 3 != configured group_size 4"):
        validate_group(group, RecordSpec(group_size=4))
    group.rewards = np.array([0.0, 2.0, 1.0], dtype=np.float32)
    with pytest.raises(RecordRejected, match=r"outside reward_range \[0.0, 1.0\]"):
        validate_group(group, RecordSpec(reward_range=(0.0, 1.0)))
    # a tiny positive log-prob from bf16 rounding is tolerated, a real one is not
    group = make_group("g2", version=0)
    group.sampler_logprobs = np.where(group.response_mask, 5e-5, 0).astype(np.float32)
    validate_group(group)
    with pytest.raises(RecordRejected, match="positive_logprob|not a log-probability"):
        validate_group(group, RecordSpec(logprob_tolerance=0.0))
    # padding is never checked: garbage under mask=0 is fine
    group = make_group("g3", version=0)
    group.sampler_logprobs = np.where(group.response_mask, group.sampler_logprobs, np.nan).astype(np.float32)
    validate_group(group)
    empty = make_group("g4", version=0)
    empty.response_mask[0] = 0
    validate_group(empty, RecordSpec(allow_empty_responses=True))


def test_not_a_group_and_garbage_bytes():
    with pytest.raises(RecordRejected, match="expected RolloutGroup, got dict"):
        validate_group({"group_uid": "x"})
    with pytest.raises(ValueError, match="not a safetensors rollout group"):
        RolloutGroup.from_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ValueError, match="RecordSpec: group_size=0"):
        RecordSpec(group_size=0)
