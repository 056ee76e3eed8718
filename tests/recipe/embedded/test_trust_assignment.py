"""Seeds and prompts the learner assigns (verl_ext.trust.assignment) against the real gate, with
real groups of the tiny toy model and checkable sampling on: a sampler that draws a prompt with
seeds of its choosing and sends the best draw, sends two draws of one slot, or picks its own
prompts is refused; honest assigned groups pass, across a gate resume too."""

from __future__ import annotations

import dataclasses

import pytest

from recipe.gepo.embedded.rollout_groups import RolloutSettings, generate_groups
from verl_ext.trust.assignment import assigned_seed, gumbel_key, prompt_stream

from .test_checkable_sampling_gate import ON
from .test_trust_gate import Lab


@pytest.fixture(scope="module")
def lab(tiny_model_path, tmp_path_factory):
    return Lab(tiny_model_path, tmp_path_factory.mktemp("assignment"), ON)


def test_honest_groups_carry_their_slot_and_the_assigned_seed_and_pass(lab):
    groups = lab.groups("sampler-3", n=4)
    key = gumbel_key(lab.gate.ledger.secret)
    for group in groups:
        assert group.sampling_seed == assigned_seed(key, "sampler-3", group.batch_index, group.batch_slot, 0)
        assert lab.offer(group) is None
    assert [(g.batch_index - groups[0].batch_index, g.batch_slot) for g in groups] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_the_best_of_eight_seeds_is_refused_and_its_sampler_quarantined(lab):
    """The issue's attack: each prompt drawn with 8 seeds of the sampler's choice, the draw with
    the highest mean reward sent. Its seed is not the assigned one (and its tokens are that seed's
    honest draw, so only the assignment can refuse it)."""
    sampler = "sampler-4"
    honest = lab.groups(sampler, n=1)[0]
    s = lab.engine.settings
    item = lab.task.train_items(s.prompts_per_step, stream=prompt_stream(sampler), index=honest.batch_index + 1)[0]
    draws = [
        generate_groups(
            lab.model, lab.tokenizer, [item], lab.task.score,
            RolloutSettings(s.group_size, s.temperature, s.max_new_tokens), lab.engine.algorithm,
            policy_version=0, sampler_id=sampler, seed=seed, uid_prefix=f"{sampler}-b{honest.batch_index + 1}",
            checkable=True,
        )[0]
        for seed in range(8)
    ]  # fmt: skip
    best = max(draws, key=lambda g: float(g.rewards.mean()))
    best = dataclasses.replace(best, batch_index=honest.batch_index + 1, batch_slot=0)
    failure, _ = lab.gate.verifier.measure_logprobs(best)
    assert failure is None  # its tokens are its own seed's honest draw: the re-score alone passes it
    assert lab.offer(honest) is None
    assert lab.offer(best) == "seed_not_assigned"
    assert lab.gate.ledger.refusal(sampler) == "quarantined"


def test_a_second_draw_of_a_slot_is_refused_without_blame_across_a_resume(lab, tiny_model_path, tmp_path):
    """The same slot drawn with its assigned seeds at v0 and at v1 (both honest draws): the first
    to arrive is the slot's; the second is refused, and the sampler keeps sending."""
    sampler, s = "sampler-5", lab.engine.settings
    first = lab.groups(sampler, n=1)[0]
    item = lab.task.train_items(s.prompts_per_step, stream=prompt_stream(sampler), index=first.batch_index)[0]
    second = generate_groups(
        lab.v1, lab.tokenizer, [item], lab.task.score,
        RolloutSettings(s.group_size, s.temperature, s.max_new_tokens), lab.engine.algorithm,
        policy_version=1, sampler_id=sampler, seed=0, uid_prefix=f"{sampler}-again-b{first.batch_index}",
        checkable=True, batch_index=first.batch_index, gumbel_key=gumbel_key(lab.gate.ledger.secret),
    )[0]  # fmt: skip
    assert (second.batch_index, second.batch_slot) == (first.batch_index, first.batch_slot)
    assert lab.offer(first) is None
    assert lab.offer(second) == "slot_reused"
    assert lab.gate.ledger.refusal(sampler) is None
    assert lab.offer(lab.groups(sampler, n=1)[0]) is None  # a new slot passes
    # the taken slots are in the gate's checkpoint: a resumed learner refuses the second draw too
    resumed = Lab(tiny_model_path, tmp_path, ON)
    resumed.gate.load_state_dict(lab.gate.state_dict())
    assert resumed.offer(dataclasses.replace(second, group_uid=f"{sampler}-later")) == "slot_reused"


def test_a_group_without_its_slot_is_refused_without_blame_under_checkable_sampling(lab):
    group = dataclasses.replace(lab.groups("sampler-6", n=1)[0], batch_index=None, batch_slot=None)
    assert lab.offer(group) == "unassigned"
    assert lab.gate.ledger.refusal("sampler-6") is None
    assert lab.offer(lab.groups("sampler-6", n=1)[0]) is None


def test_a_slot_past_the_batch_or_another_samplers_prompt_fails_the_rewards_check(lab):
    per_batch = lab.engine.settings.prompts_per_step
    group = lab.groups("sampler-7", n=1)[0]
    assert lab.gate.verifier.check_group_rewards(group) is None
    failure = lab.gate.verifier.check_group_rewards(dataclasses.replace(group, batch_slot=per_batch))
    assert failure[0] == "prompt_not_assigned" and "no prompt" in failure[1]
    # sampler-8's group (its prompt differs from sampler-7's of that slot) sent as sampler-7's
    while True:  # (the toy's 100 prompts: the two slots may coincide)
        theirs = lab.groups("sampler-8", n=1)[0]
        mine = lab.task.train_items(per_batch, stream=prompt_stream("sampler-7"), index=theirs.batch_index)[0]["prompt"]
        if mine != lab.tokenizer.decode(theirs.prompt_ids, skip_special_tokens=True):
            break
    failure = lab.gate.verifier.check_group_rewards(dataclasses.replace(theirs, sampler_id="sampler-7"))
    assert failure[0] == "prompt_not_assigned" and repr(mine)[:20] in failure[1]
