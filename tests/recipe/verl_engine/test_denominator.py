"""Driver-side GEPO denominators agree with verl_ext.algos on shuffled groups, in every layout
the verl trainer sees (DataProto with a uid object array, TransferQueue's nested TensorDict)."""

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from verl.protocol import DataProto
from verl.utils import tensordict_utils as tu

from recipe.gepo.verl_engine import batch_rules as dn
from verl_ext.algos import importance as iw


def grouped_batch(groups=4, g=8, t=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b = groups * g
    lengths = torch.randint(2, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    old = (-torch.rand(b, t, generator=gen, dtype=torch.float64) * 4) * mask
    labels = torch.arange(b) // g
    return old, mask, labels


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_agrees_with_algos_on_shuffled_groups(reduction):
    old, mask, labels = grouped_batch()
    # reference: contiguous groups, straight from verl_ext.algos
    ref = iw.group_expectation_log_denominator(iw.sequence_log_prob(old, mask, reduction), labels)
    perm = torch.randperm(old.shape[0], generator=torch.Generator().manual_seed(3))
    uids = np.array([f"uid-{int(k):04x}" for k in labels[perm]], dtype=object)  # verl's uid array
    got = dn.group_log_denominator(old[perm], mask[perm], uids, reduction)
    torch.testing.assert_close(got, ref[perm], rtol=0, atol=1e-12)
    # every member of a group carries the same value; different groups differ
    for u in set(uids):
        vals = got[torch.as_tensor(uids == u)]
        assert torch.all(vals == vals[0])
    assert len({round(float(v), 9) for v in got}) == 4


def test_dataproto_layout():
    old, mask, labels = grouped_batch(seed=1)
    perm = torch.randperm(old.shape[0], generator=torch.Generator().manual_seed(5))
    data = DataProto.from_dict(
        tensors={"old_log_probs": old[perm], "response_mask": mask[perm]},
        non_tensors={"uid": np.array([str(int(k)) for k in labels[perm]], dtype=object)},
    )
    den = dn.group_log_denominator(
        data.batch["old_log_probs"], data.batch["response_mask"], data.non_tensor_batch["uid"]
    )
    ref = iw.group_expectation_log_denominator(iw.sequence_log_prob(old, mask, "mean"), labels)[perm]
    torch.testing.assert_close(den, ref)


def test_transfer_queue_tensordict_layout_and_padding_rows():
    old, mask, labels = grouped_batch(groups=3, g=4, seed=2)
    rows = [old[i, : int(mask[i].sum())] for i in range(old.shape[0])]
    td = TensorDict(
        {
            "old_log_probs": torch.nested.as_nested_tensor(rows, layout=torch.jagged),
            "response_mask": torch.nested.as_nested_tensor([torch.ones(len(r)) for r in rows], layout=torch.jagged),
        },
        batch_size=[old.shape[0]],
    )
    tu.assign_non_tensor(td, uid=[f"p{int(k)}" for k in labels])
    ref = iw.group_expectation_log_denominator(iw.sequence_log_prob(old, mask, "mean"), labels)
    torch.testing.assert_close(dn.from_tensordict(td), ref)

    # a padding copy (verl's DP balancing) of a row of group 0 must not change group 0's value
    padded_old = torch.cat([old, old[:1] * 0])
    padded_mask = torch.cat([mask, torch.zeros_like(mask[:1])])
    rows2 = rows + [torch.zeros(1, dtype=torch.float64)]
    td2 = TensorDict(
        {
            "old_log_probs": torch.nested.as_nested_tensor(rows2, layout=torch.jagged),
            "response_mask": torch.nested.as_nested_tensor(
                [torch.ones(len(r)) for r in rows] + [torch.zeros(1)], layout=torch.jagged
            ),
        },
        batch_size=[padded_old.shape[0]],
    )
    tu.assign_non_tensor(td2, uid=[f"p{int(k)}" for k in labels] + ["p0"])
    padding = [False] * old.shape[0] + [True]
    got = dn.from_tensordict(td2, padding=padding)
    torch.testing.assert_close(got[:-1], ref)
    # without the padding flag the copy would pollute its group: the guard is needed
    assert not torch.allclose(dn.from_tensordict(td2)[:-1], ref)
    assert padded_mask.shape[0] == got.shape[0]


def test_bad_inputs_are_named():
    old, mask, labels = grouped_batch()
    with pytest.raises(ValueError, match="uids for a batch"):
        dn.group_log_denominator(old, mask, np.array(["a"] * 3, dtype=object))
    with pytest.raises(ValueError, match="None"):
        dn.group_log_denominator(old, mask, np.array([None] * old.shape[0], dtype=object))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        dn.group_log_denominator(old[0], mask[0], ["a"])
