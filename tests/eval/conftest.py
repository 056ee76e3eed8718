"""Shared fixtures of the evaluation tests."""

from __future__ import annotations

import json

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
def toy_scratchpad_model_path():
    """The scratchpad warm start shipped with the package (3 digits, 210 steps, seed 0; sampled
    accuracy 0.227 on 256 problems), its bytes checked against the hash it was shipped with.

    Shipped, not trained here: the same recipe trains other weights on another CPU
    (``docs/study.md``, *Machines*), and a test of the evaluation must not depend on what this
    machine's arithmetic makes of a training run.
    """
    from verl_ext.data.toy.checkpoints import PINNED_WARM_STARTS, WARM_START_INFO, warm_start_folder, weights_sha256

    folder = warm_start_folder(PINNED_WARM_STARTS, answer_format="scratchpad")
    info = json.loads((folder / WARM_START_INFO).read_text())
    assert info["settings"]["digits"] == 3 and info["settings"]["answer_format"] == "scratchpad"
    assert weights_sha256(folder) == info["weights_sha256"]
    return folder


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
