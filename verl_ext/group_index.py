"""verl's prompt-group ids (``non_tensor_batch["uid"]``) as dense integer group labels: the one
place that turns uids into the ``group_index`` [B] the losses, denominators and advantage
estimators take."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch


def uid_group_index(uids: Sequence[Any] | np.ndarray, device: Optional[torch.device | str] = None) -> torch.Tensor:
    """Dense int64 group labels [B] in 0..G-1 from per-sequence prompt ids (any labels, compared as
    ``str``; typically a numpy object array of str). Equal uid = same prompt group; the labels
    follow the sorted uids, so the order of the sequences does not matter.

    Raises ValueError for a uid array that is not 1-D or holds None (a sequence without a group)."""
    labels = np.asarray(list(uids), dtype=object)
    if labels.ndim != 1:
        raise ValueError(f"uid must be a 1-D array of per-sequence prompt ids, got shape {labels.shape}")
    if any(u is None for u in labels):
        raise ValueError("uid contains None: every sequence needs its prompt group id")
    _, inverse = np.unique(labels.astype(str), return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), dtype=torch.long, device=device)
