"""Groups between verl's agent-loop rows and the exchange (recipe/gepo/verl_engine/pool_groups.py):
built from a real ``DataProto`` shaped as verl's agent loop returns it, and written back as the
TransferQueue rows verl's replay buffer reads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl import DataProto

from recipe.gepo.verl_engine.pool_groups import groups_from_agent_output, trajectory_fields
from verl_ext.hetero.records import RolloutGroup

P, R, G = 5, 4, 3


def agent_output(prompts: list[list[int]], versions=(7, 7)) -> DataProto:
    """Rows as ``AgentLoopManager.generate_sequences`` returns them: G per prompt, prompts
    left-padded to P, responses right-padded to R, the reward on the last response token."""
    rows = len(prompts) * G
    prompt_t = torch.zeros(rows, P, dtype=torch.int64)
    attention = torch.zeros(rows, P + R, dtype=torch.int64)
    responses = torch.zeros(rows, R, dtype=torch.int64)
    mask = torch.zeros(rows, R, dtype=torch.int64)
    logq = torch.zeros(rows, R)
    scores = torch.zeros(rows, R)
    for r in range(rows):
        ids = prompts[r // G]
        prompt_t[r, P - len(ids) :] = torch.tensor(ids)
        attention[r, P - len(ids) : P] = 1
        length = 1 + r % R
        responses[r, :length] = torch.arange(10 + r, 10 + r + length)
        mask[r, :length] = 1
        attention[r, P : P + length] = 1
        logq[r, :length] = -0.1 * (r + 1)
        scores[r, length - 1] = float(r % 2)
    batch = {
        "prompts": prompt_t,
        "attention_mask": attention,
        "responses": responses,
        "response_mask": mask,
        "rollout_log_probs": logq,
        "rm_scores": scores,
    }
    non_tensor = {
        "min_global_steps": np.array([versions[0]] * rows, dtype=object),
        "max_global_steps": np.array([versions[1]] * rows, dtype=object),
    }
    return DataProto.from_dict(tensors=batch, non_tensors=non_tensor)


def test_one_group_per_prompt_with_its_tokens_q_rewards_and_version():
    out = agent_output([[1, 2, 3], [4, 5]])
    groups = groups_from_agent_output(out, G, ["u-0", "u-1"], "pool-3", "fp32")
    assert [g.group_uid for g in groups] == ["u-0", "u-1"]
    first, second = groups
    assert first.prompt_ids.tolist() == [1, 2, 3] and second.prompt_ids.tolist() == [4, 5]
    assert first.policy_version == 7 and first.sampler_id == "pool-3" and first.sampler_precision == "fp32"
    assert first.response_lengths.tolist() == [1, 2, 3] and second.response_lengths.tolist() == [4, 1, 2]
    assert first.rewards.tolist() == [0.0, 1.0, 0.0]
    assert np.allclose(first.sampler_logprobs[2, :3], -0.3) and (first.sampler_logprobs[2, 3:] == 0).all()
    # the record survives the wire unchanged
    assert RolloutGroup.from_bytes(first.to_bytes()).response_ids.tolist() == first.response_ids.tolist()


@pytest.mark.parametrize("versions", [(3, 4), (None, None)])
def test_a_group_generated_under_more_or_no_weight_version_is_refused(versions):
    with pytest.raises(ValueError, match="weight versions"):
        groups_from_agent_output(agent_output([[1, 2]], versions), G, ["u"], "pool-3", "fp32")


def test_rows_that_do_not_share_a_prompt_are_not_one_group():
    out = agent_output([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="rows for 1 prompts"):
        groups_from_agent_output(out, G, ["u"], "pool-3", "fp32")
    out.batch["prompts"][1, -1] = 99
    with pytest.raises(ValueError, match="do not share one prompt"):
        groups_from_agent_output(out, G, ["u-0", "u-1"], "pool-3", "fp32")


def test_a_group_fills_a_trainer_slot_as_verls_agent_loop_writes_transfer_queue():
    (group,) = groups_from_agent_output(agent_output([[1, 2, 3]]), G, ["g"], "pool-3", "fp32")
    slot = {"uid": "abc123", "global_steps": 5, "index": 11, "data_source": "slot's", "input_ids": torch.zeros(P)}
    keys, fields, tags = trajectory_fields(group, slot, {"data_source": "toy_add3", "not_a_slot_key": 1})
    assert keys == ["abc123_0_0", "abc123_1_0", "abc123_2_0"]
    assert [t["min_global_steps"] for t in tags] == [7, 7, 7] and [t["global_steps"] for t in tags] == [5, 5, 5]
    assert [t["response_len"] for t in tags] == [1, 2, 3] and tags[2]["seq_len"] == 6
    row = fields[2]
    assert row["prompts"].tolist() == [1, 2, 3] and row["responses"].tolist() == [12, 13, 14]
    assert row["input_ids"].tolist() == [1, 2, 3, 12, 13, 14] and row["position_ids"].tolist() == list(range(6))
    assert row["rm_scores"].tolist() == [0.0, 0.0, 0.0] and fields[1]["rm_scores"].tolist() == [0.0, 1.0]
    assert torch.allclose(row["rollout_log_probs"], torch.full((3,), -0.3))
    assert row["loss_mask"].tolist() == row["response_mask"].tolist() == [1, 1, 1]
    # the learner's own row replaces the slot's data fields; keys the slot lacks are not added
    assert row["data_source"] == "toy_add3" and "not_a_slot_key" not in row and row["uid"] == "abc123"


def test_an_idle_exchange_is_read_less_and_less_often_and_at_once_again_when_busy():
    from recipe.gepo.verl_engine.pool_ingress import PoolIngress, next_poll_wait

    fast, slow = PoolIngress.POLL_S, PoolIngress.IDLE_POLL_S
    waits, wait = [], fast
    for _ in range(7):
        wait = next_poll_wait(wait, False, fast, slow)
        waits.append(wait)
    assert waits == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert next_poll_wait(slow, True, fast, slow) == fast
