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


@pytest.mark.slow
def test_lying_pools_beside_an_honest_one_get_no_lie_trained_and_the_honest_pool_no_refusal(tmp_path):
    """One verl-engine learner, the honest pool 32 and a pool telling every lie of POOL_LIES in turn
    under its identities, 16 steps on a folder exchange (~5 min): no lying group trained, the honest pool
    neither quarantined nor refused for a trust reason, every impatient lie a check can see quarantined."""
    report = pool_liars.run(tmp_path / "soak", steps=16)
    print(report)
    assert report["learner_rc"] == 0 and report["steps"] == 16 and report["trained_twice"] == 0
    assert sum(report["poisoned groups trained on"].values()) == 0 and report["honest groups rejected"] == []
    assert all(report["lies sent"][kind] > 0 for kind in pool_liars.POOL_LIES)
    caught = {
        "q_scaled": "bad_logprobs",
        "reward_flip": "bad_rewards",
        "reward_inflate": "bad_rewards",
        "malformed": "token_id",
    }
    assert {k: report["liars quarantined"][k] for k in caught} == caught
    named = {tuple(pair) for pair in report["refusals named"]}
    ids = pool_liars.liar_id
    assert {
        (ids("forged_signature"), "unenrolled"),
        (ids("replay"), "replayed"),
        (ids("near_copy"), "replayed"),
    } <= named
