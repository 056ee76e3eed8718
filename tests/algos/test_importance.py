"""verl_ext.algos.importance against the float64 references in tests/algos/reference.py."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_ext.algos import importance as iw

from . import reference as ref


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sequence_log_prob_matches_reference(reduction, dtype):
    b = ref.make_batch(seed=1, n_groups=4, group_size=3, max_len=9, dtype=dtype)
    for mask in (b.mask, b.mask.to(torch.float32), b.mask.to(torch.int64)):
        got = iw.sequence_log_prob(b.log_q, mask, reduction)
        want = torch.tensor(ref.seq_log_prob(b.log_q, b.mask, reduction), dtype=torch.float64)
        assert got.shape == (b.log_q.shape[0],)
        tol = 1e-12 if dtype == torch.float64 else 2e-6
        torch.testing.assert_close(got.to(torch.float64), want, rtol=tol, atol=tol)


def test_sequence_log_prob_empty_row_is_zero_and_bad_reduction_raises():
    lp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [False, False]])
    for red in ("mean", "sum"):
        out = iw.sequence_log_prob(lp, mask, red)
        assert torch.isfinite(out).all()
        assert out[1].item() == 0.0
    with pytest.raises(ValueError, match="reduction"):
        iw.sequence_log_prob(lp, mask, "max")


@settings(max_examples=40, deadline=None)
@given(
    seq_lq=st.lists(st.floats(-60.0, 0.0, allow_nan=False), min_size=1, max_size=12),
    label_pool=st.lists(st.integers(-(10**9), 10**9), min_size=1, max_size=4, unique=True),
    data=st.data(),
)
def test_group_expectation_log_denominator_shuffled_labels(seq_lq, label_pool, data):
    """Arbitrary (non-contiguous, negative, huge) labels: each sequence gets its own group's value."""
    labels = [data.draw(st.sampled_from(label_pool)) for _ in seq_lq]
    got = iw.group_expectation_log_denominator(torch.tensor(seq_lq, dtype=torch.float64), torch.tensor(labels))
    want = ref.group_log_denominator(seq_lq, labels)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_group_expectation_log_denominator_direct_formula():
    """Against the plain-probability formula sum q^2 / sum q where it does not underflow."""
    g = torch.Generator().manual_seed(3)
    q = torch.rand(10, generator=g, dtype=torch.float64) * 0.9 + 0.05
    labels = torch.tensor([7, 2, 7, 9, 2, 2, 9, 7, 7, 2])
    got = iw.group_expectation_log_denominator(q.log(), labels)
    for i in range(10):
        members = [float(q[j]) for j in range(10) if labels[j] == labels[i]]
        want = math.log(sum(x * x for x in members) / sum(members))
        assert abs(got[i].item() - want) < 1e-12
    # E_q[q] is a q-weighted mean of q: between the group's min and max q
    for i in range(10):
        members = q[labels == labels[i]]
        assert members.min().log() - 1e-12 <= got[i] <= members.max().log() + 1e-12


@pytest.mark.parametrize("centre", [-5000.0, -1e4])
def test_group_expectation_log_denominator_extreme_log_probs_mpmath(centre):
    """Exact and finite where raw probabilities underflow (exp(-5000) == 0 in float64)."""
    offsets = [0.0, -1.5, 2.25, -0.7, 3.1, -4.0]
    seq_lq = [centre + o for o in offsets]
    labels = [0, 0, 0, 1, 1, 1]
    assert math.exp(seq_lq[0]) == 0.0  # the naive formula would give 0/0
    got = iw.group_expectation_log_denominator(torch.tensor(seq_lq, dtype=torch.float64), torch.tensor(labels))
    assert torch.isfinite(got).all()
    mpmath.mp.dps = 50
    for i in range(6):
        members = [mpmath.mpf(x) for x, l in zip(seq_lq, labels) if l == labels[i]]
        want = mpmath.log(sum(mpmath.exp(2 * x) for x in members) / sum(mpmath.exp(x) for x in members))
        assert abs(got[i].item() - float(want)) < 1e-9 * abs(centre)


def test_group_expectation_log_denominator_shape_mismatch_raises():
    with pytest.raises(ValueError):
        iw.group_expectation_log_denominator(torch.zeros(4), torch.zeros(3, dtype=torch.long))


def test_segment_logsumexp_matches_reference_and_gradient_is_softmax():
    g = torch.Generator().manual_seed(5)
    values = (torch.randn(9, generator=g, dtype=torch.float64) * 30).requires_grad_(True)
    index = torch.tensor([2, 0, 1, 2, 2, 0, 1, 1, 0])
    out = iw.segment_logsumexp(values, index, 3)
    v = values.detach()
    for k in range(3):
        members = [float(v[j]) for j in range(9) if index[j] == k]
        assert abs(out[k].item() - ref.logsumexp(members)) < 1e-12
    # d/dv_j of logsumexp over j's group is softmax within the group
    out.sum().backward()
    for j in range(9):
        k = int(index[j])
        members = [float(v[i]) for i in range(9) if index[i] == k]
        want = math.exp(float(v[j]) - ref.logsumexp(members))
        assert abs(values.grad[j].item() - want) < 1e-12


@pytest.mark.parametrize("batch,group", [(8, 4), (6, 1), (12, 3)])
def test_contiguous_group_index(batch, group):
    idx = iw.contiguous_group_index(batch, group)
    assert idx.tolist() == [i // group for i in range(batch)]


@pytest.mark.parametrize("batch,group", [(6, 4), (5, 2), (4, 0), (4, -1)])
def test_contiguous_group_index_rejects_partial_groups(batch, group):
    with pytest.raises(ValueError, match="group_size"):
        iw.contiguous_group_index(batch, group)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_token_sequence_and_group_log_weights(reduction):
    b = ref.make_batch(seed=7, n_groups=3, group_size=4)
    torch.testing.assert_close(iw.token_log_weight(b.log_p, b.log_q), b.log_p - b.log_q)
    seq = iw.sequence_log_weight(b.log_p, b.log_q, b.mask, reduction)
    want_seq = [
        p - q
        for p, q in zip(ref.seq_log_prob(b.log_p, b.mask, reduction), ref.seq_log_prob(b.log_q, b.mask, reduction))
    ]
    torch.testing.assert_close(seq, torch.tensor(want_seq, dtype=torch.float64), rtol=1e-12, atol=1e-12)

    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    shuffled = b.rows(perm)
    labels = (shuffled.groups * 17 + 5).tolist()  # non-contiguous, non-dense labels
    got = iw.group_expectation_log_weight(
        shuffled.log_p, shuffled.log_q, shuffled.mask, group_index=torch.tensor(labels), reduction=reduction
    )
    slp = ref.seq_log_prob(shuffled.log_p, shuffled.mask, reduction)
    den = ref.group_log_denominator(ref.seq_log_prob(shuffled.log_q, shuffled.mask, reduction), labels)
    torch.testing.assert_close(got, torch.tensor([p - d for p, d in zip(slp, den)], dtype=torch.float64))
    # the upstream-denominator path gives the same weights
    got2 = iw.group_expectation_log_weight(
        shuffled.log_p,
        shuffled.log_q,
        shuffled.mask,
        log_denominator=torch.tensor(den, dtype=torch.float64),
        reduction=reduction,
    )
    torch.testing.assert_close(got2, got)
    with pytest.raises(ValueError):
        iw.group_expectation_log_weight(b.log_p, b.log_q, b.mask)


def test_group_expectation_weight_on_policy_is_q_over_expectation():
    """On-policy (p == q) the GEPO weight is q_i / E_q[q], not 1."""
    b = ref.make_batch(seed=11, n_groups=2, group_size=5, drift=0.0)
    log_w = iw.group_expectation_log_weight(b.log_q, b.log_q, b.mask, group_index=b.groups)
    slq = ref.seq_log_prob(b.log_q, b.mask)
    labels = b.groups.tolist()
    for i in range(10):
        qs = [math.exp(slq[j]) for j in range(10) if labels[j] == labels[i]]
        want = math.exp(slq[i]) / (sum(x * x for x in qs) / sum(qs))
        assert abs(math.exp(log_w[i].item()) - want) < 1e-12 * max(1.0, want)
    assert not torch.allclose(log_w, torch.zeros_like(log_w))


def test_k3_kl_per_token():
    g = torch.Generator().manual_seed(2)
    lp = torch.randn(4, 6, generator=g, dtype=torch.float64)
    lq = torch.randn(4, 6, generator=g, dtype=torch.float64)
    k = iw.k3_sampler_learner_kl(lp, lq)
    for i in range(4):
        for t in range(6):
            p, q = float(lp[i, t]), float(lq[i, t])
            assert abs(k[i, t].item() - ((math.exp(p - q) - 1) - (p - q))) < 1e-12
    assert (k >= 0).all()
    assert torch.equal(iw.k3_sampler_learner_kl(lq, lq), torch.zeros_like(lq))


def test_normalised_ess_against_its_definition():
    """(sum w)^2 / (n sum w^2): 1 for equal weights, 1/n for one non-zero weight; the edge cases
    the losses and the diagnostics rely on (no weights: 1, all zero: 0)."""
    w = torch.tensor([[0.5, 2.0], [1.0, 4.0]])
    assert iw.normalised_ess(w) == pytest.approx(7.5**2 / (4 * (0.25 + 4 + 1 + 16)))
    assert iw.normalised_ess(torch.full((7,), 3.0)) == pytest.approx(1.0)
    assert iw.normalised_ess(torch.tensor([0.0, 0.0, 5.0, 0.0])) == pytest.approx(0.25)
    assert iw.normalised_ess(torch.zeros(0)) == 1.0 and iw.normalised_ess(torch.zeros(3)) == 0.0
