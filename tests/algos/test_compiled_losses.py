"""The compiled group-expectation losses (verl_ext.algos.compiled): one fullgraph graph for forward
and backward whatever the group count, the same loss and gradient as the eager functions and as the
float64 references within float32 rounding; ``policy_loss.compile`` selects them.

Most tests trace with dynamo + AOTAutograd on the "aot_eager" backend (the graph capture, the static
group labels and the traced backward, in seconds); the inductor test, which compiles C++ on a CPU
(up to a minute with a cold cache), is marked slow.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import verl_ext.algos.registry  # noqa: F401 -- registers the project's losses (as the verl plugin does)
from verl_ext.algos import compiled, losses
from verl_ext.algos import importance as iw
from verl_ext.algos.config import LOSS_SPECIFIC_OPTIONS, HeteroPolicyLossConfig

from . import reference as ref
from .verl_helpers import CLIP_HIGH, CLIP_LOW, actor_config, call_loss

# (label, loss_mode, its options, float64 reference terms)
VARIANTS = [
    ("gepo", "gepo", {}, lambda b: ref.gepo(b, CLIP_LOW, CLIP_HIGH)),
    ("gepo sum", "gepo", {"reduction": "sum"}, lambda b: ref.gepo(b, CLIP_LOW, CLIP_HIGH, reduction="sum")),
    ("eqp", "eqp", {}, lambda b: ref.eqp(b, CLIP_LOW, CLIP_HIGH)),
    (
        "gepo_adaptive",
        "gepo_adaptive",
        {"kl_threshold": 0.01},
        lambda b: ref.gepo_adaptive(b, 0.01, CLIP_LOW, CLIP_HIGH),
    ),
    ("gepo_tr", "gepo_tr", {}, lambda b: ref.gepo_tr(b, CLIP_LOW, CLIP_HIGH)),
    ("gepo_tc", "gepo_tc", {}, lambda b: ref.gepo_tc(b, CLIP_LOW, CLIP_HIGH)),
    ("gepo_tc ess", "gepo_tc", {"ess_bound": True}, lambda b: ref.gepo_tc(b, CLIP_LOW, CLIP_HIGH, ess_bound=True)),
]
IDS = [v[0] for v in VARIANTS]
# float32 arithmetic against float64 on the same (float32-representable) inputs
F32 = dict(rtol=2e-5, atol=2e-6)


def ragged_batch(seed: int, labels: list[int], max_len: int = 9, drift: float = 0.3) -> ref.Batch:
    """A batch whose groups are given label by label (any integers, groups of unequal size, rows
    interleaved), its values rounded to float32 so float32 and float64 see the same inputs."""
    b = ref.make_batch(seed, n_groups=1, group_size=len(labels), max_len=max_len, drift=drift)
    b = dataclasses.replace(b, groups=torch.tensor(labels))
    return dataclasses.replace(b, **{k: getattr(b, k).float().double() for k in ("log_p", "log_q", "advantages")})


# same B = 10, different group counts (1, 3, 4, 10), ragged and shuffled, labels far from 0..G-1
BATCHES = [
    [7, 7, -3, 7, 1000, -3, 7, 1000, 1000, -3],
    [5, 5, 5, 5, 5, 5, 5, 5, 5, 5],
    [2, 9, 2, 2, 9, -1, 4, 4, -1, 2],
    [0, 11, 22, 33, 44, 55, 66, 77, 88, 99],
]


def token_mean(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(loss_mat.dtype)
    return (loss_mat * m).sum() / m.sum()


def loss_and_grad(fn, b: ref.Batch, dtype: torch.dtype, options: dict):
    log_p = b.log_p.to(dtype).clone().requires_grad_(True)
    out = fn(
        log_p,
        b.log_q.to(dtype),
        b.advantages.to(dtype),
        b.mask,
        clip_low=CLIP_LOW,
        clip_high=CLIP_HIGH,
        group_index=b.groups,
        **options,
    )
    loss_mat, weight, clipped = out[:3] if isinstance(out, tuple) else (out.loss_mat, out.weight, out.clipped)
    loss = token_mean(loss_mat, b.mask)
    loss.backward()
    return loss.detach(), log_p.grad, weight.detach(), clipped & b.mask, out


@pytest.mark.parametrize("labels", BATCHES)
def test_leader_group_index_names_each_group_by_its_first_row(labels):
    """Same label <=> same leader, and the leader is the group's first row (so labels < B)."""
    gi = torch.tensor(labels)
    leader = iw.leader_group_index(gi).tolist()
    for i, li in enumerate(labels):
        assert leader[i] == labels.index(li)
    assert len(set(leader)) == len(set(labels)) == iw.dense_group_index(gi)[1]
    # eager mode keeps the exact group count; the bound B is only taken while compiling
    assert iw.segment_group_index(gi)[1] == len(set(labels))


def test_leader_group_index_refuses_non_1d():
    with pytest.raises(ValueError, match="1-D"):
        iw.leader_group_index(torch.zeros(2, 3, dtype=torch.long))


def test_pairwise_segment_logsumexp_equals_the_scatter_one():
    """The compiled path's group log-sum-exp: values and gradients of the eager one on every group,
    -inf on slots no group fills, and finite gradients with values far apart across groups."""
    gi = torch.tensor([3, 0, 3, 5, 0, 3])
    values = torch.tensor([-1e4, -2.0, -1e4 + 1.0, 50.0, -3.0, -1e4 + 0.5], dtype=torch.float64, requires_grad=True)
    eager = iw.segment_logsumexp(values, gi, 6)
    pairwise = iw._pairwise_segment_logsumexp(values, gi, 6)
    filled = torch.tensor([True, False, False, True, False, True])
    torch.testing.assert_close(pairwise[filled], eager[filled], rtol=1e-12, atol=0)
    assert torch.isneginf(pairwise[~filled]).all()
    (g_eager,) = torch.autograd.grad(eager[gi].sum(), values)
    (g_pair,) = torch.autograd.grad(pairwise[gi].sum(), values)
    assert torch.isfinite(g_pair).all()
    torch.testing.assert_close(g_pair, g_eager, rtol=1e-12, atol=0)


@pytest.mark.parametrize("label,loss_mode,options,reference", VARIANTS, ids=IDS)
def test_fullgraph_forward_backward_one_graph_for_every_group_count(label, loss_mode, options, reference):
    """fullgraph=True raises at any graph break; the counter sees one frame compiled for four
    batches of the same size with 1 to 10 groups (no recompile per group count), and each result
    equals the eager float32 one and the float64 one."""
    torch.compiler.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(
        lambda *a, **k: compiled.traceable_loss_terms(loss_mode, *a, **k), fullgraph=True, backend=counter
    )
    eager_fn = compiled.COMPILABLE_LOSS_TERMS[loss_mode]
    for seed, labels in enumerate(BATCHES):
        b = ragged_batch(seed, labels)
        loss, grad, weight, clipped, out = loss_and_grad(fn, b, torch.float32, options)
        e_loss, e_grad, e_weight, e_clipped, _ = loss_and_grad(eager_fn, b, torch.float32, options)
        r_loss, r_grad, r_weight, _, _ = loss_and_grad(eager_fn, b, torch.float64, options)
        torch.testing.assert_close(loss, e_loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, e_grad, rtol=1e-6, atol=1e-8)
        assert torch.equal(clipped, e_clipped)
        torch.testing.assert_close(loss.double(), r_loss, **F32)
        torch.testing.assert_close(grad.double(), r_grad, **F32)
        torch.testing.assert_close(weight.double(), r_weight, **F32)
        # the independent float64 reference (loops over Python floats) gives the loss value
        rows, ws, _ = reference(b)
        assert loss.item() == pytest.approx(ref.aggregate(rows, b.mask, "token-mean"), rel=2e-5, abs=2e-6)
        torch.testing.assert_close(weight.double(), torch.tensor(ws, dtype=torch.float64), **F32)
        assert (out[3] is None) == (not options.get("ess_bound", False))
        if out[3] is not None:
            assert out[3].item() == pytest.approx(ref.token_ratio_ess(b), rel=1e-6)  # ratios in float32
    assert counter.frame_count == 1, f"{label}: {counter.frame_count} graphs for one batch size"


def test_compiled_loss_terms_returns_loss_terms_with_the_band_metric():
    """The wrapper gives LossTerms like the eager function, GEPO-TC-ESS's band scale as a float metric."""
    torch.compiler.reset()
    b = ragged_batch(3, BATCHES[2], drift=0.5)
    fn = compiled.compiled_loss_terms("gepo_tc", backend="aot_eager")
    assert fn is compiled.compiled_loss_terms("gepo_tc", backend="aot_eager")  # one per argument set
    kw = dict(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, group_index=b.groups, ess_bound=True)
    terms = fn(b.log_p.float(), b.log_q.float(), b.advantages.float(), b.mask, **kw)
    eager = losses.gepo_token_clip_loss_terms(b.log_p.float(), b.log_q.float(), b.advantages.float(), b.mask, **kw)
    assert isinstance(terms, losses.LossTerms)
    assert set(terms.metrics) == set(eager.metrics) == {"actor/tc_band_scale"}
    assert terms.metrics["actor/tc_band_scale"] == pytest.approx(eager.metrics["actor/tc_band_scale"], rel=1e-9)
    assert terms.metrics["actor/tc_band_scale"] < 1.0  # off-policy: the band really shrank
    torch.testing.assert_close(terms.loss_mat * b.mask, eager.loss_mat * b.mask)


def test_token_ratio_ess_edge_cases():
    """1 with no response token, as normalised_ess of no weights; equal ratios give 1."""
    x = torch.randn(3, 4, dtype=torch.float64)
    none = torch.zeros(3, 4, dtype=torch.bool)
    assert compiled.token_ratio_ess(x, x + 1.0, none).item() == 1.0
    assert compiled.token_ratio_ess(x, x - 0.3, ~none).item() == pytest.approx(1.0, rel=1e-12)


def test_compiled_loss_terms_refuses_a_loss_without_compiled_path():
    with pytest.raises(ValueError, match="no compiled path"):
        compiled.compiled_loss_terms("vanilla")


@pytest.mark.parametrize("loss_mode,options", [("gepo", {}), ("eqp", {}), ("gepo_tc", {"tc_ess_bound": True})])
def test_policy_loss_compile_option_gives_the_eager_loss(monkeypatch, loss_mode, options):
    """The registered loss (called as verl's ppo_loss calls it) with policy_loss.compile=true: the
    same loss, metrics and gradient as with it off."""
    torch.compiler.reset()
    original = compiled.compiled_loss_terms
    used = []

    def aot_eager(name):
        used.append(name)
        return original(name, backend="aot_eager")

    monkeypatch.setattr(compiled, "compiled_loss_terms", aot_eager)
    b = ragged_batch(5, BATCHES[0], drift=0.4)
    b = dataclasses.replace(b, **{k: getattr(b, k).float() for k in ("log_p", "log_q", "advantages")})
    results = []
    for compile_ in (False, True):
        config = actor_config(loss_mode, loss_agg_mode="seq-mean-token-mean", compile=compile_, **options)
        log_p = b.log_p.clone().requires_grad_(True)
        loss, metrics = call_loss(loss_mode, b, config, log_p=log_p, group_index=b.groups)
        loss.backward()
        results.append((loss.detach(), log_p.grad, metrics))
    assert used == [loss_mode]
    (loss0, grad0, m0), (loss1, grad1, m1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad1, grad0, rtol=1e-6, atol=1e-8)
    assert set(m1) == set(m0)
    for key in m0:
        assert m1[key] == pytest.approx(m0[key], rel=1e-5, abs=1e-7), key


def test_compile_option_default_off_and_refused_where_not_read():
    assert HeteroPolicyLossConfig().compile is False
    assert HeteroPolicyLossConfig(loss_mode="gepo_tr", compile=True).compile is True
    with pytest.raises(ValueError, match="compile") as err:
        HeteroPolicyLossConfig(loss_mode="vanilla", compile=True)
    assert "gepo" in str(err.value)
    assert set(compiled.COMPILABLE_LOSS_TERMS) == set(LOSS_SPECIFIC_OPTIONS["compile"])


def test_compile_option_refused_where_torch_compile_cannot_run(monkeypatch):
    import torch._dynamo

    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    with pytest.raises(ValueError, match="torch.compile"):
        HeteroPolicyLossConfig(loss_mode="gepo", compile=True)
    assert HeteroPolicyLossConfig(loss_mode="gepo").compile is False


@pytest.mark.slow
@pytest.mark.parametrize("loss_mode,options", [("gepo", {}), ("gepo_tc", {"ess_bound": True})])
def test_inductor_compiled_matches_float64(loss_mode, options):
    """Inductor's generated code (C++ on a CPU, Triton on a GPU), float32, against eager float64."""
    torch.compiler.reset()
    fn = compiled.compiled_loss_terms(loss_mode, backend="inductor")
    eager_fn = compiled.COMPILABLE_LOSS_TERMS[loss_mode]
    for seed, labels in enumerate(BATCHES[:2]):
        b = ragged_batch(seed, labels)
        loss, grad, weight, _, _ = loss_and_grad(fn, b, torch.float32, options)
        r_loss, r_grad, r_weight, _, _ = loss_and_grad(eager_fn, b, torch.float64, options)
        assert math.isfinite(loss.item())
        torch.testing.assert_close(loss.double(), r_loss, **F32)
        torch.testing.assert_close(grad.double(), r_grad, **F32)
        torch.testing.assert_close(weight.double(), r_weight, **F32)


def test_compiled_branches_make_no_tensor_on_the_default_device():
    """The functions only a compiled graph runs (so the eager device checks never see them), on CPU
    inputs with torch's default device set to meta: a tensor made without device= would fail here."""
    gi = torch.tensor([4, 1, 4, 1, 7])
    values = torch.randn(5, dtype=torch.float64)
    x, mask = torch.randn(5, 3), torch.ones(5, 3, dtype=torch.bool)
    with torch.device("meta"):
        leader = iw.leader_group_index(gi)
        lse = iw._pairwise_segment_logsumexp(values, leader, 5)
        ess = compiled.token_ratio_ess(x, x - 0.1, mask)
    assert leader.device.type == lse.device.type == ess.device.type == "cpu"
    assert leader.tolist() == [0, 1, 0, 1, 4]


def test_a_changed_batch_size_compiles_once_more_then_never_again():
    """compiled_loss_terms' default dynamic=None: static first, the batch size symbolic after its
    first change -- varying micro-batches do not recompile each time, and stay correct."""
    torch.compiler.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda *a, **k: compiled.traceable_loss_terms("eqp", *a, **k), fullgraph=True, backend=counter)
    frames = []
    for seed, labels in enumerate([BATCHES[0], BATCHES[0] + [1000, 7], BATCHES[2][:7], BATCHES[3] * 2]):
        b = ragged_batch(seed, labels)
        loss, grad, _, _, _ = loss_and_grad(fn, b, torch.float32, {})
        e_loss, e_grad, _, _, _ = loss_and_grad(losses.eqp_loss_terms, b, torch.float32, {})
        torch.testing.assert_close(loss, e_loss, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, e_grad, rtol=1e-6, atol=1e-8)
        frames.append(counter.frame_count)
    assert frames == [1, 2, 2, 2]
