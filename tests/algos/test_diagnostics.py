"""verl_ext.algos.diagnostics: is/* weight statistics and KL(sampler || learner) against references."""

from __future__ import annotations

import math

import torch

from verl_ext.algos import diagnostics

from . import reference as ref


def _stats(ws):
    n = len(ws)
    mean = math.fsum(ws) / n
    return {
        "is/weight_mean": mean,
        "is/weight_min": min(ws),
        "is/weight_max": max(ws),
        "is/weight_var": math.fsum((w - mean) ** 2 for w in ws) / n,
        "is/ess": math.fsum(ws) ** 2 / (n * math.fsum(w * w for w in ws)),
    }


def test_sequence_level_stats_skip_empty_sequences():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    w = torch.tensor([0.5, 1e6, 2.0, 1.25], dtype=torch.float64)  # the empty row's weight must not count
    got = diagnostics.importance_weight_stats(w, mask)
    for key, want in _stats([0.5, 2.0, 1.25]).items():
        assert abs(got[key] - want) < 1e-12, key


def test_token_level_stats_only_response_tokens():
    b = ref.make_batch(seed=80, drift=0.4)
    w = torch.exp(b.log_p - b.log_q)
    got = diagnostics.importance_weight_stats(w, b.mask)
    ws = [float(x) for x, m in zip(w.flatten(), b.mask.flatten()) if m]
    for key, want in _stats(ws).items():
        assert abs(got[key] - want) < 1e-10 * max(1.0, abs(want)), key
    assert 0 < got["is/ess"] <= 1
    equal = diagnostics.importance_weight_stats(torch.full((3,), 0.7), torch.ones(3, 2, dtype=torch.bool))
    assert abs(equal["is/ess"] - 1.0) < 1e-12 and equal["is/weight_var"] == 0.0


def test_sampler_learner_kl_is_k3_token_mean_sequence_mean():
    b = ref.make_batch(seed=81, drift=0.4)
    assert abs(diagnostics.sampler_learner_kl(b.log_p, b.log_q, b.mask) - ref.sampler_kl(b)) < 1e-12
    mask = b.mask.clone()
    mask[0] = False  # an empty sequence is excluded from the sequence mean
    b2 = ref.Batch(b.log_p[1:], b.log_q[1:], b.advantages[1:], b.mask[1:], b.groups[1:])
    assert abs(diagnostics.sampler_learner_kl(b.log_p, b.log_q, mask) - ref.sampler_kl(b2)) < 1e-12
