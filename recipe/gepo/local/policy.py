"""A causal LM as a policy: sample G responses per prompt with their log-probs, and score them.

HF transformers on CPU (or one GPU). The sampler and the learner compute log-probabilities of
the same distribution: ``log_softmax(logits / temperature)``, as verl's actor does, so that
p / q compares like with like.

Shapes: N prompts, G responses each, B = N * G sequences, P prompt tokens (left-padded),
R response tokens (right-padded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase


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


def response_mask_from_eos(response_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """1 on generated tokens up to and including the first EOS, 0 after it. [B, R] -> [B, R]."""
    is_eos = (response_ids == eos_token_id).long()
    eos_before = torch.cumsum(is_eos, dim=-1) - is_eos  # EOS strictly before this position
    return (eos_before == 0).long()


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at ``tokens``: logits [B, R, V], tokens [B, R] -> [B, R]."""
    log_probs = F.log_softmax(logits.float() / temperature, dim=-1)
    return torch.gather(log_probs, -1, tokens.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def sample_groups(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    group_size: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
) -> SampledBatch:
    """G samples per prompt at ``temperature`` (no top-k/top-p: q is exactly softmax(logits / T)).

    ``seed`` fixes the sampling, so replay runs and resumed runs regenerate the same tokens.
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 for sampling")
    repeated = [p for p in prompts for _ in range(group_size)]
    enc = tokenizer(repeated, return_tensors="pt", padding=True)
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=enc["input_ids"],
        attention_mask=enc["attention_mask"],
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    prompt_len = enc["input_ids"].shape[1]
    response_ids = out.sequences[:, prompt_len:]
    logits = torch.stack(out.logits, dim=1)  # [B, R, V], raw (before temperature)
    response_mask = response_mask_from_eos(response_ids, tokenizer.eos_token_id)
    logprobs = token_log_probs(logits, response_ids, temperature) * response_mask
    response_ids = torch.where(response_mask.bool(), response_ids, torch.full_like(response_ids, tokenizer.pad_token_id))
    texts = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    return SampledBatch(enc["input_ids"], enc["attention_mask"], response_ids, response_mask, logprobs, texts)


def sequence_token_log_probs(
    model: PreTrainedModel,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Learner log-probs of the given responses, with gradient: [B, P] + [B, R] -> [B, R].

    Position ids follow the attention mask, so left padding of the prompt does not shift them
    (matching what ``generate`` used).
    """
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    prompt_len = prompt_ids.shape[1]
    # logits at position t predict token t+1: the response is predicted by positions P-1 .. P+R-2
    response_logits = logits[:, prompt_len - 1 : -1]
    return token_log_probs(response_logits, response_ids, temperature)
