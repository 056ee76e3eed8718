"""Which evaluation options each generation engine honours, decided before vLLM is imported.

vLLM cannot run on this CPU machine (and is not installed), so these tests check the pure
functions that choose and validate the options (``check_engine_options``, ``resolve_engine``,
``vllm_llm_kwargs``) and that the entry points call them before anything is loaded.
"""

from __future__ import annotations

import sys

import pytest

from verl_ext.eval.run import EvalConfig, run_evaluation
from verl_ext.eval.generate import (
    SamplingParams,
    check_engine_options,
    make_generator,
    resolve_engine,
    vllm_available,
    vllm_llm_kwargs,
)


@pytest.fixture
def hf_folder(tmp_path):
    """A folder resolve_model_path accepts as an HF model (only config.json is looked at)."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "tok").mkdir()
    return tmp_path / "model", tmp_path / "tok"


@pytest.mark.parametrize(
    "key,value,extra",
    [
        ("device", "cpu", {}),
        ("device", "cuda:1", {}),
        ("tokenizer_path", "/models/base/tokenizer.gguf", {}),
        ("batch_size", 4, {"samples_per_problem": 8}),
    ],
)
def test_vllm_refuses_an_option_it_would_ignore_naming_key_and_value(key, value, extra):
    with pytest.raises(ValueError) as err:
        check_engine_options("vllm", **{key: value, **extra})
    assert f"{key}={value!r}" in str(err.value) and "engine=vllm" in str(err.value)
    # HF honours every one of them
    check_engine_options("hf", **{key: value, **extra})


@pytest.mark.parametrize("dtype", ["auto", "float32", "bfloat16", "float16"])
@pytest.mark.parametrize("device", ["auto", "cuda", "cuda:0"])
def test_vllm_accepts_what_it_honours(dtype, device):
    check_engine_options(
        "vllm", tokenizer_path="/models/base", dtype=dtype, device=device, batch_size=16, samples_per_problem=8
    )


def test_unknown_dtype_or_engine_is_named():
    for engine in ("hf", "vllm"):
        with pytest.raises(ValueError, match="dtype='fp8'"):
            check_engine_options(engine, dtype="fp8")
    with pytest.raises(ValueError, match="sglang"):
        resolve_engine("sglang")


def test_auto_picks_vllm_only_when_it_honours_every_option():
    # vllm_usable=True: as on a GPU machine with vLLM installed (decided, not imported)
    assert resolve_engine("auto", vllm_usable=True, device="auto") == "vllm"
    assert resolve_engine("auto", vllm_usable=True, device="cpu") == "hf"
    assert resolve_engine("auto", vllm_usable=True, tokenizer_path="/t/tok.gguf") == "hf"
    assert resolve_engine("auto", vllm_usable=True, batch_size=2, samples_per_problem=8) == "hf"
    assert resolve_engine("auto", vllm_usable=False, device="auto") == "hf"
    with pytest.raises(ValueError, match="device='cpu'"):
        resolve_engine("vllm", vllm_usable=True, device="cpu")


def test_vllm_kwargs_pass_tokenizer_dtype_and_seed_through(hf_folder):
    model, tok = hf_folder
    kw = vllm_llm_kwargs(model, dtype="float32", seed=7, tokenizer_path=tok)
    assert kw == {"model": str(model), "dtype": "float32", "seed": 7, "tokenizer": str(tok)}
    assert "tokenizer" not in vllm_llm_kwargs(model, dtype="bfloat16")
    gguf = model.parent / "m.gguf"
    gguf.write_bytes(b"")
    assert vllm_llm_kwargs(gguf)["model"] == str(gguf)
    with pytest.raises(FileNotFoundError, match="tokenizer_path"):
        vllm_llm_kwargs(model, tokenizer_path=model.parent / "nowhere")


def test_make_generator_refuses_before_importing_vllm(hf_folder):
    model, _ = hf_folder
    with pytest.raises(ValueError, match="device='cpu'"):
        make_generator("vllm", model, SamplingParams(), device="cpu")
    with pytest.raises(ValueError, match="batch_size=2"):
        make_generator("vllm", model, SamplingParams(), batch_size=2, samples_per_problem=4)
    assert "vllm" not in sys.modules


def test_evaluation_config_refuses_at_start(hf_folder, tmp_path):
    model, _ = hf_folder
    with pytest.raises(ValueError, match="device='cpu'"):
        EvalConfig(model_path=str(model), engine="vllm", device="cpu", benchmarks=["toy"])
    with pytest.raises(ValueError, match="batch_size=4"):
        EvalConfig(model_path=str(model), engine="vllm", batch_size=4, samples_per_problem=8, benchmarks=["toy"])
    # accepted settings get as far as vLLM itself (not installed here), nothing silently changed
    cfg = EvalConfig(
        model_path=str(model),
        engine="vllm",
        dtype="float32",
        device="cuda",
        benchmarks=["toy"],
        toy_n=1,
        samples_per_problem=2,
        batch_size=2,
        output_dir=str(tmp_path / "out"),
        progress=False,
    )
    if vllm_available():
        pytest.skip("vllm is installed: the run would start it")
    with pytest.raises(ImportError, match="vllm"):
        run_evaluation(cfg)
