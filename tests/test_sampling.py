"""One sampling routine, so the engines and evaluation cannot drift apart: the embedded engine's ``sample_groups``, evaluation's
``HFGenerator`` and the hf_cpu server's ``sample_continuations`` all sample through
``verl_ext.sampling.generate``: same seed and batch -> the same tokens in all three."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from recipe.gepo.embedded.policy import sample_groups
from verl_ext.data.toy.model import build_tokenizer, toy_model_config
from verl_ext.eval.generate import HFGenerator, SamplingParams
from verl_ext.sampling import eos_mask, generate, sample_continuations, token_log_probs

PROMPTS = ["047+385=", "1+2=", "555+555="]


@pytest.fixture(scope="module")
def model_and_tok():
    tok = build_tokenizer()
    tok.padding_side = "left"
    torch.manual_seed(0)
    return LlamaForCausalLM(toy_model_config(tok)).eval(), tok


def _enc(tok, prompts):
    return tok(prompts, return_tensors="pt", padding=True)


def test_eos_mask_keeps_the_first_stop_and_nothing_after():
    tokens = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [3, 5, 9, 9]])
    assert eos_mask(tokens, 2).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]
    assert eos_mask(tokens, [3, 7]).tolist() == [[1, 1, 1, 0], [1, 1, 1, 0], [1, 0, 0, 0]]


def test_seeded_generate_is_reproducible_and_leaves_the_callers_rng(model_and_tok):
    model, tok = model_and_tok
    enc = _enc(tok, PROMPTS)
    kw = dict(max_new_tokens=6, eos_token_ids=tok.eos_token_id, pad_token_id=tok.pad_token_id, temperature=1.3)
    torch.manual_seed(123)
    a = generate(model, enc["input_ids"], enc["attention_mask"], seed=5, **kw)
    after = torch.rand(4)
    torch.manual_seed(123)
    b = generate(model, enc["input_ids"], enc["attention_mask"], seed=5, **kw)
    assert torch.equal(torch.rand(4), after)  # the caller's stream went on as if nothing was drawn
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.log_q, b.log_q)
    c = generate(model, enc["input_ids"], enc["attention_mask"], seed=6, **kw)
    assert not torch.equal(a.tokens, c.tokens)
    # log q is the learner's rule: log softmax(logits / T) of a teacher-forced pass
    full = torch.cat([enc["input_ids"], a.tokens], 1)
    mask = torch.cat([enc["attention_mask"], torch.ones_like(a.tokens)], 1)
    logits = model(input_ids=full, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    forced = token_log_probs(logits[:, enc["input_ids"].shape[1] - 1 : -1], a.tokens, 1.3)
    live = eos_mask(a.tokens, tok.eos_token_id).bool()
    torch.testing.assert_close(a.log_q[live], forced[live], atol=1e-4, rtol=0)


def test_the_three_samplers_draw_the_same_tokens(model_and_tok):
    model, tok = model_and_tok
    enc = _enc(tok, PROMPTS)
    ref = generate(
        model,
        enc["input_ids"],
        enc["attention_mask"],
        max_new_tokens=8,
        eos_token_ids=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        temperature=1.0,
        seed=9,
    )
    live = eos_mask(ref.tokens, tok.eos_token_id)

    groups = sample_groups(model, tok, PROMPTS, 1, 1.0, 8, seed=9)
    assert torch.equal(groups.response_mask, live)
    assert torch.equal(groups.response_ids[live.bool()], ref.tokens[live.bool()])
    assert torch.equal(groups.sampler_logprobs, ref.log_q * live)

    ids = [row[m.bool()].tolist() for row, m in zip(enc["input_ids"], enc["attention_mask"])]  # the same prompts
    conts = sample_continuations(model, ids, 8, [tok.eos_token_id], tok.pad_token_id, 1.0, generator_seed=9)
    for row, c in enumerate(conts):
        n = int(live[row].sum())
        assert c.token_ids == ref.tokens[row, :n].tolist() and c.log_probs == ref.log_q[row, :n].tolist()
        assert c.finished == (ref.tokens[row, n - 1].item() == tok.eos_token_id)

    gen = HFGenerator(
        model,
        tok,
        SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8),
        batch_size=len(PROMPTS),
        show_progress=False,
    )
    assert gen.stop_ids == [tok.eos_token_id]
    comps = gen.generate(PROMPTS, 1, seed=9)  # batch 0 is seeded with seed + 0
    for row, (c,) in enumerate(comps):
        n = int(live[row].sum())
        assert c.n_tokens == n and c.text == tok.decode(ref.tokens[row, :n], skip_special_tokens=True)
