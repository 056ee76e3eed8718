"""Shared fixtures of the evaluation tests."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def toy_model_path(tmp_path_factory):
    """A briefly warm-started toy model (1-digit addition, 40 optimizer steps) in a tmp folder.

    Accuracy is low but not always zero; the tests check arithmetic and resumption, not skill.
    The step cap, not the (generous) time budget, ends training, so the model does not depend
    on how loaded the machine is.
    """
    from verl_ext.data.toy import warm_start

    cache = tmp_path_factory.mktemp("toy_cache")
    return warm_start(cache, digits=1, target_accuracy=(0.0, 1.0), max_seconds=900.0, max_steps=40,
                      eval_every=40, n_eval=16, seed=0)


#: sequences per generate call of the shared generator
BATCH = 12


@pytest.fixture(scope="session")
def hf_gen(toy_model_path):
    """The real HF generator on the toy model with the paper's sampling and 6 new tokens."""
    from verl_ext.eval.generate import HFGenerator, SamplingParams

    return HFGenerator.from_path(toy_model_path, SamplingParams(max_new_tokens=6), batch_size=BATCH,
                                 dtype="float32", device="cpu", show_progress=False)
