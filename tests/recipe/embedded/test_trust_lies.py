"""The lies of ``research/soak/lies.py`` (told by the soak's lying samplers and measured by
``bench_trust detection-table``) against the real trust gate with the tiny toy model, checkable
sampling on: each is the lie it says it is and is refused by the check it names; and the table's
trial loop (a liar past an honest probation) counts what gets in before its quarantine."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from verl_ext.trust.verifier import group_log_probs
from research.bench.bench_trust import _lying_trial
from research.soak import lies
from verl_ext.hetero.weights import serialize_state_dict

from .test_checkable_sampling_gate import ON, _groups
from .test_trust_gate import Lab


@pytest.fixture(scope="module")
def lab(tiny_model_path, tmp_path_factory):
    return Lab(tiny_model_path, tmp_path_factory.mktemp("lies"), ON)


def _redraw(lab, group, drawer):
    s = lab.engine.settings
    return lies.redrawn(
        group, drawer, lab.model, lab.tokenizer, lab.task.score, s.temperature, s.max_new_tokens, lab.engine.algorithm
    )


def test_truncation_leaves_only_the_top_tokens_and_goes_with_its_block(lab):
    ids = torch.as_tensor(_groups(lab, "t", n=1)[0].prompt_ids).reshape(1, -1)
    full = lab.model(input_ids=ids).logits
    with lies.truncated(lab.model, top_k=2):
        top2 = lab.model(input_ids=ids).logits
    with lies.truncated(lab.model, top_p=0.5):
        nucleus = lab.model(input_ids=ids).logits
    assert (torch.isfinite(top2).sum(-1) == 2).all()
    kept = torch.isfinite(nucleus)
    assert (kept.sum(-1) >= 1).all() and (kept.sum(-1) < full.shape[-1]).all()
    mass = torch.softmax(full, -1).masked_fill(~kept, 0).sum(-1)
    assert (mass >= 0.5).all()  # the smallest set reaching the mass: at least that much kept
    assert torch.equal(lab.model(input_ids=ids).logits, full)  # the hook is gone after the block


def test_a_near_copy_of_an_accepted_group_is_refused_and_its_sender_blamed(lab):
    original = _groups(lab, "honest-nc", n=1)[0]
    assert lab.offer(original) is None
    copy = lies.near_copy(original, "copier-g0", "copier")
    assert not np.array_equal(copy.response_ids, original.response_ids) or original.response_ids.shape[0] == 1
    assert abs(float(np.abs(copy.sampler_logprobs - np.roll(original.sampler_logprobs, 1, 0)).max()) - 1e-5) < 1e-6
    # the copy names the original's slot and seed: not the copier's assignment
    assert lab.offer(copy) == "seed_not_assigned"
    assert lab.gate.ledger.refusal("copier") == "quarantined"
    # in a slot of the copier's own that is assigned the same prompt, the seed still is not its own
    copy = lies.near_copy(original, "copier2-g0", "copier2")
    copy.batch_index, copy.batch_slot = lab.batch_assigned("copier2", original), 0
    assert lab.offer(copy) == "seed_not_assigned"


@pytest.mark.parametrize(
    "name, lie",
    [
        ("q x 1.5", lambda lab, g: lies.scaled_q(g, 1.5)),
        ("q at T=0.5", lambda lab, g: lies.q_at_temperature(g, lab.model, 0.5)),
    ],
)
def test_log_prob_lies_fail_the_first_check(lab, name, lie):
    group = lie(lab, _groups(lab, f"liar-{name}", n=1)[0])
    assert lab.offer(group) == "bad_logprobs"
    assert lab.gate.ledger.refusal(f"liar-{name}") == "quarantined"


@pytest.mark.parametrize("how", ["other weights", "top-k 1"])
def test_redrawn_tokens_with_q_true_to_them_pass_the_log_q_check_and_fail_the_token_check(lab, how, tiny_model_path):
    from recipe.gepo.embedded.policy import load_policy

    drawer, _ = load_policy(tiny_model_path)
    if how == "other weights":  # every weight moved by +-1e-2 (seeded): tokens differ in most groups
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in drawer.parameters():
                p.add_(1e-2 * torch.sign(torch.randn(p.shape, generator=generator)))
    drawer.eval()
    sampler = f"redrawn-{how}"
    honest = _groups(lab, sampler, n=6)
    if how == "top-k 1":
        with lies.truncated(drawer, top_k=1):
            told = [_redraw(lab, g, drawer) for g in honest]
    else:
        told = [_redraw(lab, g, drawer) for g in honest]
    changed = sum(not np.array_equal(a.response_ids, b.response_ids) for a, b in zip(told, honest))
    assert changed > 0, "the redraw drew the honest tokens: nothing was lied"
    for g, h in zip(told, honest):  # the same seed; q that of the claimed version (v0)
        assert g.sampling_seed == h.sampling_seed and g.group_uid == h.group_uid
        np.testing.assert_allclose(g.sampler_logprobs, group_log_probs(lab.model, g, 1.0) * g.response_mask, atol=1e-6)
    verifier = lab.gate.verifier
    verifier.checkable_sampling = False
    try:
        assert all(verifier.measure_logprobs(g)[0] is None for g in told)  # q and rewards alone: consistent
        assert all(verifier.check_group_rewards(g) is None for g in told)
    finally:
        verifier.checkable_sampling = True
    reasons = [lab.offer(g) for g in told]
    assert "token_mismatch" in reasons, reasons
    assert lab.gate.ledger.refusal(sampler) == "quarantined"


def _trial_lab(lab):
    """What ``_lying_trial`` needs of bench_trust's lab, over the test's gate: the sampler's weights
    published again as version 2, the newest."""

    def publish(version: int) -> bytes:
        return serialize_state_dict(lab.model.state_dict(), version)

    lab.gate.remember(2, publish(2))
    return types.SimpleNamespace(gate=lab.gate, engine=lab.engine, newest=2, publish=publish)


def test_the_tables_trial_counts_lying_groups_admitted_before_the_quarantine(tiny_model_path, tmp_path):
    """verify_fraction 0: after its probation nothing of the liar is checked, so the cap ends the
    trial; verify_fraction 1: the first lie is checked and refused; honest groups pass probation."""
    unchecked = Lab(tiny_model_path, tmp_path / "f0", ON, "hetero.trust.verify_fraction=0.0001")
    pool = _groups(unchecked, "pool", n=4)
    scale = lambda g: lies.scaled_q(g, 1.5)  # noqa: E731
    trial = _lying_trial(_trial_lab(unchecked), "a", pool, 0, scale, False, 6)
    probation = unchecked.engine.hetero.trust.probation_groups
    assert trial == (6, None, None, probation + 6, 0, 0)  # nothing vouched for: hold_unchecked trains on none
    checked = Lab(tiny_model_path, tmp_path / "f1", ON, "hetero.trust.verify_fraction=1")
    trial_lab = _trial_lab(checked)
    admitted, reason, honest_reason, used, _, _ = _lying_trial(trial_lab, "b", pool, 0, scale, False, 6)
    assert (admitted, reason, honest_reason, used) == (0, "bad_logprobs", None, probation + 1)
    # at a version bump: the lie claims a version whose weights reach the gate 20 ms after it
    admitted, reason, honest_reason, _, _, _ = _lying_trial(trial_lab, "c", pool, 1, scale, True, 6)
    assert (admitted, reason, honest_reason) == (0, "bad_logprobs", None) and trial_lab.newest == 3
    assert checked.gate.verifier.holds(3)
    # a "lie" every check passes (the group unchanged): each is vouched for as its check passes
    assert _lying_trial(trial_lab, "d", pool, 2, lambda g: g, False, 6)[-2:] == (6, 6)
