"""verl_ext.data.toy.model and .scoring: tokenizer, tiny Llama, generation with left padding, sampled accuracy."""

import pytest
import torch

from verl_ext.data.toy.model import CHARS, SPECIAL_TOKENS, build_tokenizer, new_toy_model, toy_model_config
from verl_ext.data.toy.problems import make_problems
from verl_ext.data.toy.scoring import toy_accuracy


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
# model


def test_model_config_matches_spec(tok, random_model):
    cfg = toy_model_config(tok)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size) == (128, 4, 4, 512)
    assert cfg.tie_word_embeddings and cfg.vocab_size == len(tok)
    assert random_model.get_input_embeddings().weight is random_model.get_output_embeddings().weight
    n = sum(p.numel() for p in random_model.parameters())
    assert 0.9e6 < n < 1.2e6
    assert toy_model_config(tok, num_hidden_layers=2).num_hidden_layers == 2


def test_new_toy_model_is_a_function_of_its_seed():
    (a, tok), (b, _), (c, _) = new_toy_model(0), new_toy_model(0), new_toy_model(1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    assert a.generation_config.eos_token_id == tok.eos_token_id and a.generation_config.pad_token_id == tok.pad_token_id


# ---------------------------------------------------------------------------------------------
# generation and accuracy


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
