"""Sampling from a HF causal LM: the one ``model.generate`` call of the project, with the sampler's
log-probs.

q is ``log_softmax(logits / temperature)`` at each sampled token -- what verl's actor computes as
the learner's p (``logprobs_mode=processed_logprobs`` without top-k/top-p truncation) and what the
embedded learner scores (:func:`token_log_probs`) -- so p/q compares like with like.

* :func:`generate` -- one batched ``model.generate`` on left-padded prompts, seeded, with log q;
  every sampler calls it: the embedded engine's ``sample_groups`` (``recipe.gepo.embedded.policy``),
  evaluation's ``HFGenerator`` (:mod:`verl_ext.eval.generate`) and, through
  :func:`sample_continuations`, the ``hf_cpu`` rollout server (:mod:`verl_ext.cpu.rollout`).
* :func:`eos_mask` -- where each continuation ends (its first stop token, kept).

Shapes: N prompts of P tokens (left-padded), R generated tokens, V the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at ``tokens``, in float32: logits [N, R, V], tokens [N, R] -> [N, R]."""
    log_probs = F.log_softmax(logits.float() / temperature, dim=-1)
    return torch.gather(log_probs, -1, tokens.unsqueeze(-1)).squeeze(-1)


def eos_mask(tokens: torch.Tensor, eos_token_ids: int | Sequence[int]) -> torch.Tensor:
    """int64 [N, R]: 1 on generated tokens up to and including the first stop token, 0 after it."""
    stop = torch.as_tensor(
        [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids), device=tokens.device
    )
    is_eos = torch.isin(tokens, stop).long()
    eos_before = torch.cumsum(is_eos, dim=-1) - is_eos  # a stop token strictly before this position
    return (eos_before == 0).long()


@dataclass(frozen=True)
class Generation:
    """What one :func:`generate` call produced."""

    tokens: torch.Tensor
    """int64 [N, R]: the generated tokens (after the prompt); a row that stopped early is filled
    with the pad token up to R."""
    log_q: Optional[torch.Tensor]
    """float32 [N, R]: log softmax(logits / T) at each generated token (T = 1 when greedy), or
    None when not asked for."""


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_ids: int | Sequence[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: Optional[int] = None,
    with_log_q: bool = True,
    gumbel_seeds: Optional[Sequence[int]] = None,
) -> Generation:
    """Continue every prompt once.

    Args:
        model: a HF ``PreTrainedModel`` with ``generate``.
        input_ids, attention_mask: [N, P], left-padded (new tokens follow the prompt directly), on
            the model's device; the results are there too (log q in float32 whatever the model's dtype).
        max_new_tokens: >= 1.
        eos_token_ids: id(s) that end a continuation.
        pad_token_id: fills a finished row.
        temperature: 0 = greedy; > 0 samples softmax(logits / T).
        top_p, top_k: nucleus / top-k truncation of the sampling (k <= 0: off). log q stays that of
            the untruncated softmax(logits / T), as verl's actor computes it.
        seed: seeds the sampling (same seed, model and batch -> same tokens) and leaves the caller's
            torch RNG as it was; None draws from torch's global RNG.
        with_log_q: also return log q (keeps the logits of every step: off for long generations
            that need only the tokens).
        gumbel_seeds: draw by seeded Gumbel-max instead (:class:`verl_ext.trust.gumbel.GumbelMax`:
            sampling the learner can check): one seed per group of N / len(seeds) consecutive rows,
            the same softmax(logits / T) sampled with noise any machine re-derives from the seed;
            needs temperature > 0 and no truncation (``seed`` is then unused).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    greedy = temperature == 0
    processors = None
    if gumbel_seeds is not None:
        if greedy or top_p < 1.0 or (top_k and top_k > 0):
            raise ValueError(
                f"gumbel_seeds: Gumbel-max draws the untruncated softmax(logits / T); got "
                f"temperature={temperature}, top_p={top_p}, top_k={top_k}"
            )
        from transformers import LogitsProcessorList

        from verl_ext.trust.gumbel import GumbelMax

        processors = LogitsProcessorList([GumbelMax(gumbel_seeds, input_ids.shape[0], input_ids.shape[1], temperature)])
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        do_sample=not greedy,
        temperature=None if greedy else temperature,
        top_p=None if greedy else top_p,
        top_k=None if greedy else (top_k if top_k and top_k > 0 else 0),
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_ids if isinstance(eos_token_ids, int) else list(eos_token_ids),
        output_logits=with_log_q,
        return_dict_in_generate=True,
    )
    if processors is not None:  # greedy over the noised scores the processor leaves
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None, logits_processor=processors)
    if seed is None or processors is not None:
        out = model.generate(**kwargs)
    else:
        fork_devices = [input_ids.device] if input_ids.device.type == "cuda" else []
        with torch.random.fork_rng(devices=fork_devices):  # leave the caller's RNG alone
            torch.manual_seed(int(seed))
            out = model.generate(**kwargs)
    tokens = out.sequences[:, input_ids.shape[1] :]
    log_q = None
    if with_log_q:
        logits = torch.stack(out.logits, dim=1)  # [N, R, V], raw (before temperature or truncation)
        log_q = token_log_probs(logits, tokens, 1.0 if greedy else temperature)
    return Generation(tokens, log_q)


@dataclass(frozen=True)
class Continuation:
    """One sampled continuation: its token ids and log q of each of them (same length)."""

    token_ids: list[int]
    log_probs: list[float]
    finished: bool
    """True when it ended on an EOS token, False when it ran out of ``max_new_tokens``."""


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> (input_ids [N, P], attention_mask [N, P]), left-padded."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device="cpu")
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long, device="cpu")
        mask[i, width - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def sample_continuations(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_token_ids: Sequence[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    generator_seed: int | None = None,
) -> list[Continuation]:
    """One continuation per prompt.

    Args:
        model: a HF ``PreTrainedModel`` with ``generate``.
        prompts: N token-id lists (unpadded).
        max_new_tokens: >= 1.
        eos_token_ids: ids that end a continuation (kept as its last token).
        pad_token_id: id used for left padding.
        temperature: 0 = greedy (log-probs then of softmax(logits)); > 0 samples softmax(logits / T).
        top_p, top_k: nucleus / top-k truncation of the sampling (k <= 0: off). The reported
            log-probs stay those of the untruncated softmax(logits / T), as verl's actor computes.
        generator_seed: seed of the sampling (reproducible; the caller's RNG is left alone), or
            None (torch's global RNG).
    """
    input_ids, attention_mask = left_pad(prompts, pad_token_id)
    device = next(model.parameters()).device  # the prompts go where the model is
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    gen = generate(
        model,
        input_ids,
        attention_mask,
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos_token_ids,
        pad_token_id=pad_token_id,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=generator_seed,
    )
    eos = set(int(t) for t in eos_token_ids)
    lengths = eos_mask(gen.tokens, eos_token_ids).sum(dim=-1).tolist()  # up to and including the first EOS
    results = []
    for row, row_log_q, n in zip(gen.tokens.tolist(), gen.log_q.tolist(), lengths):
        results.append(Continuation(row[:n], row_log_q[:n], finished=row[n - 1] in eos))
    return results


def sequence_token_log_probs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    compute_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Learner log-probs of the given responses, with gradient: [B, P] + [B, R] -> [B, R], float32,
    on the inputs' device (the model's).

    Position ids follow the attention mask, so left padding of the prompt does not shift them
    (matching what ``generate`` used). ``compute_dtype`` (e.g. bf16): the model's forward runs
    under autocast to it (fp32 weights stay fp32); the log-softmax is fp32 either way.
    """
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    logits = forward_logits(model, input_ids, attention_mask, position_ids, compute_dtype)
    prompt_len = prompt_ids.shape[1]
    # logits at position t predict token t+1: the response is predicted by positions P-1 .. P+R-2
    response_logits = logits[:, prompt_len - 1 : -1]
    return token_log_probs(response_logits, response_ids, temperature)


def forward_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    compute_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """The model's logits [B, L, V]; with ``compute_dtype`` under ``torch.autocast`` on the inputs'
    device type (mixed precision: the weights keep their dtype, matmuls run in ``compute_dtype``)."""
    if compute_dtype is None:
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    with torch.autocast(device_type=input_ids.device.type, dtype=compute_dtype):
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
