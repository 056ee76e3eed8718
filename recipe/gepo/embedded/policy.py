"""A causal LM as a policy: sample G responses per prompt with their log-probs, and score them.

HF transformers on CPU or one GPU (where :mod:`recipe.gepo.embedded.model_placement` put the model).
The sampler and the learner compute log-probabilities of
the same distribution: ``log_softmax(logits / temperature)``, as verl's actor does, so that
p / q compares like with like.

Shapes: N prompts, G responses each, B = N * G sequences, P prompt tokens (left-padded),
R response tokens (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

# the sampling call and the log-prob rule are verl_ext.sampling's; the learner scores with the same
from verl_ext.sampling import eos_mask, generate


@dataclass
class SampledBatch:
    """What one generation call produced; rows are grouped: rows g*G .. g*G+G-1 share prompt g.

    Attributes:
        prompt_ids: int64 [B, P], left-padded.
        prompt_mask: int64 [B, P].
        response_ids: int64 [B, R], right-padded with the pad token.
        response_mask: int64 [B, R], 1 up to and including the first EOS.
        sampler_logprobs: float32 [B, R], log q of each response token (temperature applied).
        texts: the B decoded responses (special tokens dropped).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    sampler_logprobs: torch.Tensor
    texts: list[str]


def load_policy(path: str, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model and tokenizer from a local HF folder (no hub access)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model, tokenizer


@torch.no_grad()
def sample_groups(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    group_size: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    gumbel_seeds: Optional[list[int]] = None,
) -> SampledBatch:
    """G samples per prompt at ``temperature`` (no top-k/top-p: q is exactly softmax(logits / T)),
    through :func:`verl_ext.sampling.generate`.

    ``seed`` fixes the sampling, so replay runs and resumed runs regenerate the same tokens.
    The model generates where it is, in its own dtype; the returned tensors are on the CPU (log q
    computed in fp32 from the model's logits). ``gumbel_seeds``: one per prompt, each prompt's G
    responses drawn by seeded Gumbel-max (``hetero.trust.checkable_sampling``; ``seed`` unused).
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 for sampling")
    repeated = [p for p in prompts for _ in range(group_size)]
    enc = tokenizer(repeated, return_tensors="pt", padding=True)
    device = next(model.parameters()).device  # the prompts go where the model is; the results come back
    gen = generate(
        model,
        enc["input_ids"].to(device),
        enc["attention_mask"].to(device),
        max_new_tokens=max_new_tokens,
        eos_token_ids=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        temperature=temperature,
        seed=seed,
        gumbel_seeds=gumbel_seeds,
    )
    tokens, log_q = gen.tokens.to("cpu"), gen.log_q.to("cpu")
    response_mask = eos_mask(tokens, tokenizer.eos_token_id)
    logprobs = log_q * response_mask
    response_ids = torch.where(response_mask.bool(), tokens, torch.full_like(tokens, tokenizer.pad_token_id))
    texts = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    return SampledBatch(enc["input_ids"], enc["attention_mask"], response_ids, response_mask, logprobs, texts)
