"""Shared fixtures of the evaluation tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def toy_model_path(tmp_path_factory):
    """A briefly warm-started toy model (1-digit addition, 40 optimizer steps) in a tmp folder.

    Accuracy is low but not always zero; the tests check arithmetic and resumption, not skill.
    The warm start is pinned (a fixed number of steps), so the model does not depend on how
    loaded the machine is.
    """
    from verl_ext.data.toy.checkpoints import warm_start

    cache = tmp_path_factory.mktemp("toy_cache")
    return warm_start(cache, digits=1, steps=40, n_eval=16, seed=0)


@pytest.fixture(scope="session")
def toy_scratchpad_model_path(tmp_path_factory):
    """A 1-digit scratchpad warm start (100 steps of 16 problems, ~5 s): writes ``a b c s s = sum``
    and gets the sum right about a quarter of the time at temperature 1 (0.26 on 256 problems)."""
    from verl_ext.data.toy.checkpoints import warm_start

    cache = tmp_path_factory.mktemp("toy_scratch_cache")
    return warm_start(
        cache, digits=1, steps=100, batch_size=16, warmup_steps=10, n_eval=16, seed=0, answer_format="scratchpad"
    )


#: sequences per generate call of the shared generator
BATCH = 12


@pytest.fixture(scope="session")
def hf_gen(toy_model_path):
    """The real HF generator on the toy model with the paper's sampling and 6 new tokens."""
    from verl_ext.eval.generate import HFGenerator, SamplingParams

    return HFGenerator.from_path(
        toy_model_path,
        SamplingParams(max_new_tokens=6),
        batch_size=BATCH,
        dtype="float32",
        device="cpu",
        show_progress=False,
    )
