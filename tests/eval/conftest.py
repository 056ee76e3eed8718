"""Shared fixtures of the evaluation tests."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def toy_model_path(tmp_path_factory):
    """A briefly warm-started toy model (1-digit addition, 40 optimizer steps) in a tmp folder.

    Accuracy is low but not always zero; the tests check arithmetic and resumption, not skill.
    """
    from verl_ext.data.toy import warm_start

    cache = tmp_path_factory.mktemp("toy_cache")
    return warm_start(cache, digits=1, target_accuracy=(0.0, 1.0), max_seconds=60.0, max_steps=40,
                      eval_every=40, n_eval=16, seed=0)
