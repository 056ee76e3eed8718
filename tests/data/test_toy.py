"""The toy addition task: tokenizer, problems, tiny Llama, generation with left padding, warm start."""

import json
import time

import pytest
import torch

from verl_ext.data.toy import (
    CHARS,
    SPECIAL_TOKENS,
    WARM_START_INFO,
    build_tokenizer,
    load_toy_model,
    make_problem,
    make_problems,
    toy_accuracy,
    toy_model_config,
    warm_start,
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def random_model(tok):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    # large init: untrained outputs then depend strongly on the input, so padding bugs show
    return LlamaForCausalLM(toy_model_config(tok, initializer_range=0.5)).eval()


# ---------------------------------------------------------------------------------------------
# tokenizer


def test_tokenizer_ids_roundtrip_and_specials(tok):
    assert len(tok) == 4 + len(CHARS) == 16
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    ids = tok("047+385=0432")["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + 12  # one token per character
    assert tok.decode(ids, skip_special_tokens=True) == "047+385=0432"
    assert tok.decode(ids) == "<s>047+385=0432"
    assert tok("7?")["input_ids"][-1] == tok.unk_token_id


def test_tokenizer_left_pads(tok):
    enc = tok(["1+2=", "047+385="], padding=True, return_tensors="pt")
    assert enc["input_ids"].shape == (2, 9)
    assert enc["input_ids"][0, :4].tolist() == [tok.pad_token_id] * 4
    assert enc["attention_mask"][0].tolist() == [0] * 4 + [1] * 5
    assert enc["input_ids"][0, -1].item() == tok.convert_tokens_to_ids("=")


def test_tokenizer_saves_as_a_normal_hf_tokenizer(tok, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    assert isinstance(tok, PreTrainedTokenizerFast)
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.padding_side == "left"
    assert again("047+385=")["input_ids"] == tok("047+385=")["input_ids"]
    assert again.pad_token == SPECIAL_TOKENS["pad_token"] and again.eos_token == SPECIAL_TOKENS["eos_token"]
    assert again.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False) == "<s>1+2="


# ---------------------------------------------------------------------------------------------
# problems and model config


def test_make_problem_zero_pads():
    assert make_problem(47, 385, 3) == ("047+385=", "0432")
    assert make_problem(999, 999, 3) == ("999+999=", "1998")
    assert make_problem(0, 0, 2) == ("00+00=", "000")


@pytest.mark.parametrize("a,b,digits,match", [(1000, 1, 3, "a must"), (1, -1, 3, "b must"), (1, 1, 0, "digits"), (1, 1, 10, "digits")])
def test_make_problem_rejects_bad_values(a, b, digits, match):
    with pytest.raises(ValueError, match=match):
        make_problem(a, b, digits)


def test_make_problems_deterministic_and_correct():
    a = make_problems(200, digits=4, seed=11)
    assert a == make_problems(200, digits=4, seed=11)
    assert a != make_problems(200, digits=4, seed=12)
    for r in a:
        x, y = r["meta"]["a"], r["meta"]["b"]
        assert r["problem"] == f"{x:04d}+{y:04d}="
        assert r["answer"] == f"{x + y:05d}"
        assert r["data_source"] == "toy_add4"
    assert len({r["id"] for r in a}) == 200
    with pytest.raises(ValueError, match="n must"):
        make_problems(0)


def test_model_config_matches_spec(tok, random_model):
    cfg = toy_model_config(tok)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size) == (128, 4, 4, 512)
    assert cfg.tie_word_embeddings and cfg.vocab_size == len(tok)
    assert random_model.get_input_embeddings().weight is random_model.get_output_embeddings().weight
    n = sum(p.numel() for p in random_model.parameters())
    assert 0.9e6 < n < 1.2e6
    assert toy_model_config(tok, num_hidden_layers=2).num_hidden_layers == 2


# ---------------------------------------------------------------------------------------------
# generation


def test_batched_left_padded_generation_equals_one_by_one(tok, random_model):
    # mixed lengths force padding; greedy decoding must not depend on the batch it runs in
    problems = make_problems(6, digits=1, seed=1) + make_problems(6, digits=3, seed=2)
    kw = dict(temperature=0.0, max_new_tokens=5, return_completions=True)
    _, batched = toy_accuracy(random_model, tok, problems, batch_size=12, **kw)
    singles = [toy_accuracy(random_model, tok, [p], **kw)[1][0] for p in problems]
    assert batched == singles
    assert len(set(batched)) > 3  # input-dependent outputs, not one constant string
    assert len(batched) == 12 and all(isinstance(c, str) for c in batched)


def test_toy_accuracy_is_seeded_and_leaves_global_rng_alone(tok, random_model):
    problems = make_problems(64, digits=2, seed=3)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = toy_accuracy(random_model, tok, problems, temperature=1.0, seed=7, return_completions=True)
    after = torch.rand(1)
    assert torch.equal(before, after)
    assert a == toy_accuracy(random_model, tok, problems, temperature=1.0, seed=7, return_completions=True)
    assert a[1] != toy_accuracy(random_model, tok, problems, temperature=1.0, seed=8, return_completions=True)[1]


def test_toy_accuracy_bad_input(tok, random_model):
    with pytest.raises(ValueError, match="at least one problem"):
        toy_accuracy(random_model, tok, [])
    with pytest.raises(ValueError, match="temperature"):
        toy_accuracy(random_model, tok, make_problems(1), temperature=-1.0)


# ---------------------------------------------------------------------------------------------
# warm start


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"digits": 0}, "digits"),
        ({"target_accuracy": (0.7, 0.2)}, "target_accuracy"),
        ({"target_accuracy": 0.5}, "target_accuracy"),
        ({"max_seconds": 0}, "max_seconds"),
        ({"eval_every": 0}, "eval_every"),
        ({"num_threads": 0}, "num_threads"),
        ({"lr": -1.0}, "lr"),
    ],
)
def test_warm_start_rejects_bad_settings(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        warm_start(tmp_path, **kwargs)


def test_small_warm_start_saves_caches_and_reloads(tmp_path):
    """1-digit addition, a small step budget: exercises the full loop, the cache and the HF folder."""
    settings = dict(digits=1, target_accuracy=(0.2, 0.7), max_seconds=120, seed=0, eval_every=20, n_eval=128, max_steps=400)
    t0 = time.monotonic()
    path = warm_start(tmp_path, **settings)
    first = time.monotonic() - t0
    info = json.loads((path / WARM_START_INFO).read_text())
    assert info["settings"]["digits"] == 1 and info["n_eval"] == 128
    assert info["history"] and info["history"][-1][0] == info["steps"]
    assert info["in_target"] == (0.2 <= info["accuracy"] <= 0.7)
    assert info["in_target"], info  # 1-digit sums are learnt within the budget
    # every earlier evaluation was outside the window: it stopped at the first one inside
    assert all(not 0.2 <= row[2] <= 0.7 for row in info["history"][:-1])

    # the cache: same settings return at once, other settings get their own folder
    t0 = time.monotonic()
    assert warm_start(tmp_path, **settings) == path
    assert time.monotonic() - t0 < min(1.0, first)
    assert warm_start(tmp_path, **{**settings, "max_steps": 20, "target_accuracy": (0.99, 1.0)}) != path

    # a normal HF folder: Auto* classes load it and reproduce the recorded accuracy exactly
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    held_out = make_problems(128, digits=1, seed=0 + 10**6)
    assert toy_accuracy(model, tok, held_out, temperature=1.0, seed=0 + info["steps"]) == info["accuracy"]
    m2, t2 = load_toy_model(path)
    assert t2.padding_side == "left"
    out = m2.generate(**t2(["3+4=", "12+34="], return_tensors="pt", padding=True), max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 2


@pytest.mark.slow
def test_three_digit_warm_start_reaches_the_window(tmp_path):
    path = warm_start(tmp_path, digits=3, target_accuracy=(0.2, 0.7), max_seconds=1200)
    info = json.loads((path / WARM_START_INFO).read_text())
    assert info["in_target"], info
    model, tok = load_toy_model(path)
    fresh = make_problems(512, digits=3, seed=99)
    acc = toy_accuracy(model, tok, fresh, temperature=1.0, seed=1)
    assert 0.1 <= acc <= 0.8  # the window, measured again on other problems (sampling noise allowed)


# ---------------------------------------------------------------------------------------------
# pinned warm start


def test_pinned_warm_start_is_a_pure_function_of_its_settings(tmp_path):
    """Two trainings in separate caches give bit-identical weights (same sha256), recorded in the
    info file; another seed or step count gives other weights."""
    from verl_ext.data.toy import weights_sha256

    kw = dict(digits=1, steps=12, seed=0, batch_size=16, warmup_steps=2, n_eval=16)
    a = warm_start(tmp_path / "a", **kw)
    b = warm_start(tmp_path / "b", **kw)
    info = json.loads((a / WARM_START_INFO).read_text())
    assert info["stop_reason"] == "steps" and info["steps"] == 12 and info["in_target"] is None
    assert info["weights_sha256"] == weights_sha256(a) == weights_sha256(b)
    assert json.loads((b / WARM_START_INFO).read_text())["weights_sha256"] == info["weights_sha256"]
    assert a.name.startswith("toy_add1-pin12-") and warm_start(tmp_path / "a", **kw) == a  # cached
    assert weights_sha256(warm_start(tmp_path / "a", **{**kw, "seed": 1})) != info["weights_sha256"]
    assert weights_sha256(warm_start(tmp_path / "a", **{**kw, "steps": 13})) != info["weights_sha256"]
    # the recorded accuracy is toy_accuracy's on the documented problems and seed
    model, tok = load_toy_model(a)
    held_out = make_problems(16, digits=1, seed=10**6)
    assert toy_accuracy(model, tok, held_out, temperature=1.0, seed=12) == info["accuracy"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"target_accuracy": (0.2, 0.7)}, "target_accuracy"),
        ({"max_seconds": 60}, "max_seconds"),
        ({"max_steps": 5}, "max_steps"),
        ({"eval_every": 5}, "eval_every"),
        ({"num_threads": 2}, "num_threads"),
        ({"steps": 0}, "steps"),
    ],
)
def test_pinned_warm_start_refuses_window_settings(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        warm_start(tmp_path, digits=1, **{"steps": 3, **kwargs})


def test_weights_sha256_hashes_tensors_not_files(tmp_path):
    from safetensors.torch import save_file

    from verl_ext.data.toy import weights_sha256

    x, y = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(2)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    save_file({"x": x, "y": y}, str(tmp_path / "a" / "model.safetensors"), metadata={"format": "pt"})
    save_file({"y": y, "x": x}, str(tmp_path / "b" / "model.safetensors"))  # other order and metadata
    assert weights_sha256(tmp_path / "a") == weights_sha256(tmp_path / "b")
    save_file({"x": x.reshape(3, 2), "y": y}, str(tmp_path / "b" / "model.safetensors"))
    assert weights_sha256(tmp_path / "a") != weights_sha256(tmp_path / "b")  # the shape counts
    with pytest.raises(FileNotFoundError, match="safetensors"):
        weights_sha256(tmp_path)


_THREADS_SCRIPT = """
import hashlib, json, sys, torch
from verl_ext.data import toy
torch.set_num_threads(int(sys.argv[1]))
settings = {"recipe_version": 1, "mode": "pinned", "digits": 3, "answer_format": "scratchpad", "steps": 20, "seed": 0,
            "batch_size": 64, "lr": 1e-3, "warmup_steps": 50, "n_eval": 8, "eval_temperature": 1.0}
with toy._deterministic_torch():
    model, _, _ = toy._train_pinned(settings)
h = hashlib.sha256()
for k, v in sorted(model.state_dict().items()):
    h.update(k.encode()); h.update(v.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
print(json.dumps({"threads": torch.get_num_threads(), "sha": h.hexdigest()}))
"""


@pytest.mark.slow
def test_pinned_training_gives_the_same_weights_with_one_and_two_threads():
    """The claim of docs/study.md: the pinned recipe's weights do not depend on the thread count
    (here; pinned warm starts still train with one thread, as other BLAS builds may differ)."""
    import os
    import subprocess
    import sys

    out = []
    for n in (1, 2):
        env = {**os.environ, "OMP_NUM_THREADS": str(n)}
        proc = subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, str(n)], capture_output=True, text=True, env=env,
                              timeout=900)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert [o["threads"] for o in out] == [1, 2]
    assert out[0]["sha"] == out[1]["sha"]
