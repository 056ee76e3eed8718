"""HFGenerator on the toy model (real model, real tokenizer) and model-path resolution."""

from __future__ import annotations

import pytest
import torch

from verl_ext.eval.generate import SamplingParams, make_generator, resolve_model_path


def test_seeded_sampling_repeats_and_leaves_global_rng_alone(hf_gen):
    prompts = ["3+4=", "9+9=", "0+0="]
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = hf_gen.generate(prompts, 5, seed=11)
    after = torch.rand(3)
    assert torch.equal(before, after)  # generate forked the RNG
    b = hf_gen.generate(prompts, 5, seed=11)
    assert [[c.text for c in row] for row in a] == [[c.text for c in row] for row in b]
    assert len(a) == 3 and all(len(row) == 5 for row in a)
    c = hf_gen.generate(prompts, 5, seed=12)
    assert [[x.text for x in row] for row in a] != [[x.text for x in row] for row in c]


def test_stop_tokens_and_truncation_flags(hf_gen):
    tok = hf_gen.tokenizer
    rows = hf_gen.generate(["1+2=", "5+5=", "7+8="], 8, seed=0)
    for row in rows:
        for comp in row:
            assert 1 <= comp.n_tokens <= hf_gen.params.max_new_tokens
            assert tok.eos_token not in comp.text and tok.pad_token not in comp.text
            if comp.truncated:
                assert comp.n_tokens == hf_gen.params.max_new_tokens
            else:  # the stop token is counted; special tokens before it are dropped from the text
                assert len(tok(comp.text, add_special_tokens=False)["input_ids"]) <= comp.n_tokens - 1
    # a budget of one token: every sample that did not stop at once is truncated
    one = type(hf_gen)(hf_gen.model, tok, SamplingParams(max_new_tokens=1), batch_size=4, show_progress=False)
    for row in one.generate(["1+2=", "5+5="], 3, seed=0):
        for comp in row:
            assert comp.n_tokens == 1
            assert comp.truncated or comp.text == ""  # not truncated means it stopped at once


def test_model_path_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match="model_path is not set"):
        resolve_model_path(None)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        resolve_model_path(tmp_path / "nowhere")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="weights.bin"):
        resolve_model_path(tmp_path / "weights.bin")
    (tmp_path / "a.gguf").write_bytes(b"")
    assert resolve_model_path(tmp_path) == (tmp_path, "a.gguf")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="2 .gguf files"):
        resolve_model_path(tmp_path)
    with pytest.raises(ValueError, match="sglang"):
        make_generator("sglang", tmp_path, SamplingParams())
    for bad, msg in (
        ({"temperature": 0}, "temperature=0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(**bad)
