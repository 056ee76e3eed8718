"""The learner's batch layout and group denominators.

``collate_groups`` must left-pad prompts and right-pad responses without moving a token, and the
GEPO group denominators the learner hands to the loss must equal ``verl_ext.algos`` computed on
each group alone (padding and batch layout must not change them).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import recipe.gepo.embedded.learner as learner_module
from recipe.gepo.embedded.learner import Learner, collate_groups
from recipe.gepo.embedded.policy import load_policy
from verl_ext.algos.importance import group_expectation_log_denominator, sequence_log_prob
from verl_ext.hetero.records import RolloutGroup

from .helpers import TINY, compose_cfg

PAD = 0


def make_group(uid: str, prompt_len: int, lengths: list[int], seed: int, vocab: int = 15, token_adv: bool = False):
    rng = np.random.default_rng(seed)
    width = max(lengths)
    mask = (np.arange(width)[None, :] < np.asarray(lengths)[:, None]).astype(np.int8)
    rewards = rng.integers(0, 2, size=len(lengths)).astype(np.float32)
    adv = rewards - rewards.mean()
    return RolloutGroup(
        group_uid=uid,
        prompt_ids=rng.integers(3, vocab, size=prompt_len).astype(np.int64),
        response_ids=(rng.integers(3, vocab, size=(len(lengths), width)) * mask).astype(np.int64),
        response_mask=mask,
        sampler_logprobs=(-rng.uniform(0.05, 2.0, size=(len(lengths), width)) * mask).astype(np.float32),
        rewards=rewards,
        advantages=(np.repeat(adv[:, None], width, axis=1) * mask if token_adv else adv).astype(np.float32),
        policy_version=0,
        sampler_id="s0",
    )


GROUPS = [
    make_group("a", prompt_len=3, lengths=[1, 4, 2, 3], seed=0),
    make_group("b", prompt_len=6, lengths=[2, 2, 1, 2], seed=1),
    make_group("c", prompt_len=4, lengths=[5, 1, 3, 5], seed=2, token_adv=True),
]


def test_collate_pads_prompts_left_and_responses_right():
    batch = collate_groups(GROUPS, PAD)
    assert batch["prompt_ids"].shape == (12, 6) and batch["response_ids"].shape == (12, 5)
    row = 0
    for gi, group in enumerate(GROUPS):
        p, (g, r) = len(group.prompt_ids), group.response_ids.shape
        for j in range(g):
            b = row + j
            # prompt: pads then the prompt, ending at the last column
            assert batch["prompt_ids"][b, 6 - p :].tolist() == group.prompt_ids.tolist()
            assert batch["prompt_ids"][b, : 6 - p].eq(PAD).all()
            assert batch["prompt_mask"][b].tolist() == [0] * (6 - p) + [1] * p
            # response: the tokens from column 0, then pads
            n = int(group.response_mask[j].sum())
            assert batch["response_ids"][b, :n].tolist() == group.response_ids[j, :n].tolist()
            assert batch["response_ids"][b, n:].eq(PAD).all()
            assert batch["response_mask"][b].tolist() == [1] * n + [0] * (5 - n)
            assert torch.equal(batch["sampler_logprobs"][b, :r], torch.from_numpy(group.sampler_logprobs[j]))
            assert batch["sampler_logprobs"][b, r:].eq(0).all()
            # advantages: per-sequence ones broadcast over the response tokens, zero on padding
            adv = group.advantages[j] if group.advantages.ndim == 1 else group.advantages[j, 0]
            assert batch["advantages"][b, :n].tolist() == pytest.approx([float(adv)] * n)
            assert batch["advantages"][b, n:].eq(0).all()
            assert batch["rewards"][b] == group.rewards[j]
            assert batch["group_index"][b] == gi
        row += g


def test_collate_honours_a_groups_own_prompt_mask():
    group = make_group("padded", prompt_len=5, lengths=[2, 3], seed=3)
    group.prompt_ids[:2] = PAD
    group.prompt_mask = np.array([0, 0, 1, 1, 1], dtype=np.int8)
    batch = collate_groups([group, make_group("plain", prompt_len=5, lengths=[1, 2], seed=4)], PAD)
    assert batch["prompt_mask"][0].tolist() == [0, 0, 1, 1, 1]


def test_learner_denominators_equal_verl_ext_algos_per_group(tiny_model_path, monkeypatch):
    """Spy on the loss call (the real loss still runs) and compare the denominators the learner
    passed with ``verl_ext.algos`` computed on each group's own unpadded tensors."""
    cfg = compose_cfg(TINY + [f"actor_rollout_ref.model.path={tiny_model_path}"])
    from verl.utils.config import omega_conf_to_dataclass

    actor_config = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    reduction = actor_config.policy_loss.get("seq_reduction", "mean")
    model, tokenizer = load_policy(tiny_model_path)
    learner = Learner(model, actor_config, temperature=1.0, pad_token_id=tokenizer.pad_token_id)
    seen = {}
    real = learner_module.compute_actor_loss

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(learner_module, "compute_actor_loss", spy)
    groups = [
        make_group(g.group_uid, len(g.prompt_ids), g.response_mask.sum(1).tolist(), seed=i)
        for i, g in enumerate(GROUPS)
    ]
    metrics = learner.train_step(groups)
    assert np.isfinite(metrics["actor/loss"]) and learner.version == 1

    denominators = seen["group_log_denominator"]
    assert denominators.shape == (12,)
    row = 0
    for group in groups:
        t = group.as_torch()
        seq_log_q = sequence_log_prob(t["sampler_logprobs"].float(), t["response_mask"], reduction)
        alone = group_expectation_log_denominator(seq_log_q, torch.zeros(group.group_size, dtype=torch.long))
        q = seq_log_q.double().exp()
        explicit = torch.log((q**2).sum() / q.sum())  # log E_q[q] over the group
        got = denominators[row : row + group.group_size]
        assert torch.allclose(got.double(), alone.double(), atol=1e-6)
        assert torch.allclose(got.double(), explicit.expand_as(got), atol=1e-5)
        assert torch.all(got == got[0])  # one value per prompt group
        row += group.group_size
    # and different groups do get different denominators (the index really separates them)
    assert len({round(float(denominators[i]), 6) for i in (0, 4, 8)}) == 3
    assert torch.equal(seen["group_index"], torch.repeat_interleave(torch.arange(3), 4))
