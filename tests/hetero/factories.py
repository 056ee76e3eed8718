"""Factories shared by the hetero tests."""

import numpy as np

from verl_ext.hetero.records import RolloutGroup


def build_group(
    uid: str,
    version: int,
    group_size: int = 4,
    response_len: int = 6,
    prompt_len: int = 5,
    sampler: str = "s0",
    seed: int = 0,
) -> RolloutGroup:
    """A valid group: random ids, right-padded responses of length 1..response_len, log-probs < 0."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, response_len + 1, size=group_size)
    mask = (np.arange(response_len)[None, :] < lengths[:, None]).astype(np.int8)
    rewards = rng.integers(0, 2, size=group_size).astype(np.float32)
    return RolloutGroup(
        group_uid=uid,
        prompt_ids=rng.integers(0, 1000, size=prompt_len).astype(np.int64),
        response_ids=(rng.integers(0, 1000, size=(group_size, response_len)) * mask).astype(np.int64),
        response_mask=mask,
        sampler_logprobs=(-rng.exponential(1.0, size=(group_size, response_len)) * mask).astype(np.float32),
        rewards=rewards,
        advantages=(rewards - rewards.mean()).astype(np.float32),
        policy_version=version,
        sampler_id=sampler,
        created_at=1000.0 + version,
    )
