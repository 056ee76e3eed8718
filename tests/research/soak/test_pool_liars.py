"""The verl engine's lying pools (research/soak/pool_liars.py): each lie changes what it claims to,
and the identities are the ones the soak enrols (outsiders excepted)."""

import numpy as np
import pytest

from research.soak import pool_liars
from tests.hetero.factories import build_group


@pytest.mark.parametrize("kind", pool_liars.POOL_LIES)
def test_each_lie_changes_what_it_claims_to(kind):
    group = build_group("r60-a-b0-0", 3, sampler="pool-61")
    honest = build_group("r32-a-b0-0", 3, sampler="pool-32", seed=1)
    out = pool_liars.lied(kind, group, honest, vocab_size=1000)
    lie = kind.removeprefix("patient_")
    changed = {
        f
        for f in ("sampler_logprobs", "rewards", "response_ids")
        if not np.array_equal(getattr(out, f), getattr(group, f))
    }
    expected = {
        "q_scaled": {"sampler_logprobs"},
        "q_scaled_slightly": {"sampler_logprobs"},
        "reward_flip": {"rewards"},
        "reward_inflate": {"rewards"} if group.rewards.min() < 1 else set(),
        "malformed": {"response_ids"},
        "forged_signature": set(),
        "unsigned": set(),
    }
    if lie in ("replay", "near_copy"):  # another pool's tokens under this group's uid and identity
        assert (out.group_uid, out.sampler_id) == (group.group_uid, group.sampler_id)
        assert sorted(map(tuple, out.response_ids)) == sorted(map(tuple, honest.response_ids))
        assert pool_liars.lied(kind, group, None, vocab_size=1000) is None  # nothing to copy yet
    else:
        assert changed == expected[lie]
    if lie == "malformed":
        assert out.response_ids[0, 0] == 1000


def test_every_liar_has_its_own_identity_and_only_insiders_are_enrolled():
    ids = [pool_liars.liar_id(k) for k in pool_liars.POOL_LIES]
    assert len(set(ids)) == len(ids) and f"pool-{pool_liars.HONEST_INDEX}" not in ids
    assert set(pool_liars.OUTSIDERS) <= set(pool_liars.POOL_LIES)
